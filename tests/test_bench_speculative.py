"""The speculative-decoding benchmark: its formulas, proposer specs, draft copies, and a whole
run on a tiny model (`minserve bench speculative`)."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from minserve.bench.spec_runs import truncated_copy
from minserve.bench.spec_workloads import chat_prompts, repetition_prompts
from minserve.bench.speculative import ProposerSpec, expected_speedup, tokens_per_forward
from minserve.cli import main


def test_tokens_per_forward_is_the_geometric_sum() -> None:
    assert tokens_per_forward(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert tokens_per_forward(0.0, 4) == 1.0  # every draft rejected: the target's own token
    assert tokens_per_forward(1.0, 4) == 5.0  # every draft kept: g + 1
    assert tokens_per_forward(0.8, 3.5) == pytest.approx((1 - 0.8**4.5) / 0.2)  # mean g


def test_expected_speedup_divides_by_the_cost_of_a_step() -> None:
    assert expected_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)
    assert expected_speedup(1.0, 4, 1.0) == pytest.approx(1.0)  # the target drafting itself
    assert expected_speedup(0.9, 4, 0.0) == pytest.approx(tokens_per_forward(0.9, 4))


def test_formulas_reject_impossible_rates_and_costs() -> None:
    with pytest.raises(ValueError, match="0 <= a <= 1"):
        tokens_per_forward(1.2, 3)
    with pytest.raises(ValueError, match="draft cost ratio c must be >= 0"):
        expected_speedup(0.5, 3, -0.1)


def test_proposer_specs_parse_into_speculative_configs() -> None:
    assert ProposerSpec.parse("ngram").config() == {"method": "ngram", "num_speculative_tokens": 4}
    early = ProposerSpec.parse("early_exit:layers=20:k=3")
    assert early.config() == {
        "method": "early_exit", "num_speculative_tokens": 3, "num_draft_layers": 20,
    }  # fmt: skip
    assert early.name == "early_exit (k=3, 20 layers)"
    assert ProposerSpec.parse("draft_model").name == "draft_model (k=4, the target itself)"
    assert ProposerSpec.parse("draft_model:layers=2").config("D")["model"] == "D"
    adaptive = ProposerSpec.parse("ngram:k=6:adaptive")
    assert adaptive.config()["draft_length"] == "adaptive" and adaptive.k == 6
    assert adaptive.name == "ngram (k=6, adaptive)"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("medusa", "unknown proposer 'medusa'"),
        ("ngram:layers=2", "layers= applies to early_exit and draft_model"),
        ("ngram:k=two", "bad proposer option 'k=two'"),
        ("early_exit:depth=3", "bad proposer option 'depth=3'"),
    ],
)
def test_bad_proposer_specs_are_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProposerSpec.parse(text)


def test_truncated_copy_keeps_the_first_layers_and_the_head(tiny_model, tmp_path) -> None:
    source = tiny_model("llama")  # 2 layers
    folder = truncated_copy(source, 1, tmp_path / "draft")
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 1
    original, kept = (
        load_file(source / "model.safetensors"),
        load_file(folder / "model.safetensors"),
    )
    assert set(kept) == {n for n in original if not n.startswith("model.layers.1.")}
    assert all((kept[n] == original[n]).all() for n in kept)
    assert (folder / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="1 <= layers < 2"):
        truncated_copy(source, 2, tmp_path / "too-deep")


def test_workloads_are_eight_distinct_deterministic_prompts(tiny_model) -> None:
    from minserve.loader import load_model

    tokenizer = load_model(tiny_model("llama")).tokenizer
    for build in (repetition_prompts, chat_prompts):
        prompts = build(tokenizer)
        assert len(prompts) == 8 and len({tuple(p) for p in prompts}) == 8
        assert prompts == build(tokenizer)
    text = tokenizer.decode(repetition_prompts(tokenizer)[0])
    assert "`counts` to `frequencies`" in text and "def most_common(counts, n=10):" in text


def test_bench_speculative_prints_a_row_per_cell(tiny_model, capsys) -> None:
    argv = ["bench", "speculative", "--model", str(tiny_model("llama")), "--threads", "1",
            "--max-tokens", "4", "--batch1-requests", "1", "--batch-sizes", "1",
            "--workloads", "repetition", "--proposers", "ngram:k=2"]  # fmt: skip
    assert main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| workload | batch | proposer | plain s | spec s | speedup |")
    assert rows[1].startswith("| repetition | 1 | ngram (k=2) |") and rows[1].endswith("| yes |")


def test_bad_workload_and_batch_sizes_are_rejected(capsys) -> None:
    assert main(["bench", "speculative", "--workloads", "poetry"]) == 2
    assert "unknown workload 'poetry'" in capsys.readouterr().err
    assert main(["bench", "speculative", "--batch-sizes", "1,0"]) == 2
    assert "--batch-sizes must be positive integers" in capsys.readouterr().err
    assert main(["bench", "speculative", "--repeats", "0"]) == 2
    assert "--repeats, --batch1-requests and --max-tokens must be at least 1" in (
        capsys.readouterr().err
    )
