"""The chapters' widgets as students meet them: in JupyterLab, in a real browser.

For each chapter with a widget, a temporary copy of the chapter opens in the project's own
JupyterLab (from .venv), driven by headless Chromium through Selenium. The copy holds the
widget's cell and the earlier cells it needs (those that define the names it uses, and
theirs in turn); it runs on a live kernel. Then the widget must render (its controls and an
output area with a figure), moving one control must redraw the figure, and the browser
console must show no error. A screenshot of each widget, taken after the change, goes to
artifacts/browser/ (or $MINSERVE_BROWSER_ARTIFACTS).

Chromium and chromedriver are Debian's (`bash scripts/install.sh --dev` installs them when
run as root); a missing one fails this test with what to install, it never skips.
"""

from __future__ import annotations

import ast
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
from IPython.core.inputtransformer2 import TransformerManager

from minserve.course.chapters import REPO_ROOT

pytestmark = pytest.mark.browser

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
ARTIFACTS = Path(os.environ.get("MINSERVE_BROWSER_ARTIFACTS", REPO_ROOT / "artifacts" / "browser"))
SERVER_START_S = 90  # JupyterLab answering /api/status
PAGE_S = 90  # JupyterLab's page loaded in the browser
CELLS_S = 240  # one chapter's cells, run by the kernel
REDRAW_S = 60  # a control's change reaching the figure
INSTALL_HINT = (
    "run `bash scripts/install.sh --dev` as root (it apt-get installs them), or "
    "`apt-get install chromium chromium-driver`"
)


@dataclass(frozen=True)
class WidgetCheck:
    """One chapter's widget: which control the test moves, and how."""

    chapter: str  # the notebook's stem
    control: str  # the slider's description or the button's text
    kind: Literal["slider", "button"]


CHECKS = (
    WidgetCheck("01_kv_cache_and_block_allocator", "write", "button"),
    WidgetCheck("02_paged_attention", "loads", "slider"),
    WidgetCheck("03_continuous_batching", "step", "slider"),
    WidgetCheck("04_chunked_prefill_and_preemption", "budget", "slider"),
    WidgetCheck("05_sharing_prefixes", "match + lock", "button"),
    WidgetCheck("06_speculative_decoding", "g", "slider"),
)


def python_of(source: str) -> str:
    """A code cell as the Python IPython runs: `%magic` becomes `get_ipython().run_...`."""
    return TransformerManager().transform_cell(source)


def cell_names(source: str) -> tuple[set[str], set[str]]:
    """(names a code cell binds or changes in place, names it reads and does not bind).

    A cell that reads a name and rebinds it (`x = f(x)`) is not traced back further; were
    that to drop a cell the widget needs, its run fails with a NameError, not silently."""
    tree = ast.parse(python_of(source))
    bound, changed, read = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store) else read).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            base = node.value  # `engines[method] = ...` changes engines: it still reads it
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name):
                changed.add(base.id)
    return bound | changed, read - bound


def needed_cells(sources: list[str], widget: int) -> list[int]:
    """Indices of the cells the widget's cell needs: those before it that run a magic
    (`%matplotlib inline` makes figures display), and for each name it reads, the latest
    earlier cell that binds or changes it, and the same for that cell, and so on."""
    provides, reads = zip(*map(cell_names, sources))
    needed, todo = set(), [widget]
    todo += [i for i in range(widget) if "get_ipython()" in python_of(sources[i])]
    while todo:
        cell = todo.pop()
        if cell in needed:
            continue
        needed.add(cell)
        for name in reads[cell]:
            binders = [i for i in range(cell) if name in provides[i]]
            todo.extend(binders[-1:])
    return sorted(needed)


def widget_copy(source: Path, target: Path) -> int:
    """Write to `target` the cells of `source` that its first widget needs, outputs and saved
    widget state dropped (the kernel must draw them); return how many cells the copy runs."""
    notebook = json.loads(source.read_text(encoding="utf-8"))
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    shows_widget = [
        any(WIDGET_VIEW in output.get("data", {}) for output in cell.get("outputs", []))
        for cell in code
    ]
    assert any(shows_widget), f"{source.name} stores no widget output"
    sources = ["".join(cell["source"]) for cell in code]
    kept = [code[i] for i in needed_cells(sources, shows_widget.index(True))]
    for cell in kept:
        cell["outputs"], cell["execution_count"] = [], None
    notebook["cells"] = kept
    notebook["metadata"].pop("widgets", None)
    target.write_text(json.dumps(notebook), encoding="utf-8")
    return len(kept)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Lab:
    """A running JupyterLab: where it listens and where its notebooks are."""

    url: str
    token: str
    root: Path
    started: float  # time.monotonic() when it was launched

    def api(self, path: str, method: str = "GET") -> int:
        request = urllib.request.Request(f"{self.url}{path}?token={self.token}", method=method)
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status


