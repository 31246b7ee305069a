"""Fuzz `minserve serve` with schemathesis against its own /openapi.json, every check on.

    .venv/bin/python -m benchmarks.fuzz_server --max-examples 1000 --max-time 1500  # the record
    .venv/bin/python -m pytest tests/test_server_fuzz.py       # in CI: about 2 minutes

The server runs the test suite's tiny random Llama (tests/tiny_models.py; `--model` for
another) with the prefix cache on and an API key set, under uvicorn on an ephemeral port.
schemathesis runs its phases on every operation the description lists: the description's
examples, coverage (each field at its bounds and just past them, each constraint broken
in turn) and fuzzing (random valid and invalid requests, `--max-examples` per operation),
with all its checks: no 5xx, statuses, content types and headers as documented, valid
data accepted and invalid data refused, auth enforced, 405s with `Allow`. Then: is the
server still up, and is every KV block free or held only by the prefix cache?

One check is ours: a body valid by the schema may still be refused with a 400 for what
no JSON schema can say (a prompt plus max_tokens past the context, min_tokens above
max_tokens, top_logprobs without logprobs, a structured output's regex, schema or grammar
that does not compile, resume tokens no run could have generated);
`accepted_unless_it_cannot_fit` allows those refusals, named by their messages (a structured
output's and a resume's, by the field they name), and nothing else, in place
of schemathesis' positive_data_acceptance. Writes fuzz_server.json and fuzz_server.md.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events, from_schema

from benchmarks.run_env import REPO_ROOT, measure_recorded, record_parser, write_results
from minserve import LLM
from minserve.server.app import Server, build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig

MODEL, API_KEY = "tiny", "fuzz-key"
# A small context keeps every generation short: at most 63 new tokens per sample.
ENGINE = dict(num_blocks=256, block_size=4, max_model_len=64, max_num_seqs=4,
              enable_prefix_caching=True)  # fmt: skip
MAX_QUEUED = 4  # a batch holds at most max_num_seqs + MAX_QUEUED = 8 prompts

# 400s a schema-valid body may get, for rules between fields or about the tokenized prompt
CANNOT_FIT = (
    re.compile(r"^prompt has \d+ tokens; max_model_len is \d+"),
    re.compile(r"^prompt is empty"),  # a text of control characters may tokenize to nothing
    re.compile(r"^(max_tokens|max_completion_tokens) is \d+, but .* max_model_len is \d+"),
    re.compile(r"^min_tokens \(\d+\) must not exceed max_tokens \(\d+\)$"),
    re.compile(r"^top_logprobs needs logprobs: true$"),
)
# a structured output's constraint (one kind of it, a grammar that compiles) is its content;
# so are resume tokens (ones a run could have generated: n 1, within max_tokens, the context,
# the grammar and the stop rules)
CONTENT_PARAMS = ("structured_outputs", "response_format", "resume_token_ids")


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """Wait until the server is idle before each request."""
    wait_until_idle(case.operation.schema.get_base_url())


def wait_until_idle(url: str, timeout_s: float = 30.0) -> None:
    """Until /metrics shows no request in flight. schemathesis sends the next request as
    soon as it has an answer (or stops reading a stream), and the server releases the
    previous one's place when its engine thread applies the finish or abort (within a
    step): a full batch in between gets a 503 that is right (busy, retry later) but no
    finding."""
    deadline = time.monotonic() + timeout_s
    while in_flight(url) and time.monotonic() < deadline:
        time.sleep(0.005)


def in_flight(url: str) -> float:
    """The server's `minserve:num_requests_in_flight` gauge."""
    metrics = httpx.get(url.rstrip("/") + "/metrics")
    metrics.raise_for_status()
    for line in metrics.text.splitlines():
        if line.startswith("minserve:num_requests_in_flight "):
            return float(line.split()[1])
    raise ValueError("/metrics has no minserve:num_requests_in_flight")


