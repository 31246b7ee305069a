"""`LLM(kv_cache_dtype="int8", kv_codec=KVCodec.from_module(module))`: the engine stores and
reads its int8 KV cache with a module's `quantize_int8` and `dequantize_int8` (chapter 10).

Oracles: the same engine on minserve's own int8 cache (the solutions' pair must keep its
greedy tokens); a pair that forgets the scale must change them, so the codec really runs.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from test_engine import token_ids

from minserve import LLM, CoursePlugins, SamplingParams
from minserve.attention.triton_decode import DecodeKernels
from minserve.course.chapters import REPO_ROOT, get_chapter
from minserve.course.check import load_implementation
from minserve.kvcache.kv_format import INT8_CODEC, KVCodec, dequantize_int8, kv_format

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def int8_llm() -> LLM:
    return LLM(num_blocks=16, kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def solution_codec() -> KVCodec:
    solutions = load_implementation(get_chapter("10"), "solutions", REPO_ROOT).module
    return KVCodec.from_module(solutions)


def with_codec(
    int8_llm: LLM, codec: KVCodec, plugins: CoursePlugins | None = None, **options
) -> LLM:
    plugins = replace(plugins or CoursePlugins(), kv_codec=codec)
    return LLM(int8_llm.loaded, num_blocks=16, kv_cache_dtype="int8", plugins=plugins, **options)


def greedy(llm: LLM) -> list[list[int]]:
    return token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_the_solutions_codec_keeps_the_int8_cache_s_greedy_tokens(int8_llm, solution_codec):
    assert greedy(with_codec(int8_llm, solution_codec)) == greedy(int8_llm)


def test_a_codec_that_forgets_the_scale_changes_the_tokens(int8_llm):
    unscaled = KVCodec(INT8_CODEC.quantize, lambda q, scale: q.float())
    assert greedy(with_codec(int8_llm, unscaled)) != greedy(int8_llm)


def test_the_pool_holds_the_codec_and_auto_attention_runs_in_torch(int8_llm, solution_codec):
    llm = with_codec(int8_llm, solution_codec)
    assert llm.engine.worker.pool.format.codec is solution_codec
    assert llm.get_execution_config().attention == "torch"
    assert llm.get_execution_config().kv_cache_dtype == "int8"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_a_codec_without_an_int8_cache_is_refused(kv_cache_dtype):
    with pytest.raises(ValueError, match="pass kv_cache_dtype='int8' with it"):
        LLM(kv_cache_dtype=kv_cache_dtype, plugins=CoursePlugins(kv_codec=INT8_CODEC))


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_a_codec_refuses_the_backends_whose_kernels_would_bypass_it(int8_llm, backend):
    with pytest.raises(ValueError, match="would bypass the codec"):
        with_codec(int8_llm, INT8_CODEC, attention_backend=backend)


def test_a_codec_and_decode_kernels_are_refused_together(int8_llm):
    with pytest.raises(ValueError, match="give one or the other"):
        with_codec(int8_llm, INT8_CODEC, CoursePlugins(decode_kernels=DecodeKernels()))


def test_the_int8_format_encodes_and_decodes_through_its_codec():
    x = torch.randn(3, 2, 8)  # [T, Hkv, D]
    halved = KVCodec(INT8_CODEC.quantize, lambda q, scale: dequantize_int8(q, scale) / 2)
    fmt = kv_format("int8", torch.float32, halved)
    reference = kv_format("int8", torch.float32)
    assert torch.equal(fmt.encode(x), reference.encode(x))
    assert torch.equal(fmt.decode(fmt.encode(x)), reference.decode(reference.encode(x)) / 2)


def test_from_module_names_the_missing_functions():
    module = SimpleNamespace(__name__="mine", quantize_int8=INT8_CODEC.quantize)
    with pytest.raises(ValueError, match="module mine has no function dequantize_int8"):
        KVCodec.from_module(module)
