"""Every number the course's text quotes is one its cells printed.

A chapter's markdown cells, and its section of docs/chapters.md, quote measurements:
decimals (82.0, 1.065), percentages (71 %), times (387 ms, 0.39 s), sizes (513 MiB),
rates (93.1 tokens/s) and ratios (1.75x). Each must appear among the numbers the same
notebook's code cells stored (stream and text outputs: never a cell's source, which drew a
figure but is no evidence of what the figure shows), at the precision the text writes it
(97 % for a stored 96.8 %) or, for a whole number, within 0.5 %; units convert (45 KiB is
a stored 46,080 bytes, 0.39 s a stored 387 ms). A number may also come from a benchmark
record, `benchmarks/NAME.md`, that the same cell or section names. So a re-execution that changes a
result fails here until the text says the new number, or stops copying it and points at the
output instead (the better fix).

Not extracted: bare integers (counts and settings: 30 layers, 16-token blocks, 4096 slots),
anything in code (`inline` or fenced), LaTeX, link targets and URLs, headings, exercise
ids ("exercise 3.2") and section numbers ("section 4.3"), and numbers that are part of a
name (SmolLM2-135M, fp32, Llama-13B). So constants such as 16, 2048, 4096 or 135M need
no allow-list; the few numbers a text states that no output can back (a paper's
measurement, a simulation's illustrative inputs) are exempted by chapter in EXEMPT, each
with its reason. Everything is read from the committed notebooks and docs; nothing is
executed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from test_chapters_stored import APPENDICES, NOTEBOOKS, _cells, _text

from minserve.course import ladder
from minserve.course.chapters import CHAPTERS, REPO_ROOT
from minserve.course.generate import chapter_exercises

# A whole number may differ from the stored one by this much ("49,000 unlikely tokens" of
# 49,152). Kept small: at 2 %, a re-run that printed 84 % instead of 86 % still passed,
# on an unrelated 87.7 of the same notebook.
REL_TOL = 0.005

# Per chapter: a phrase of its text (notebook markdown or its docs/chapters.md section;
# spaces and line breaks alike) and why the numbers inside it are not among its outputs.
EXEMPT: dict[str, dict[str, str]] = {
    "00": {
        "summing a 512 MiB tensor": "the size of the tensor the bandwidth measurement sums, "
        "a setting of naive.measure_memory_bandwidth",
    },
    "01": {
        "800 KiB per token in 16-bit, about 1.6 GB for one sequence of 2048 tokens. On the "
        "paper's 40 GB A100, whose 26 GB of weights": "the vLLM paper's 13B model and GPU, "
        "quoted from the paper with arithmetic on its shape, not a run of this notebook",
        "20–38 %": "the vLLM paper's measurement, quoted as the paper's",
        "the vLLM paper's 96 %": "the vLLM paper's measurement, quoted as the paper's",
        "against about 96 %": "the vLLM paper's measurement, quoted as the paper's",
    },
    "08": {
        "(12 ms per step, 0.1 ms per prefill token, 0.2 ms per decoding sequence, 128 KiB of "
        "KV per token in bf16, a 25 GB/s link)": "the simulator's illustrative GPU costs, "
        "inputs the text says are not measured",
        "SLOs: TTFT 0.5 s, TPOT 30 ms": "the SLOs the simulation is scored against: inputs",
    },
}

UNITS = {  # unit as written -> factors that take a stored number to it
    "%": (1, 100),  # 71 % is a stored 71.0% or a stored fraction 0.71
    "ms": (1, 1e3),
    "s": (1, 1e-3),
    "µs": (1, 1e3, 1e6),
    "us": (1, 1e3, 1e6),
    "KiB": (1, 2**-10),
    "MiB": (1, 2**-10, 2**-20),
    "GiB": (1, 2**-10, 2**-20, 2**-30),
    "KB": (1, 1e-3),
    "MB": (1, 1e-3, 1e-6),
    "GB": (1, 1e-3, 1e-6, 1e-9),
    "GB/s": (1, 1e-9),
    "GFLOP/s": (1, 1e-9),
    "tokens/s": (1,),
    "req/s": (1,),
    "requests/s": (1,),
    "x": (1,),
    "×": (1,),
}
_UNIT = "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True) if u not in "x×")
QUOTED = re.compile(
    r"(?<![\w.,/])"  # not part of a name (fp32) or of a longer number
    r"(?P<number>\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)"
    rf"(?:(?P<glued>x|×)|\s?(?P<unit>{_UNIT}))?"
    r"(?![\w.]\d|[A-Za-z])"  # "1.5x" is a ratio; "135M" and "3.11.2" are names
)
STORED = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?![\d])|\d+(?:\.\d+)?(?:e[-+]?\d+)?)")
RECORD = re.compile(r"benchmarks/(\w+)\.(?:md|py)")  # a benchmark and its record, NAME.md
EXERCISE_TABLE = re.compile(
    re.escape(ladder.START) + r".*?" + re.escape(ladder.END), re.DOTALL
)  # fmt: skip
SECTION = re.compile(r"\bsections?\s+$", re.IGNORECASE)
CODE_OR_LINK = re.compile(
    r"```.*?```|`[^`]*`|\$\$.*?\$\$|\$[^$]*\$|\]\([^)]*\)|https?://\S+|<[^>]+>", re.DOTALL
)
REPR = re.compile(r"<Figure size [^>]*>|<[\w.]+ (?:object )?at 0x[0-9a-f]+>")


@dataclass(frozen=True)
class Quote:
    """One measured number as the text writes it."""

    where: str  # "cell 23" or "docs/chapters.md"
    start: int  # where it starts in the markdown
    text: str  # "82.0 tokens/s", as written
    value: float
    decimals: int
    unit: str
    context: str  # the words around it, for the failure message

    def matches(self, stored: float) -> bool:
        """The stored number, in this quote's unit, printed as the quote is (a decimal), or
        within REL_TOL of it (a whole number: "about 45 KiB", "387 ms")."""
        for factor in UNITS.get(self.unit, (1,)):
            converted = stored * factor
            if abs(round(converted, self.decimals) - self.value) < 1e-9:
                return True
            if not self.decimals and abs(converted - self.value) <= REL_TOL * abs(self.value):
                return True
        return False


def _prose(markdown: str) -> str:
    """The markdown's words: no headings, code, math, link targets or URLs, nor the table of
    exercises the ladder writes (estimated times, checked by tests/test_ladder.py); blanked
    to spaces, so that positions still line up with the words around them."""
    markdown = EXERCISE_TABLE.sub(lambda m: " " * len(m.group()), markdown)
    lines = markdown.split("\n")
    text = "\n".join(" " * len(line) if line.lstrip().startswith("#") else line for line in lines)
    return CODE_OR_LINK.sub(lambda m: " " * len(m.group()), text)


def quotes(markdown: str, where: str, exercise_ids: frozenset[str]) -> list[Quote]:
    """Every measured number the markdown quotes (see the module's docstring)."""
    prose = _prose(markdown)
    found = []
    for m in QUOTED.finditer(prose):
        number, unit = m.group("number"), m.group("glued") or m.group("unit") or ""
        before = prose[max(0, m.start() - 2) : m.start()]
        if before[-1:] in ("-", "–") and before[:1].isalpha():
            continue  # part of a name: SmolLM2-135M, Llama-13B (but 20–38 % is a range)
        is_decimal = "." in number
        if not (is_decimal or unit or "," in number):
            continue  # a bare integer: a count or a setting
        if not unit and number in exercise_ids:
            continue  # "exercise 3.2", "0.5-0.7"
        if SECTION.search(prose[max(0, m.start() - 12) : m.start()]):
            continue  # "section 4.3"
        decimals = len(number.split(".")[1]) if is_decimal else 0
        context = " ".join(prose[max(0, m.start() - 50) : m.end() + 30].split())
        written = " ".join(m.group().split())
        value = float(number.replace(",", ""))
        found.append(Quote(where, m.start(), written, value, decimals, unit, context))
    return found


def stored_numbers(text: str) -> set[float]:
    """Every number in a stored output (figure and object reprs left out)."""
    text = REPR.sub(" ", text)
    return {float(n.replace(",", "")) for n in STORED.findall(text)}


def _outputs_text(cell: dict) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append(_text(output.get("text", "")))
        parts.append(_text(output.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


@cache
def record_numbers(name: str) -> frozenset[float]:
    """The numbers of benchmarks/NAME.md (none if there is no such record)."""
    path = REPO_ROOT / "benchmarks" / f"{name}.md"
    if not path.exists():
        return frozenset()
    return frozenset(stored_numbers(path.read_text(encoding="utf-8")))


def cited_numbers(markdown: str) -> set[float]:
    """The numbers of the benchmark records `benchmarks/NAME.md` the markdown names."""
    return {x for name in RECORD.findall(markdown) for x in record_numbers(name)}


def _phrase(phrase: str) -> re.Pattern[str]:
    """The phrase, with any run of spaces and line breaks between its words."""
    return re.compile(r"\s+".join(re.escape(word) for word in phrase.split()))


def _exempt(quote: Quote, markdown: str, chapter: str) -> bool:
    """Whether the quote lies inside one of its chapter's exempt phrases."""
    return any(
        m.start() <= quote.start < m.end()
        for phrase in EXEMPT.get(chapter, {})
        for m in _phrase(phrase).finditer(markdown)
    )


@cache
def _exercise_ids(chapter: str) -> frozenset[str]:
    """The chapter's exercise ids; none for an appendix."""
    found = [c for c in CHAPTERS if c.number == chapter]
    return frozenset(e.id for c in found for e in chapter_exercises(c))


def _notebook_numbers(notebook: Path) -> set[float]:
    return {
        x
        for cell in _cells(notebook)
        if cell["cell_type"] == "code"
        for x in stored_numbers(_outputs_text(cell))
    }


def _docs_sections() -> dict[str, str]:
    """docs/chapters.md's section of each chapter: "00" -> its text."""
    text = (REPO_ROOT / "docs" / "chapters.md").read_text(encoding="utf-8")
    parts = re.split(r"^## (\d\d) — .*$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def _unbacked(pieces: list[tuple[str, str]], chapter: str, outputs: set[float]) -> list[str]:
    """(where, markdown) pieces -> a line for each quote no output or named record backs."""
    problems = []
    for where, markdown in pieces:
        evidence = outputs | cited_numbers(markdown)
        for quote in quotes(markdown, where, _exercise_ids(chapter)):
            if _exempt(quote, markdown, chapter) or any(quote.matches(x) for x in evidence):
                continue
            nearest = min(evidence, key=lambda x: abs(x - quote.value), default=math.nan)
            problems.append(
                f"{where}: {quote.text!r} in '...{quote.context}...' is not among the stored "
                f"outputs (nearest stored number: {nearest:g})"
            )
    return problems


def _chapter(notebook: Path) -> str:
    return notebook.name[:2]


@pytest.mark.parametrize("notebook", NOTEBOOKS + APPENDICES, ids=lambda path: path.stem)
def test_every_number_a_chapter_quotes_is_in_its_stored_outputs(notebook: Path) -> None:
    pieces = [
        (f"cell {number}", _text(cell["source"]))
        for number, cell in enumerate(_cells(notebook))
        if cell["cell_type"] == "markdown"
    ]
    problems = _unbacked(pieces, _chapter(notebook), _notebook_numbers(notebook))
    assert not problems, (
        f"{notebook.name} quotes numbers its outputs do not show (cells counted from 0); "
        "say what the output says, or point at the output instead of copying it:\n"
        + "\n".join(problems)
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_docs_chapters_quotes_only_numbers_the_notebook_stored(notebook: Path) -> None:
    section = _docs_sections().get(_chapter(notebook))
    assert section is not None, f"docs/chapters.md has no section for {notebook.name}"
    problems = _unbacked(
        [("docs/chapters.md", section)], _chapter(notebook), _notebook_numbers(notebook)
    )
    assert not problems, (
        f"docs/chapters.md's section on {notebook.name} quotes numbers the notebook's outputs "
        "do not show:\n" + "\n".join(problems)
    )


def test_the_extraction_finds_measurements_and_skips_names_code_and_ids() -> None:
    text = (
        "### 4.1 A heading\nTokens/s fell from 82.0 to 78.5 tokens/s, TTFT rose 248 -> 318 ms, "
        "1.75x the throughput, 71 % hits, 538,060,032 bytes. Not these: SmolLM2-135M, fp32, "
        "30 layers, `c = 1.065`, [a link](https://arxiv.org/abs/2309.06180), exercise 4.2, "
        "section 4.3, $a^{0.5}$."
    )
    found = [q.text for q in quotes(text, "cell 0", frozenset({"4.1", "4.2"}))]
    assert found == ["82.0", "78.5 tokens/s", "318 ms", "1.75x", "71 %", "538,060,032"]


def test_a_quote_matches_at_its_printed_precision_or_within_the_tolerance() -> None:
    (about,) = quotes("about 97 %", "cell 0", frozenset())
    assert about.matches(96.8) and about.matches(0.968) and not about.matches(93.0)
    (kib,) = quotes("45 KiB per token", "cell 0", frozenset())
    assert kib.matches(46080) and not kib.matches(40000)
    (seconds,) = quotes("after 0.39 s", "cell 0", frozenset())
    assert seconds.matches(387) and seconds.matches(0.39) and not seconds.matches(650)


def test_every_exemption_still_names_text_the_course_has() -> None:
    """An exemption whose phrase is gone from its chapter is stale: remove it."""
    sections = _docs_sections()
    for chapter, phrases in EXEMPT.items():
        notebook = next(n for n in NOTEBOOKS if _chapter(n) == chapter)
        markdown = [_text(c["source"]) for c in _cells(notebook) if c["cell_type"] == "markdown"]
        text = "\n".join([*markdown, sections.get(chapter, "")])
        for phrase, reason in phrases.items():
            assert reason.strip(), f"chapter {chapter}: the exemption {phrase!r} needs a reason"
            assert _phrase(phrase).search(text), (
                f"chapter {chapter}: no text has the exempt phrase {phrase!r}"
            )


def test_a_changed_result_fails_until_the_text_follows_it() -> None:
    text = "Tokens/s fell from 82.0 to 78.5 tokens/s."
    assert _unbacked([("cell 1", text)], "09", {82.0, 78.5}) == []
    (problem,) = _unbacked([("cell 1", text)], "09", {82.0, 80.1})  # a re-run printed 80.1
    assert "'78.5 tokens/s'" in problem and "nearest stored number: 80.1" in problem
