"""The decode loop in C (`platforms/cpu/fused_decode.py`, `kernels/decode_layers.c`) against
the Python loop.

It runs the same kernels in the same order, so a decode step's results are equal bit for
bit: the tests generate with both loops on one engine and compare every token's
log-probabilities exactly, for each linear kernel (bfloat16 panels, few-row fp32 and
bfloat16 rows, GGUF blocks as rows and as panels, int8 rows) and each pool the loop
stores into (the model's dtype, int8); and they check that steps it must not take (an fp8
pool, q/k norms, a quantization codec, other ops) run the Python loop.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.kernels import cpu_ops
from minserve.model.ops import MODEL_OPS
from minserve.model.quant_blocks import CODEC
from minserve.model.quantized_linear import use_quant_codec
from minserve.platforms.cpu import fused_decode
from minserve.platforms.cpu.ops import C_KERNEL_OPS

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]


def generate(llm: LLM, prompts: list[str], fused: bool, max_tokens: int = 6):
    """Greedy outputs of `prompts` with the C loop on or off, and the row counts it ran."""
    runner = llm.engine.worker.runner  # the CPU runner owns the loop
    loop, runner.fused_decode = runner.fused_decode, runner.fused_decode if fused else None
    runs: list[int] = []
    real = fused_decode.run_decode_layers

    def counted(x, layers, num_layers, step):
        runs.append(x.shape[0])
        return real(x, layers, num_layers, step)

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    try:
        with mock.patch.object(fused_decode, "run_decode_layers", counted):
            outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.fused_decode = loop
    return [o.outputs[0] for o in outputs], runs


def assert_same_steps(llm: LLM, prompts: list[str], rows: int) -> None:
    """Both loops give the same tokens and log-probabilities, exactly; the C loop ran every
    decode step of `rows` rows."""
    ours, runs = generate(llm, prompts, fused=True)
    theirs, none = generate(llm, prompts, fused=False)
    assert none == []
    assert runs.count(rows) == 5, f"the C loop ran {runs}"  # every decode step after prefill
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # floats compared exactly


@pytest.fixture(scope="module")
def bf16() -> LLM:
    return LLM(None, dtype="bfloat16", device="cpu")


def test_a_bfloat16_model_decodes_alike_in_the_c_loop(bf16: LLM) -> None:
    assert "fused_decode=on" in bf16.get_execution_config().summary()
    assert_same_steps(bf16, PROMPTS[:3], rows=3)
    assert_same_steps(bf16, PROMPTS[:1], rows=1)


def test_the_loop_stands_aside_for_other_ops(bf16: LLM) -> None:
    net = bf16.loaded.model
    assert net.ops is C_KERNEL_OPS  # the CPU platform's choice at load
    try:
        net.use_ops(dataclasses.replace(C_KERNEL_OPS))  # as a student's ops would be
        assert generate(bf16, PROMPTS[:2], fused=True)[1] == []
        net.use_ops(MODEL_OPS)  # minserve's torch ops: the layers' own torch code
        assert generate(bf16, PROMPTS[:2], fused=True)[1] == []
    finally:
        net.use_ops(C_KERNEL_OPS)
    assert generate(bf16, PROMPTS[:2], fused=True)[1] == [2] * 5


def test_with_the_kernels_off_there_is_no_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINSERVE_C_KERNELS", "0")
    llm = LLM(None, dtype="bfloat16", device="cpu")
    assert llm.engine.worker.runner.fused_decode is None
    assert "fused_decode=off" in llm.get_execution_config().summary()
    assert llm.loaded.model.ops is MODEL_OPS


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gguf_blocks_decode_alike_in_the_c_loop_as_rows_and_as_panels(dtype: str) -> None:
    llm = LLM(None, dtype=dtype, device="cpu", quantization="gguf")
    assert_same_steps(llm, PROMPTS[:2], rows=2)  # the few-row kernel on the blocks
    if dtype == "bfloat16" and cpu_ops.panels_native():  # 20 rows: widened into panels
        many = [f"{p} {i}" for i in range(5) for p in PROMPTS]
        assert_same_steps(llm, many, rows=20)


def test_int8_weights_and_an_int8_pool_decode_alike_in_the_c_loop() -> None:
    assert_same_steps(LLM(None, dtype="bfloat16", device="cpu", quantization="int8"), PROMPTS, 4)
    assert_same_steps(LLM(None, dtype="bfloat16", device="cpu", kv_cache_dtype="int8"), PROMPTS, 4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_few_row_kernels_and_biases_decode_alike_in_the_c_loop(
    tiny_model, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """Qwen2's q/k/v biases, and the row-major few-row kernel (fixed to 16 rows here)."""
    monkeypatch.setenv("MINSERVE_KERNEL_ROWS", "16")
    with mock.patch.object(cpu_ops, "panels_apply", lambda weight: False):
        llm = LLM(str(tiny_model("qwen2")), dtype=dtype, device="cpu")
    assert "linear_rows=16" in llm.get_execution_config().summary()
    assert_same_steps(llm, PROMPTS[:3], rows=3)


def test_steps_the_loop_cannot_take_run_in_python(tiny_model) -> None:
    qwen3 = LLM(str(tiny_model("qwen3")), dtype="bfloat16", device="cpu")  # q/k norms
    assert qwen3.engine.worker.runner.fused_decode is None
    assert "fused_decode=off" in qwen3.get_execution_config().summary()
    fp8 = LLM(str(tiny_model("llama")), dtype="bfloat16", device="cpu", kv_cache_dtype="fp8")
    assert generate(fp8, PROMPTS[:2], fused=True)[1] == []  # fp8 rows are encoded in torch
    ours, _ = generate(fp8, PROMPTS[:2], fused=True)
    theirs, _ = generate(fp8, PROMPTS[:2], fused=False)
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]


def test_a_quantization_codec_takes_the_layers_back_from_the_loop() -> None:
    llm = LLM(None, dtype="bfloat16", device="cpu", quantization="gguf")
    assert generate(llm, PROMPTS[:1], fused=True)[1] == [1] * 5
    use_quant_codec(llm.loaded.model, CODEC)  # as chapter 10 plugs a student's codec in
    assert generate(llm, PROMPTS[:1], fused=True)[1] == []
    use_quant_codec(llm.loaded.model, None)
    assert generate(llm, PROMPTS[:1], fused=True)[1] == [1] * 5


def test_the_loop_refuses_a_kernel_it_does_not_know() -> None:
    from minserve.kernels.decode_layers import c_linear
    from minserve.kernels.linear_kernels import KernelLinear

    with pytest.raises(ValueError, match="no linear kernel 'Q5_K rows'"):
        KernelLinear("Q5_K rows", torch.zeros(1), 32, 32)
    with pytest.raises(ValueError, match="no C linear kernel 'Q4_1 widen'"):
        c_linear(KernelLinear("Q4_1 widen", torch.zeros(1), 32, 32))
