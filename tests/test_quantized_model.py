"""`quantization="gguf"`: the bundled Q4_1 file served as stored against the same file
dequantized at load (the same weights), and the torch dequantization against the `gguf`
package's. `quantization="int8"`: the int8 model against the fp32 model holding the same
int8 weights widened back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from minserve.attention.contiguous import ContiguousAttention, ContiguousSlice, SequenceKV
from minserve.bench.perplexity import bundled_text, perplexity
from minserve.kernels.build import cpu_kernels
from minserve.llm import LLM
from minserve.loader import LoadedModel, load_model
from minserve.model.default_model import default_model_path
from minserve.model.int8_linear import dequantize_int8, quantize_int8
from minserve.model.quantized_linear import (
    QUANTS,
    QuantizedEmbedding,
    QuantizedLinear,
    dequantize,
    weight_bytes,
)
from minserve.platforms.cpu.linears import BLOCK_ROWS
from minserve.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]


@pytest.fixture(scope="module")
def models():
    return load_model(quantization="gguf"), load_model()


@pytest.mark.parametrize("quant", QUANTS)
def test_torch_dequantization_is_the_gguf_packages_bit_for_bit(quant: str) -> None:
    values = np.random.default_rng(0).normal(size=(7, 96)).astype(np.float32)
    values[0] = 2.5  # one block of equal values: scale 0
    blocks = quantize(values, GGMLQuantizationType[quant])
    want = gguf_dequantize(blocks, GGMLQuantizationType[quant]).reshape(values.shape)
    got = dequantize(torch.from_numpy(np.ascontiguousarray(blocks)), quant)
    assert torch.equal(got, torch.from_numpy(want.astype(np.float32)))


def logits(loaded, token_ids: list[int]) -> torch.Tensor:
    """Prefill all but the last token (many rows: widened weights), decode the last one
    (one row: the C kernel on the blocks)."""
    kv = SequenceKV(loaded.config, len(token_ids), torch.float32, torch.device("cpu"))
    ids, n = torch.tensor(token_ids), len(token_ids) - 1
    with torch.inference_mode():
        first = ContiguousAttention([ContiguousSlice(kv, 0, n)])
        h1 = loaded.model(ids[:n], torch.arange(n), first)
        last = ContiguousAttention([ContiguousSlice(kv, n, 1)])
        h2 = loaded.model(ids[n:], torch.arange(n, n + 1), last)
        return loaded.model.compute_logits(torch.cat([h1, h2]))  # [len, vocab]


def test_the_quantized_model_holds_blocks_and_computes_the_dequantized_logits(models) -> None:
    quantized, dequantized = models
    linears = [m for m in quantized.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 30 * 4 + 1  # qkv, o, gate_up, down per layer; the tied head
    assert isinstance(quantized.model.model.embed_tokens, QuantizedEmbedding)
    assert quantized.model.lm_head.blocks is quantized.model.model.embed_tokens.blocks
    ids = quantized.tokenizer.encode("The capital of France is Paris, and the capital of Italy")
    got, want = logits(quantized, ids), logits(dequantized, ids)
    assert (got - want).abs().max() < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_it_holds_a_third_of_a_bfloat16_models_weights(models) -> None:
    quantized, _ = models
    served = weight_bytes(load_model(dtype="bfloat16").model)  # packed copies, if any, add
    stored = weight_bytes(load_model(dtype="bfloat16", prepack=False).model)
    assert served >= stored
    assert weight_bytes(quantized.model) <= stored * 0.37  # 5 bits a weight, 8.5 for the table
    assert "gguf(Q4_1:210,Q8_0:1; weights" in quantized.execution.summary()


@pytest.mark.skipif(cpu_kernels() is None, reason="the C kernels could not be built")
def test_greedy_tokens_are_the_dequantized_models(models) -> None:
    quantized, dequantized = models
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outputs = [
        [o.outputs[0].token_ids for o in LLM(m, max_num_seqs=4).generate(PROMPTS, params)]
        for m in models
    ]
    assert outputs[0] == outputs[1]


def test_quantization_is_refused_where_it_cannot_apply(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown quantization 'awq'; choose None, 'gguf' or"):
        load_model(quantization="awq")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="serves a .gguf file as stored"):
        load_model(tmp_path, quantization="gguf")
    with pytest.raises(ValueError, match="quantization runs in one process"):
        LLM(quantization="gguf", tensor_parallel_size=2)
    assert default_model_path().suffix == ".gguf"


def fake_quantized_int8() -> LoadedModel:
    """The bundled model in fp32 whose every weight matrix is replaced by its int8 values
    widened back (`dequantize_int8(quantize_int8(w))`): the weights an int8 model holds."""
    loaded = load_model(prepack=False)
    with torch.no_grad():
        for module in loaded.model.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight.copy_(dequantize_int8(*quantize_int8(module.weight)))
    return loaded  # the tied head is the embedding's (already widened) weight


@pytest.fixture(scope="module")
def int8_model() -> LoadedModel:
    return load_model(quantization="int8")


def test_the_int8_model_holds_int8_rows_and_computes_their_widened_logits(int8_model) -> None:
    int8 = int8_model
    assert not any(isinstance(m, nn.Linear | nn.Embedding) for m in int8.model.modules())
    assert int8.model.lm_head.qweight is int8.model.model.embed_tokens.qweight
    ids = int8.tokenizer.encode("The capital of France is Paris, and the capital of Italy")
    reference = fake_quantized_int8()
    got, want = logits(int8, ids), logits(reference, ids)
    assert (got - want).abs().max() < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outputs = [
        [o.outputs[0].token_ids for o in LLM(m, max_num_seqs=4).generate(PROMPTS, params)]
        for m in (int8, reference)
    ]
    assert outputs[0] == outputs[1]
    fp32 = weight_bytes(reference.model)  # unpacked fp32 parameters (values int8's, bytes not)
    assert weight_bytes(int8.model) <= fp32 * 0.26  # a byte a weight, a scale a row
    assert "int8(per channel: 122 layers; weights" in int8.execution.summary()


def test_int8_perplexity_on_the_bundled_text_is_within_two_percent_of_float32(
    int8_model, models
) -> None:
    _, fp32 = models  # the bundled file dequantized at load: the float weights int8 starts from
    ids = fp32.tokenizer.encode(bundled_text())  # Pride and Prejudice's opening, ~700 tokens
    want, got = (perplexity(LLM(m, max_num_seqs=4), ids, 256, 256) for m in (fp32, int8_model))
    assert got.num_scored_tokens == want.num_scored_tokens > 600
    assert abs(got.perplexity / want.perplexity - 1) < 0.02


def test_a_bfloat16_prefill_widens_the_blocks_to_the_dense_bfloat16_weights() -> None:
    """More rows than the C kernel takes: the blocks are widened to bfloat16 (the fp32
    weights rounded, as the dense bfloat16 model rounds them) and multiplied in bfloat16,
    so the prefill's logits are the dense bfloat16 model's (widening to fp32 instead moved
    them by up to a whole logit and changed 2 of 25 greedy picks)."""
    quantized, dense = (
        load_model(quantization="gguf", dtype="bfloat16"),
        load_model(dtype="bfloat16"),
    )
    text = ("The capital of France is Paris, and the capital of Italy is Rome. Germany has "
            "Berlin as its capital, and Spain has")  # fmt: skip
    ids = torch.tensor(dense.tokenizer.encode(text))
    assert len(ids) > BLOCK_ROWS

    def prefill_logits(loaded: LoadedModel) -> torch.Tensor:
        kv = SequenceKV(loaded.config, len(ids), torch.bfloat16, torch.device("cpu"))
        attention = ContiguousAttention([ContiguousSlice(kv, 0, len(ids))])
        with torch.inference_mode():
            hidden = loaded.model(ids, torch.arange(len(ids)), attention)
            return loaded.model.compute_logits(hidden).float()  # [len, vocab]

    got, want = prefill_logits(quantized), prefill_logits(dense)
    # four bfloat16 steps at the logits' size (1/8 each between 16 and 32): the two models'
    # products run in different kernels (the dense one's packed for oneDNN), whose bf16
    # results differ by rounding (three steps measured on a CPU without native bfloat16);
    # widening to fp32 moved them by a whole logit
    assert (got - want).abs().max() <= 0.5
    ours, theirs = got.argmax(-1), want.argmax(-1)
    for row in (ours != theirs).nonzero().flatten().tolist():  # only at a near tie
        assert want[row, theirs[row]] - want[row, ours[row]] <= 0.5, row