def lab_settings(settings: Path) -> None:
    """Settings for a quiet, predictable lab: every cell in the DOM (no virtual scrolling,
    so the test sees each one), and no news or update checks (the browser is offline)."""
    overrides = {
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification": {
            "fetchNews": "false",
            "checkForUpdates": False,
        },
    }
    for plugin, values in overrides.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values), encoding="utf-8")


def wait_for(what: str, seconds: float, probe: Callable[[], Any]) -> Any:
    """Poll `probe` until it returns something truthy; fail naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not (found := probe()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {seconds:.0f} s waiting for {what}")
        time.sleep(0.25)
    return found


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """JupyterLab from this interpreter's environment (.venv), on a free port, with a token
    of its own and Jupyter's per-user folders in a temporary directory."""
    home = tmp_path_factory.mktemp("jupyterlab")
    root, settings, log = home / "notebooks", home / "settings", home / "jupyterlab.log"
    root.mkdir()
    lab_settings(settings)
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_DATA_DIR": str(home / "data"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "IPYTHONDIR": str(home / "ipython"),
    }
    port, token = free_port(), secrets.token_hex(16)
    command = [
        sys.executable, "-m", "jupyterlab", "--no-browser",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        f"--LabApp.user_settings_dir={settings}",
        f"--LabApp.workspaces_dir={home / 'workspaces'}",
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: open and run by command
        "--LabApp.extension_manager=readonly",  # no PyPI look-ups for extensions
    ]  # fmt: skip
    if os.geteuid() == 0:
        command.append("--allow-root")  # CI runs as root
    started = time.monotonic()
    with log.open("wb") as sink:
        server = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    running = Lab(f"http://127.0.0.1:{port}", token, root, started)

    def answers() -> bool:
        if server.poll() is not None:
            pytest.fail(f"JupyterLab exited ({server.returncode}):\n{log.read_text()[-3000:]}")
        try:
            return running.api("/api/status") == 200
        except OSError:
            return False

    try:
        wait_for(f"JupyterLab on port {port} (log: {log})", SERVER_START_S, answers)
        yield running
    finally:
        try:
            running.api("/api/shutdown", method="POST")  # stops the kernels too
            server.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            server.kill()
            server.wait()


def find_browser() -> tuple[str, str]:
    """Paths of Chromium and its matching chromedriver, or a failure saying what to install."""
    names = ("chromium", "chromium-browser", "google-chrome")
    chromium = next(filter(None, map(shutil.which, names)), None)
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        found = {"chromium": chromium, "chromedriver": driver}
        missing = " and ".join(name for name, path in found.items() if path is None)
        pytest.fail(f"the browser test needs {missing}: {INSTALL_HINT}")
    return chromium, driver


OPEN_LAB = """
const app = window.jupyterapp;
if (!app || !app.shell.isAttached) return false;
app.shell.collapseLeft();  // the notebook gets the screenshot's width
return true;
"""


@pytest.fixture(scope="module")
def chromium() -> tuple[str, str]:
    """Chromium and chromedriver's paths, and selenium importable; checked before JupyterLab
    starts, so that a missing one fails at once."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.fail("selenium is a dev dependency: run `bash scripts/install.sh --dev`")
    return find_browser()


@pytest.fixture(scope="module")
def browser(
    chromium: tuple[str, str], lab: Lab, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """Headless Chromium (through Selenium) showing JupyterLab, its console log kept."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location, driver_path = chromium
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox cannot start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_script_timeout(CELLS_S)
    try:
        driver.get(f"{lab.url}/lab/workspaces/browser-test?reset&token={lab.token}")
        wait_for("JupyterLab's page", PAGE_S, lambda: driver.execute_script(OPEN_LAB))
        yield driver
    finally:
        driver.quit()


OPEN = """
const [path, done] = arguments;
const app = window.jupyterapp;
app.commands.execute("docmanager:open", {path: path, factory: "Notebook"})
  .then((panel) => panel.context.ready.then(() => panel.sessionContext.ready))
  .then(() => done(null), (error) => done(String(error)));
"""
PROGRESS = """
const panel = window.jupyterapp.shell.currentWidget;
const cells = panel.content.widgets.filter((cell) => cell.model.type === "code");
const errors = cells.flatMap((cell) => cell.model.outputs.toJSON())
  .filter((output) => output.output_type === "error")
  .map((output) => output.ename + ": " + output.evalue);
return {
  ran: cells.filter((cell) => cell.model.executionCount !== null).length,
  errors: errors,
  idle: panel.sessionContext.kernelDisplayStatus === "idle",
};
"""
CLOSE = """
const done = arguments[0], panel = window.jupyterapp.shell.currentWidget;
panel.sessionContext.shutdown().finally(() => { panel.dispose(); done(null); });
"""


