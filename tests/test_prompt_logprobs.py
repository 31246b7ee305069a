"""Prompt logprobs (`SamplingParams(prompt_logprobs=k)`) and perplexity, against transformers.

The oracle is a float32 log-softmax of transformers' logits on the same weights: position
p's row scores prompt token p + 1; ranks count the tokens at least as likely.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.bench.perplexity import bundled_text, perplexity, windows

LOGPROB_ATOL = 1e-4  # fp32
PROMPT = "The capital of France is Paris, and the capital of Italy is Rome. Both are old cities."
TOP_K = 3


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def hf_logprobs(smollm_gguf: Path):
    """token ids -> transformers' fp32 log-softmax at every position [len, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm_gguf.parent, gguf_file=smollm_gguf.name, dtype=torch.float32
    ).eval()

    def run(token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)

    return run


def prompt_ids(llm: LLM) -> list[int]:
    return llm.get_tokenizer().encode(PROMPT)


def check_against(expected: torch.Tensor, ids: list[int], got: list) -> None:
    """Each scored token's logprob and rank, and the top-k ids, equal the oracle's."""
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        row = expected[p - 1]  # [vocab]: what position p - 1 predicts
        entry = got[p]
        token = entry[ids[p]]
        assert token.logprob == pytest.approx(row[ids[p]].item(), abs=LOGPROB_ATOL)
        assert token.rank == int((row >= row[ids[p]]).sum())
        top_ids = row.topk(TOP_K).indices.tolist()
        by_rank = sorted(entry.items(), key=lambda kv: kv[1].rank)
        assert [t for t, lp in by_rank if lp.rank <= TOP_K] == top_ids
        assert [entry[t].rank for t in top_ids] == [1, 2, 3]
        assert set(entry) == {*top_ids, ids[p]}


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 8])  # 8: the prompt in 3 chunks
def test_prompt_logprobs_match_transformers(
    llm: LLM, hf_logprobs, max_num_batched_tokens: int
) -> None:
    engine = LLM(llm.loaded, max_num_batched_tokens=max_num_batched_tokens, max_model_len=256)
    ids = prompt_ids(llm)
    assert len(ids) > 2 * 8
    params = SamplingParams(prompt_logprobs=TOP_K, max_tokens=2, temperature=0)
    out = engine.generate([ids], params, use_tqdm=False)[0]
    check_against(hf_logprobs(ids), ids, out.prompt_logprobs)
    assert out.prompt_logprobs[1][ids[1]].decoded_token == llm.get_tokenizer().decode([ids[1]])


def test_requests_without_prompt_logprobs_have_none(llm: LLM) -> None:
    out = llm.generate([prompt_ids(llm)], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_logprobs is None


def test_other_requests_unchanged_in_a_batch_with_prompt_logprobs(llm: LLM) -> None:
    others = ["Once upon a time", "def fibonacci(n):", "The sky is"]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    alone = [o.outputs[0].token_ids for o in llm.generate(others, greedy, use_tqdm=False)]
    scored = SamplingParams(prompt_logprobs=2, max_tokens=8, temperature=0)
    mixed = llm.generate([others[0], PROMPT, *others[1:]],
                         [greedy, scored, greedy, greedy], use_tqdm=False)  # fmt: skip
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 3)] == alone
    assert mixed[1].prompt_logprobs is not None and mixed[0].prompt_logprobs is None


def test_prefix_cache_hit_is_skipped_for_prompt_logprobs(llm: LLM, hf_logprobs) -> None:
    cached = LLM(llm.loaded, enable_prefix_caching=True, max_model_len=256, block_size=4)
    ids = prompt_ids(llm)
    cached.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)  # fills the cache
    again = cached.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the cache does hold the prompt
    params = SamplingParams(prompt_logprobs=TOP_K, max_tokens=1, temperature=0)
    out = cached.generate([ids], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check_against(hf_logprobs(ids), ids, out.prompt_logprobs)


def test_prompt_logprobs_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0, got -1"):
        SamplingParams(prompt_logprobs=-1)


def test_overlapping_windows_score_every_token_after_the_first_once() -> None:
    for n, window, stride in [(40, 16, 8), (17, 16, 5), (2, 2, 1), (100, 7, 3)]:
        spans = windows(n, window, stride)
        scored = [p for w in spans for p in range(w.first_scored, w.end)]
        assert scored == list(range(1, n))
        assert all(w.end - w.begin <= window and w.begin < w.first_scored for w in spans)


def test_windows_without_overlap_skip_each_window_first_token() -> None:
    spans = windows(40, 16, 16)  # no context for tokens 0, 16 and 32
    scored = [p for w in spans for p in range(w.first_scored, w.end)]
    assert scored == [p for p in range(40) if p % 16 != 0]
    assert [(w.begin, w.end, w.first_scored) for w in windows(20, 8, 4)] == [
        (0, 8, 1), (4, 12, 8), (8, 16, 12), (12, 20, 16)
    ]  # fmt: skip


def test_windows_refuse_bad_options() -> None:
    with pytest.raises(ValueError, match=r"stride must be in \[1, window=8\], got 9"):
        windows(20, 8, 9)
    with pytest.raises(ValueError, match="window must be at least 2 tokens, got 1"):
        windows(20, 1, 1)


@pytest.mark.parametrize("window, stride", [(16, 8), (16, 16)])
def test_perplexity_matches_transformers(llm: LLM, hf_logprobs, window: int, stride: int) -> None:
    ids = llm.get_tokenizer().encode(bundled_text())[:40]
    nll, count = 0.0, 0
    for w in windows(len(ids), window, stride):
        rows = hf_logprobs(ids[w.begin : w.end])  # [window, vocab]
        for p in range(w.first_scored, w.end):
            nll -= rows[p - w.begin - 1, ids[p]].item()
            count += 1
    result = perplexity(llm, ids, window, stride)
    assert result.num_scored_tokens == count
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-4)


def test_perplexity_window_must_fit_the_model(llm: LLM) -> None:
    with pytest.raises(ValueError, match="window is 256 tokens; the longest prompt"):
        perplexity(llm, list(range(300)), 256, 256)


def test_bundled_text_is_english_prose_of_a_few_kilobytes() -> None:
    text = bundled_text()
    assert 2000 <= len(text.encode()) <= 4096
    assert text.startswith("It is a truth universally acknowledged")


def test_prompt_logprobs_survive_preemption(tiny_model) -> None:
    roomy = LLM(tiny_model("llama"), num_blocks=256, block_size=4)
    tight = LLM(roomy.loaded, num_blocks=24, block_size=4, max_num_batched_tokens=8)
    prompts = [[(7 * i + 3 * j) % 500 + 10 for j in range(14)] for i in range(4)]
    params = SamplingParams(prompt_logprobs=2, max_tokens=24, temperature=0, ignore_eos=True)
    alone = roomy.generate(prompts, params, use_tqdm=False)
    crowded = tight.generate(prompts, params, use_tqdm=False)
    assert tight.get_metrics()["num_preemptions"] > 0
    for a, b in zip(alone, crowded):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) == 14
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5) for t in x)