@schemathesis.check
def accepted_unless_it_cannot_fit(ctx: Any, response: Any, case: Any) -> bool | None:
    """A body valid by the schema gets an answer (2xx), or a 400 for a rule in CANNOT_FIT."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code < 400:
        return None
    if response.status_code in (401, 404, 405, 503):  # a wrong key, model name or method
        return None  # (coverage tries methods the description lacks); overload
    message = _error_message(response)
    if response.status_code == 400 and any(rule.search(message) for rule in CANNOT_FIT):
        return None
    if response.status_code == 400 and _error_param(response) in CONTENT_PARAMS:
        return None
    raise AssertionError(f"a valid body was refused with {response.status_code}: {message}")


def _error_param(response: Any) -> str | None:
    try:
        return response.json()["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return None


def _error_message(response: Any) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.content[:200].decode("utf-8", "replace")


def schemathesis_config(max_examples: int, seed: int, max_time_s: int | None) -> dict[str, Any]:
    """The run's settings, in schemathesis.toml's spelling."""
    return {
        "seed": seed,
        **({"max-time": max_time_s} if max_time_s is not None else {}),
        "workers": 1,  # the engine runs one step at a time anyway
        "request-timeout": 120,  # a batch of 8 prompts x 4 samples x 63 tokens takes seconds
        "generation": {"max-examples": max_examples},
        "phases": {"stateful": {"enabled": False}},  # no route creates what another reads
        "checks": {"positive_data_acceptance": {"enabled": False}},  # ours replaces it
        "auth": {"openapi": {"bearer": {"bearer": API_KEY}}},
        "output": {"sanitization": {"enabled": False}},  # "max_tokens" is no secret
    }


@dataclass
class FuzzReport:
    """What a fuzzing run sent and what it found."""

    max_examples: int
    seed: int
    cases: int = 0
    cases_by_phase: dict[str, int] = field(default_factory=dict)
    cases_by_operation: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0  # responses with a 5xx status
    failures: list[dict[str, Any]] = field(default_factory=list)  # checks that failed
    errors: list[str] = field(default_factory=list)  # requests that got no answer, and the like
    stopped: str = ""  # why schemathesis stopped (completed, max_time, ...)
    seconds: float = 0.0
    server_up: bool = False  # /health answered 200 afterwards
    blocks_held: int = -1  # blocks neither free nor held only by the prefix cache, once idle
    schemathesis: str = schemathesis.__version__

    @property
    def clean(self) -> bool:
        return (not self.server_errors and not self.failures and not self.errors
                and self.server_up and self.blocks_held == 0)  # fmt: skip


def run_schemathesis(url: str, max_examples: int, seed: int, max_time_s: int | None) -> FuzzReport:
    """schemathesis' phases against the server at `url`, counted."""
    config = SchemathesisConfig.from_dict(schemathesis_config(max_examples, seed, max_time_s))
    schema = schemathesis.openapi.from_url(url + "/openapi.json", config=config)
    report = FuzzReport(max_examples, seed)
    counts: dict[str, Counter] = {"phase": Counter(), "operation": Counter(), "status": Counter()}
    start = time.monotonic()
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            _count(event, counts, report)
        elif isinstance(event, events.NonFatalError | events.FatalError):
            report.errors.append(f"{type(event).__name__}: {_error_text(event)}")
        elif isinstance(event, events.EngineFinished):
            report.stopped = str(event.stop_reason.value)
            report.failures += [{"check": "after_run", "failure": str(f)} for f in event.failures]
    report.seconds = round(time.monotonic() - start, 1)
    report.cases = sum(counts["phase"].values())
    report.cases_by_phase = dict(counts["phase"])
    report.cases_by_operation = dict(counts["operation"])
    report.statuses = {str(k): v for k, v in sorted(counts["status"].items())}
    report.server_errors = sum(v for k, v in counts["status"].items() if k >= 500)
    report.failures = _distinct(report.failures)
    return report