@pytest.fixture
def notebook(browser: Any) -> Iterator[Callable[[str], None]]:
    """Opens a notebook of the lab in the browser; closes it, and stops its kernel, after."""
    opened = []

    def open_notebook(name: str) -> None:
        error = browser.execute_async_script(OPEN, name)
        assert error is None, f"JupyterLab did not open {name} with a kernel: {error}"
        opened.append(name)

    yield open_notebook
    if opened:
        browser.execute_async_script(CLOSE)


def run_all_cells(driver: Any, cells: int) -> None:
    """Run the open notebook's cells, as Run > Run All Cells does; fail on an error."""
    driver.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells')")

    def finished() -> bool:
        progress = driver.execute_script(PROGRESS)
        assert not progress["errors"], f"a cell failed: {progress['errors']}"
        return progress["ran"] == cells and progress["idle"]

    wait_for(f"{cells} cells to run", CELLS_S, finished)


def figure_of(output: Any) -> str:
    """The figure an output area shows now (its PNG's data URL), or '' while it has none."""
    return output.parent.execute_script(
        "const image = arguments[0].querySelector('img'); return image ? image.src : '';", output
    )


def move(driver: Any, widget: Any, check: WidgetCheck) -> None:
    """Change the chapter's control as a student would: a key on the slider, a click."""
    from selenium.webdriver.common.keys import Keys

    if check.kind == "button":
        buttons = widget.find_elements("css selector", "button")
        matching = [button for button in buttons if button.text == check.control]
        assert matching, f"no button {check.control!r} in the widget"
        matching[0].click()
        return
    sliders = [
        slider
        for slider in widget.find_elements("css selector", ".widget-slider")
        if slider.find_element("css selector", ".widget-label").text == check.control
    ]
    assert sliders, f"no slider {check.control!r} in the widget"
    readout = sliders[0].find_element("css selector", ".widget-readout")
    before = readout.text
    handle = sliders[0].find_element("css selector", ".noUi-handle")
    driver.execute_script("arguments[0].focus()", handle)
    handle.send_keys(Keys.ARROW_RIGHT)
    wait_for(f"slider {check.control!r} to move from {before}", 5, lambda: readout.text != before)


def console_errors(driver: Any) -> list[str]:
    """The browser console's errors since the last look (reading the log empties it)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def test_every_chapter_with_a_widget_has_a_check() -> None:
    stored = {
        path.stem
        for path in (REPO_ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")
        if WIDGET_VIEW in path.read_text(encoding="utf-8")
    }
    assert stored == {check.chapter for check in CHECKS}, "add or remove a WidgetCheck"


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.chapter)
def test_widget_renders_and_redraws_in_jupyterlab(
    check: WidgetCheck,
    browser: Any,
    lab: Lab,
    notebook: Callable[[str], None],
    capsys: pytest.CaptureFixture,
) -> None:
    started = time.monotonic()
    name = f"{check.chapter}.ipynb"
    cells = widget_copy(REPO_ROOT / "chapters" / name, lab.root / name)
    notebook(name)
    run_all_cells(browser, cells)
    ran = time.monotonic()

    page = browser.execute_script("return window.jupyterapp.shell.currentWidget.node")
    widget_cell = page.find_elements("css selector", ".jp-CodeCell")[-1]
    widget = wait_for(
        "the widget to render",
        30,
        lambda: widget_cell.find_elements("css selector", ".jp-OutputArea .widget-vbox"),
    )[0]
    output = widget.find_element("css selector", ".widget-output")
    controls = widget.find_elements("css selector", ".widget-slider, .widget-dropdown, button")
    assert controls, "the widget shows no slider, dropdown or button"
    before = wait_for("the widget's first figure", 30, lambda: figure_of(output))

    move(browser, widget, check)
    wait_for(
        f"the figure to change after {check.control!r}",
        REDRAW_S,
        lambda: figure_of(output) not in ("", before),
    )
    browser.execute_script("arguments[0].scrollIntoView({block: 'start'})", widget)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / f"{check.chapter}.png"))

    errors = console_errors(browser)
    assert not errors, "the browser console shows errors:\n" + "\n".join(errors)
    with capsys.disabled():  # the time taken, in pytest's output even when it captures
        print(
            f"\n  {check.chapter}: {cells} cells ran in {ran - started:.1f} s, widget checked "
            f"in {time.monotonic() - started:.1f} s ({time.monotonic() - lab.started:.0f} s "
            f"since JupyterLab started); {ARTIFACTS / check.chapter}.png"
        )
