"""The decoder matches Hugging Face transformers on the same weights (fp32).

Logits agree within LOGIT_ATOL; greedy outputs agree token for token, through minserve's
own generation path (flat batches mixing prompts of different lengths).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.attention.contiguous import ContiguousAttention, ContiguousSlice, SequenceKV
from minserve.loader import load_model

LOGIT_ATOL = 1e-4  # fp32; the bundled model's logits reach about 30 in magnitude
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
]
TINY_KINDS = ["llama", "llama3_rope", "qwen2", "qwen3"]


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def minserve_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    """Prefill all but the last token, then decode the last one: exercises the KV cache."""
    loaded = load_model(path, dtype="float32", device="cpu")
    kv = SequenceKV(loaded.config, len(token_ids), torch.float32, torch.device("cpu"))
    ids = torch.tensor(token_ids)
    with torch.inference_mode():
        n = len(token_ids) - 1
        h1 = loaded.model(
            ids[:n], torch.arange(n), ContiguousAttention([ContiguousSlice(kv, 0, n)])
        )
        h2 = loaded.model(
            ids[n:], torch.arange(n, n + 1), ContiguousAttention([ContiguousSlice(kv, n, 1)])
        )
        return loaded.model.compute_logits(torch.cat([h1, h2]))  # [len, vocab]


def hf_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def smollm_hf(smollm_gguf: Path):
    return hf_model(smollm_gguf)


@pytest.fixture(scope="module")
def smollm_llm() -> LLM:
    return LLM(dtype="float32")


def test_smollm2_logits_match_transformers(smollm_gguf: Path, smollm_hf) -> None:
    ids = [504, 3575, 282, 4649, 314, 7042, 30]
    with torch.inference_mode():
        expected = smollm_hf(torch.tensor([ids])).logits[0]
    got = minserve_logits(smollm_gguf, ids)
    torch.testing.assert_close(got, expected, atol=LOGIT_ATOL, rtol=0)


def test_smollm2_greedy_matches_transformers(smollm_llm: LLM, smollm_hf) -> None:
    from transformers import AutoTokenizer

    gguf = smollm_llm.loaded.path
    hf_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = smollm_llm.generate(PROMPTS, params, use_tqdm=False)  # one mixed batch
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(smollm_hf, hf_tok, prompt, 24), prompt


def test_smollm2_answers_capital_of_france(smollm_llm: LLM) -> None:
    out = smollm_llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=8)
    )
    assert "Paris" in out[0].outputs[0].text


def test_smollm2_chat_stops_at_end_of_turn(smollm_llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France? One word."}]
    out = smollm_llm.chat(messages, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] == 2  # <|im_end|> ends the assistant's turn
    assert "Paris" in completion.text


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_model_logits_match_transformers(kind: str, tiny_model) -> None:
    path = tiny_model(kind)
    ids = [1, 504, 3575, 282, 4649, 314, 77, 9000, 123]
    with torch.inference_mode():
        expected = hf_model(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(minserve_logits(path, ids), expected, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_model_greedy_matches_transformers(kind: str, tiny_model) -> None:
    from transformers import AutoTokenizer

    path = tiny_model(kind)
    model, tokenizer = hf_model(path), AutoTokenizer.from_pretrained(path)
    llm = LLM(path, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, tokenizer, prompt, 16), (kind, prompt)


def test_llama3_rope_scaling_changes_frequencies(tiny_model) -> None:
    """Guard against silently ignoring rope scaling: it must alter the low frequencies."""
    from minserve.model.llama import rope_inverse_frequencies

    config = load_model(tiny_model("llama3_rope"), device="cpu").config
    assert config.rope_scaling is not None
    unscaled = rope_inverse_frequencies(type(config)(**{**config.__dict__, "rope_scaling": None}))
    scaled = rope_inverse_frequencies(config)
    assert torch.equal(scaled[0], unscaled[0])  # highest frequency kept
    torch.testing.assert_close(scaled[-1], unscaled[-1] / config.rope_scaling.factor)
