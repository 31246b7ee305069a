"""GGUF files load for every supported tensor type, with llama.cpp's q/k permutation undone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from tiny_models import write_llama_gguf

from minserve import LLM, SamplingParams
from minserve.model.gguf_loader import (
    config_from_gguf,
    open_gguf,
    quantized_blocks,
    weights_from_gguf,
)

# Worst-case dequantization error as a fraction of each row's largest |weight|.
ERROR_BOUND = {Q.F32: 0.0, Q.F16: 1e-3, Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 7, Q.Q4_1: 1 / 12}


@pytest.fixture(scope="module")
def gguf_files(tiny_model, tmp_path_factory) -> dict[Q, Path]:
    """The tiny model in each tensor type, weights only (no tokenizer: quicker to read)."""
    folder = tmp_path_factory.mktemp("gguf")
    source = tiny_model("llama")
    return {q: write_llama_gguf(source, folder / f"{q.name}.gguf", q, None) for q in ERROR_BOUND}


@pytest.fixture(scope="module")
def q4_1_with_tokenizer(tiny_model, smollm_gguf: Path, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gguf_tokenizer")
    return write_llama_gguf(tiny_model("llama"), folder / "tiny-Q4_1.gguf", Q.Q4_1, smollm_gguf)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    reader = open_gguf(path)
    return weights_from_gguf(reader, config_from_gguf(reader))


@pytest.mark.parametrize("qtype", list(ERROR_BOUND), ids=lambda q: q.name)
def test_dequantized_weights_are_close_to_the_originals(qtype: Q, gguf_files, tiny_model) -> None:
    original = load_file(tiny_model("llama") / "model.safetensors")
    loaded = load_weights(gguf_files[qtype])
    assert set(loaded) == set(original)  # tied embeddings: no lm_head in either
    for name, w in original.items():
        row_max = w.abs().amax(dim=-1, keepdim=True)
        error = (loaded[name] - w).abs()
        assert (error <= ERROR_BOUND[qtype] * row_max + 1e-7).all(), name


@pytest.mark.parametrize("qtype", list(ERROR_BOUND), ids=lambda q: q.name)
def test_weights_equal_transformers_gguf_loader(qtype: Q, gguf_files) -> None:
    from transformers import AutoModelForCausalLM

    path = gguf_files[qtype]
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    expected = hf.state_dict()
    for name, w in load_weights(path).items():
        torch.testing.assert_close(w, expected[name], atol=0, rtol=0, msg=name)


def test_quantized_model_greedy_matches_transformers(q4_1_with_tokenizer: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = q4_1_with_tokenizer
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = tok("Hello there, general", return_tensors="pt").input_ids
    expected = hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    out = LLM(path).generate(
        "Hello there, general", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    assert out[0].prompt_token_ids == ids[0].tolist()
    assert out[0].outputs[0].token_ids == expected[0, ids.shape[1] :].tolist()


def test_blocks_served_as_stored_live_on_the_models_device(smollm_gguf: Path) -> None:
    """quantization="gguf" on a GPU: the embedding indexes its blocks with the step's ids
    on the model's device, so the blocks must be there (`meta` stands in for the GPU)."""
    from minserve.loader import build_model
    from minserve.model.quantized_linear import QUANTS

    reader = open_gguf(smollm_gguf)
    config = config_from_gguf(reader)
    meta = torch.device("meta")
    found = quantized_blocks(reader, config, QUANTS, meta)
    assert found and {blocks.device for _, blocks in found.values()} == {meta}
    net = build_model(config, weights_from_gguf(reader, config), torch.float32, meta,
                      quantized=found)  # fmt: skip
    assert {t.device for t in net.state_dict().values()} == {meta}
    hidden = net.model.embed_tokens(torch.tensor([1, 2, 3], device=meta))  # [3, hidden]
    assert hidden.device == meta and hidden.shape == (3, config.hidden_size)
