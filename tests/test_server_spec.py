"""`minserve serve --speculative-config JSON`: vLLM's spelling, checked before the model loads;
the server then speculates, reports acceptance in /metrics, and answers exactly what it
answers without speculation.

Oracle: the same command without the flag (greedy decoding), over HTTP. uvicorn.run is
`run_until_stopped` is replaced by a function that talks to the app in-process, so the whole
command runs.
"""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from minserve.cli import main

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
PATTERN = [1000 + i for i in range(5)]
PROMPTS = [PATTERN * 4, [7, 8] * 6 + [9], PATTERN[:3] * 3]  # repeats: the n-gram proposer's food
SPEC_METRICS = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                "spec_decode_acceptance_rate", "spec_decode_mean_acceptance_length")  # fmt: skip


def serve_and_ask(model: str, monkeypatch, *flags: str) -> tuple[list[str], dict[str, float]]:
    """Run `minserve serve ... flags`; greedy completions of PROMPTS and the metrics after."""
    answers: dict = {}

    def fake_run_until_stopped(server, host: str, port: int) -> None:
        client = TestClient(server.start().app)
        body = {"prompt": PROMPTS, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        answers["response"] = client.post("/v1/completions", json=body).json()
        answers["metrics"] = _settled_metrics(client)
        server.shutdown()

    monkeypatch.setattr("minserve.server.cli.run_until_stopped", fake_run_until_stopped)
    argv = ["serve", "--model", model, "--num-blocks", "128", "--block-size", "4", *flags]
    assert main(argv) == 0
    texts = [choice["text"] for choice in answers["response"]["choices"]]
    return texts, answers["metrics"]


def _settled_metrics(client: TestClient, timeout_s: float = 10.0) -> dict[str, float]:
    """/metrics once the engine's snapshot counts every request (it is taken after a step)."""
    deadline = time.monotonic() + timeout_s
    while (metrics := _samples(client.get("/metrics").text))["request_success_total"] < 3:
        assert time.monotonic() < deadline, f"requests not all counted: {metrics}"
        time.sleep(0.01)
    return metrics


def _samples(text: str) -> dict[str, float]:
    """Unlabelled samples of the Prometheus text, without the `minserve:` prefix."""
    return {
        line.split()[0].removeprefix("minserve:"): float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#") and "{" not in line
    }


def test_speculating_server_answers_what_the_plain_server_answers(tiny_model, monkeypatch):
    model = str(tiny_model("llama"))
    plain, plain_metrics = serve_and_ask(model, monkeypatch)
    spec, metrics = serve_and_ask(model, monkeypatch, "--speculative-config", NGRAM)
    assert spec == plain
    assert all(len(text) > 0 for text in spec)
    assert metrics["generation_tokens_total"] == plain_metrics["generation_tokens_total"] == 72
    drafted = metrics["spec_decode_num_draft_tokens_total"]
    accepted = metrics["spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafted  # speculation really happened, and was verified
    assert metrics["spec_decode_acceptance_rate"] == pytest.approx(accepted / drafted)
    drafts = metrics["spec_decode_num_drafts_total"]
    assert metrics["spec_decode_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert not any(key.startswith("spec_decode") for key in plain_metrics)  # off: not exported


@pytest.mark.parametrize(
    "value, problem",
    [
        ('{"method": "ngram", num_speculative_tokens: 4}', "Expecting property name"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "k": 2}', "unknown speculative_config"),
        ('{"method": "medusa", "num_speculative_tokens": 4}', "unknown speculative method"),
        ('{"method": "ngram"}', "needs 'num_speculative_tokens'"),
        ('["ngram", 4]', "expected a JSON object, got list"),
    ],
    ids=["bad-json", "unknown-key", "unknown-method", "missing-key", "not-an-object"],
)
def test_bad_speculative_config_is_a_two_line_error_before_loading(value, problem, capsys):
    missing_model = "/nonexistent/model.gguf"  # never reached: the flag is checked first
    assert main(["serve", "--model", missing_model, "--speculative-config", value]) == 2
    first, second = capsys.readouterr().err.rstrip("\n").split("\n")
    assert first.startswith(f"minserve: error: --speculative-config {value!r}: ")
    assert problem in first
    assert second == f"  for example: --speculative-config '{NGRAM}'"
    assert json.loads(second.split("'")[1])["method"] == "ngram"