def _distinct(failures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per check, operation and failure, with how often it came (shrinking
    repeats a failure many times)."""
    distinct: dict[tuple[str, str, str], dict[str, Any]] = {}
    for failure in failures:
        key = (failure["check"], failure.get("operation", ""), failure["failure"])
        distinct.setdefault(key, {**failure, "count": 0})["count"] += 1
    return list(distinct.values())


def _count(event: events.ScenarioFinished, counts: dict[str, Counter], report: FuzzReport) -> None:
    recorder = event.recorder
    counts["phase"][str(event.phase)] += len(recorder.cases)
    counts["operation"][recorder.label] += len(recorder.cases)
    for interaction in recorder.interactions.values():
        if interaction.response is not None:
            counts["status"][interaction.response.status_code] += 1
    for case_id, checks in recorder.checks.items():
        for check in checks:
            if check.status.value == "success" or check.failure_info is None:
                continue
            interaction = recorder.interactions.get(case_id)
            response = interaction.response if interaction else None
            report.failures.append({
                "phase": str(event.phase), "operation": recorder.label, "check": check.name,
                "failure": str(check.failure_info.failure)[:500],
                "status": str(response.status_code if response else None),
                "response": response.content[:300].decode("utf-8", "replace") if response else "",
                "reproduce": (check.failure_info.code_sample or "")[:1000],
            })  # fmt: skip


def _error_text(event: events.NonFatalError | events.FatalError) -> str:
    error = event.value if isinstance(event, events.NonFatalError) else event.exception
    return f"{type(error).__name__}: {error}"[:500]


def fuzz_server(llm: LLM, max_examples: int, seed: int = 0, max_time_s: int | None = None):
    """Serve `llm` (ENGINE's settings), fuzz it, then check it is up and holds no block."""
    server = build_server(llm.engine, ServerConfig(MODEL, api_key=API_KEY), max_queued=MAX_QUEUED)
    with BackgroundServer(server) as url:
        report = run_schemathesis(url, max_examples, seed, max_time_s)
        report.server_up = httpx.get(url + "/health", timeout=10).status_code == 200
        report.blocks_held = blocks_held_when_idle(server)
    return report


def blocks_held_when_idle(server: Server, timeout_s: float = 30.0) -> int:
    """Once no request is in flight: blocks neither free nor held only by the prefix cache."""
    deadline = time.monotonic() + timeout_s
    while server.engine.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the engine thread applies the last aborts, then retakes its snapshot
    stats = server.engine.stats
    return int(stats["num_blocks"] - stats["num_free_blocks"]
               - stats["prefix_cache_evictable_blocks"])  # fmt: skip


def tiny_model(folder: Path) -> Path:
    """The test suite's tiny random Llama with SmolLM2's tokenizer, saved in `folder`."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))  # tests/ is no package: import its helper
    from tiny_models import make_hf_model
    from transformers import AutoTokenizer

    from minserve.model.default_model import default_model_path

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(folder / "tokenizer")
    return make_hf_model("llama", folder / "model", folder / "tokenizer")


# ---------------------------------------------------------------- the record


def add_arguments(parser: Any) -> None:
    parser.add_argument("--max-examples", type=int, default=2000,
                        help="fuzzing examples per operation")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-time", type=int, default=None, help="stop after this many seconds")
    parser.add_argument("--model", type=Path, default=None,
                        help="a model folder or .gguf (default: a tiny random Llama)")  # fmt: skip


def measure(args: Any) -> FuzzReport:
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or tiny_model(Path(folder))
        return fuzz_server(LLM(model, **ENGINE), args.max_examples, args.seed, args.max_time)


def page(report: dict[str, Any], header: list[str]) -> str:
    lines = [*header, "", f"- schemathesis {report['schemathesis']}, seed {report['seed']}, "
             f"{report['max_examples']} fuzzing examples per operation; stopped: "
             f"{report['stopped']}", "",
             "| cases | 5xx | failed checks | errors | seconds | server up after | blocks held |",
             "|---:|---:|---:|---:|---:|---|---:|",
             f"| {report['cases']} | {report['server_errors']} | {len(report['failures'])} | "
             f"{len(report['errors'])} | {report['seconds']} | {report['server_up']} | "
             f"{report['blocks_held']} |", "",
             "| phase | cases |", "|---|---:|",
             *(f"| {k} | {v} |" for k, v in report["cases_by_phase"].items()), "",
             "| operation | cases |", "|---|---:|",
             *(f"| {k} | {v} |" for k, v in report["cases_by_operation"].items()), "",
             "| status | responses |", "|---|---:|",
             *(f"| {k} | {v} |" for k, v in report["statuses"].items())]  # fmt: skip
    for failure in report["failures"]:
        lines += ["", f"## {failure['check']} on {failure.get('operation')} "
                  f"({failure.get('phase')}, {failure['count']} times)",
                  "", "```", failure["failure"], failure.get("response", ""),
                  failure.get("reproduce", ""),
                  "```"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    module = "benchmarks.fuzz_server"
    args = record_parser(module, __doc__, add_arguments).parse_args(argv)
    record, report = measure_recorded(module, argv, args, measure, threads=None)
    data = {**asdict(record), **asdict(report)}
    write_results(data, args.output, page(data, record.header_lines("Fuzzing the server")))
    sys.exit(0 if report.clean else 1)


if __name__ == "__main__":
    main()
