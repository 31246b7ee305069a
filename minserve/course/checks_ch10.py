"""Checks for chapter 10, run against any module that defines GGUF's block codecs
(`quantize_q8_0`, `dequantize_q8_0`, `pack_nibbles`, `unpack_nibbles`, `quantize_q4_0`,
`dequantize_q4_0`, `quantize_q4_1`, `dequantize_q4_1`), `dequantize_matmul`,
`quantize_weights` and the int8 KV row (`quantize_int8`, `dequantize_int8`): the
solutions, or a student's exercise file.

The oracle is the `gguf` package's `quantize` and `dequantize` (llama.cpp's reference
arithmetic): blocks must agree byte for byte and weights bit for bit, on hand-made rows
(an all-zero block, a constant block, exact halves) and on random rows drawn by
hypothesis. The matmul is compared with x @ dequantize(blocks).T, and watched to widen
slices, not the whole matrix; then it runs inside the engine's `QuantizedLinear`. A tiny
random Llama, quantized layer by layer, must hold minserve's blocks for each weight.
The int8 KV row's oracle is minserve's `kv_format.quantize_int8`, bit for bit (hand-made
and hypothesis rows); then the engine stores its KV cache with the student's pair
(`LLM(kv_cache_dtype="int8", kv_codec=...)`) and must keep the reference's greedy tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve.course.nonfinite import lead_with_nonfinite
from minserve.kernels.cpu_ops import QUANT_BLOCK_BYTES
from minserve.kvcache.kv_format import INT8_CODEC, KVCodec
from minserve.model.llama import CausalLM
from minserve.model.quant_blocks import QuantCodec, dequantize, quantize
from minserve.model.quantized_linear import QuantizedEmbedding, QuantizedLinear
from minserve.model_config import ModelConfig

_SETTINGS = settings(
    max_examples=60, deadline=None, database=None, derandomize=True, report_multiple_bugs=False
)
# rows of whole blocks; plenty of zeros so that all-zero blocks and ties come up. Values
# below 1e-6 become 0: a scale that small has no fp32 inverse (gguf's own arithmetic
# overflows there), and weights are never that small.
_values = st.one_of(
    st.floats(-8.0, 8.0, width=32).map(lambda v: v if abs(v) > 1e-6 else 0.0),
    st.just(0.0),
    st.sampled_from([0.5, -0.5, 1.5, 127.0]),
)
_rows = st.integers(1, 3).flatmap(
    lambda blocks: st.lists(
        st.lists(_values, min_size=32 * blocks, max_size=32 * blocks), min_size=1, max_size=3
    )
)


def _hand_made_rows() -> torch.Tensor:
    """Four rows of three blocks: random, an all-zero block, a constant one, exact halves."""
    g = torch.Generator().manual_seed(10)
    rows = torch.randn(4, 96, generator=g) * 2  # [4, 3 blocks of 32]
    rows[1, :32] = 0.0
    rows[1, 32:64] = -3.25
    rows[2, :32] = torch.arange(32) - 15.5  # halves everywhere
    rows[3, 64:] = torch.linspace(-1, 1, 32) * 1e-3  # a tiny block
    rows[3, 70] = 127.0  # one large weight sets the scale
    return rows


def _first_bad_block(expected: np.ndarray, got: np.ndarray, per_block: int) -> str:
    diff = np.argwhere(expected != got)[0]
    row, col = int(diff[0]), int(diff[1])
    block = col // per_block
    span = slice(block * per_block, (block + 1) * per_block)
    return (
        f"row {row}, block {block} (byte {col % per_block} of it): expected bytes "
        f"{expected[row, span].tolist()}, got {got[row, span].tolist()}"
    )


def _assert_quantize(impl: ModuleType, quant: str, rows: torch.Tensor) -> None:
    """impl's quantize of `rows` equals gguf's, byte for byte."""
    name = f"quantize_{quant.lower()}"
    expected = gguf_quantize(rows.numpy(), GGMLQuantizationType[quant])
    got = getattr(impl, name)(rows.clone())
    assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8, (
        f"{name} must return a uint8 tensor, got {type(got).__name__} {getattr(got, 'dtype', '')}"
    )
    assert tuple(got.shape) == expected.shape, (
        f"{name}(rows {tuple(rows.shape)}): expected blocks shaped {expected.shape} "
        f"({QUANT_BLOCK_BYTES[quant]} bytes a block of 32), got {tuple(got.shape)}"
    )
    got_np = got.numpy()
    assert np.array_equal(expected, got_np), f"{name}: " + _first_bad_block(
        expected, got_np, QUANT_BLOCK_BYTES[quant]
    )


def _assert_dequantize(impl: ModuleType, quant: str, rows: torch.Tensor) -> None:
    """impl's dequantize of gguf's blocks equals gguf's, bit for bit."""
    name = f"dequantize_{quant.lower()}"
    blocks = gguf_quantize(rows.numpy(), GGMLQuantizationType[quant])
    expected = gguf_dequantize(blocks, GGMLQuantizationType[quant])  # [rows, in]
    got = getattr(impl, name)(torch.from_numpy(blocks.copy()))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, (
        f"{name} must return a float32 tensor, got {type(got).__name__} {getattr(got, 'dtype', '')}"
    )
    assert tuple(got.shape) == expected.shape, (
        f"{name}(blocks {blocks.shape}): expected weights shaped {expected.shape}, "
        f"got {tuple(got.shape)}"
    )
    bad = np.argwhere(expected != got.numpy())
    assert len(bad) == 0, (
        f"{name}: {len(bad)} weights differ; first at row {bad[0][0]}, column {bad[0][1]} "
        f"(block {bad[0][1] // 32}, weight {bad[0][1] % 32} of it): expected "
        f"{expected[bad[0][0], bad[0][1]]!r}, got {got[bad[0][0], bad[0][1]].item()!r}"
    )


def check_q8_0_quantize_matches_gguf(impl: ModuleType) -> None:
    """Q8_0 blocks of hand-made rows (zeros, a constant, exact halves) equal gguf's bytes."""
    _assert_quantize(impl, "Q8_0", _hand_made_rows())


def check_q8_0_dequantize_matches_gguf(impl: ModuleType) -> None:
    """Q8_0 blocks widen to gguf's weights, bit for bit."""
    _assert_dequantize(impl, "Q8_0", _hand_made_rows())


def check_q8_0_random_rows(impl: ModuleType) -> None:
    """Random rows (hypothesis): quantize and dequantize agree with gguf on every one."""

    @_SETTINGS
    @given(_rows)
    def run(values: list[list[float]]) -> None:
        rows = torch.tensor(values, dtype=torch.float32)
        _assert_quantize(impl, "Q8_0", rows)
        _assert_dequantize(impl, "Q8_0", rows)

    run()


def check_nibbles_in_gguf_order(impl: ModuleType) -> None:
    """pack_nibbles puts q_j low and q_(j+16) high in byte j; unpack_nibbles undoes it."""
    q = torch.tensor([[*range(16), *range(15, -1, -1)], [15 - j % 16 for j in range(32)]])
    expected = [[j | (15 - j) << 4 for j in range(16)], [(15 - j) * 17 for j in range(16)]]
    got = impl.pack_nibbles(q.float())
    assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8 and got.shape == (2, 16), (
        f"pack_nibbles(q [2, 32]) must return uint8 [2, 16], got "
        f"{type(got).__name__} {getattr(got, 'dtype', '')} {tuple(getattr(got, 'shape', ()))}"
    )
    assert got.tolist() == expected, (
        f"pack_nibbles({q[0].tolist()}): expected bytes {expected[0]}, got {got[0].tolist()}"
    )
    back = impl.unpack_nibbles(got)
    assert torch.equal(back, q.float()), (
        f"unpack_nibbles({got[0].tolist()}): expected {q[0].tolist()}, got {back[0].tolist()}"
    )


def check_q4_0_matches_gguf(impl: ModuleType) -> None:
    """Q4_0 blocks of hand-made rows equal gguf's bytes, and widen to gguf's weights."""
    _assert_quantize(impl, "Q4_0", _hand_made_rows())
    _assert_dequantize(impl, "Q4_0", _hand_made_rows())


def check_q4_1_matches_gguf(impl: ModuleType) -> None:
    """Q4_1 blocks of hand-made rows equal gguf's bytes, and widen to gguf's weights."""
    _assert_quantize(impl, "Q4_1", _hand_made_rows())
    _assert_dequantize(impl, "Q4_1", _hand_made_rows())


def check_4_bit_random_rows(impl: ModuleType) -> None:
    """Random rows (hypothesis): Q4_0 and Q4_1 agree with gguf both ways on every one."""

    @_SETTINGS
    @given(_rows)
    def run(values: list[list[float]]) -> None:
        rows = torch.tensor(values, dtype=torch.float32)
        for quant in ("Q4_0", "Q4_1"):
            _assert_quantize(impl, quant, rows)
            _assert_dequantize(impl, quant, rows)

    run()


def _matmul_case(quant: str, n: int, out: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n * 1000 + blocks)
    weights = torch.randn(out, 32 * blocks, generator=g)  # [out, in]
    return torch.randn(n, 32 * blocks, generator=g), quantize(weights, quant)


def check_matmul_equals_widened_product(impl: ModuleType) -> None:
    """x @ widen(blocks).T for Q8_0 and Q4_1, one row and five, 3 to 19 blocks a row."""
    for quant, n, blocks in [("Q8_0", 1, 3), ("Q4_1", 5, 19), ("Q4_1", 1, 16), ("Q8_0", 5, 9)]:
        x, packed = _matmul_case(quant, n, 24, blocks)
        expected = x @ dequantize(packed, quant).T  # [n, 24]
        got = impl.dequantize_matmul(x, packed, quant, dequantize)
        what = f"dequantize_matmul(x [{n}, {32 * blocks}], {quant} blocks [24, ...])"
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape, (
            f"{what}: expected a tensor shaped {tuple(expected.shape)}, got "
            f"{type(got).__name__} {tuple(getattr(got, 'shape', ()))}"
        )
        worst = (got - expected).abs().max().item()
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-4), lead_with_nonfinite(
            got,
            f"{what}: off by up to {worst:.3g}; expected row 0 starting "
            f"{expected[0, :4].tolist()}, got {got[0, :4].tolist()}",
        )


def check_matmul_widens_slices_once(impl: ModuleType) -> None:
    """The matmul widens column slices (never the whole weight), each block exactly once."""
    x, packed = _matmul_case("Q4_1", 2, 8, 32)  # 32 blocks a row
    widths: list[int] = []

    def spy(blocks: torch.Tensor, quant: str) -> torch.Tensor:
        widths.append(blocks.shape[1] // QUANT_BLOCK_BYTES[quant])
        return dequantize(blocks, quant)

    impl.dequantize_matmul(x, packed, "Q4_1", spy)
    assert widths and max(widths) < 32, (
        f"widen was called for {widths} blocks of columns at a time; a row has 32 blocks, "
        "and the point is never to widen all of them at once"
    )
    assert sum(widths) == 32, (
        f"the slices widened cover {sum(widths)} blocks of columns ({widths}); each of the "
        "32 blocks of a row should be widened exactly once"
    )


def check_codec_runs_a_quantized_layer(impl: ModuleType) -> None:
    """The engine's QuantizedLinear with your codec (`LLM(quant_codec=...)`) gives the
    layer's output: a decode's row and a prefill's rows, Q8_0 and Q4_1, with a bias."""
    codec = QuantCodec.from_module(impl)
    for quant, n in [("Q4_1", 1), ("Q8_0", 7)]:
        x, packed = _matmul_case(quant, n, 16, 6)
        bias = torch.linspace(-1, 1, 16)
        layer = QuantizedLinear(packed, quant, bias)
        expected = x @ dequantize(packed, quant).T + bias  # [n, 16]
        layer.codec = codec
        got = layer(x)
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-4), lead_with_nonfinite(
            got,
            f"QuantizedLinear({quant}, {n} rows) with your codec: off by up to "
            f"{(got - expected).abs().max().item():.3g}",
        )


def _tiny_model(tied: bool) -> CausalLM:
    config = ModelConfig(
        architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=96,
        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, rms_norm_eps=1e-6,
        rope_theta=10_000.0, max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(10)
    return CausalLM(config).eval()


def _assert_quantized_model(impl: ModuleType, tied: bool) -> None:
    model = _tiny_model(tied)
    linears = {
        n: m.weight.detach().clone()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    table = model.model.embed_tokens.weight.detach().clone()
    count = impl.quantize_weights(model, "Q8_0", lambda rows: quantize(rows, "Q8_0"))
    what = f"quantize_weights (a 2-layer Llama, {'tied' if tied else 'untied'} head)"
    assert count == len(linears) + 1, (
        f"{what}: expected {len(linears)} linear layers and 1 embedding replaced, "
        f"got a count of {count}"
    )
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding) and embedding.dtype == torch.float32, (
        f"{what}: model.embed_tokens should be a float32 QuantizedEmbedding, got {embedding!r}"
    )
    assert torch.equal(embedding.blocks, quantize(table, "Q8_0")), (
        f"{what}: the embedding's blocks are not quantize(its table)"
    )
    for name, weight in linears.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, QuantizedLinear) and layer.quant == "Q8_0", (
            f"{what}: {name} should be a Q8_0 QuantizedLinear, got {layer!r}"
        )
        assert torch.equal(layer.blocks, quantize(weight, "Q8_0")), (
            f"{what}: {name}'s blocks are not quantize(its weight)"
        )
    if tied:
        assert model.lm_head.blocks.data_ptr() == embedding.blocks.data_ptr(), (
            f"{what}: the tied head should share the embedding's blocks, not hold a copy"
        )


def check_quantize_weights_replaces_every_layer(impl: ModuleType) -> None:
    """Every linear layer and the embedding of a tiny untied Llama hold quantize(weight)."""
    _assert_quantized_model(impl, tied=False)


def check_quantize_weights_shares_a_tied_head(impl: ModuleType) -> None:
    """A head tied to the embedding reads the embedding's blocks, quantized once."""
    _assert_quantized_model(impl, tied=True)


# --- exercise 10.5: the int8 KV store, against minserve's `kv_format.quantize_int8` ---

FP16_LARGEST = 65504.0
# KV rows: plenty of zeros; values past 127 x 65504 (the largest fp16 scale) saturate
_kv_values = st.one_of(
    st.floats(-300.0, 300.0, width=32),
    st.just(0.0),
    st.sampled_from([0.5, -2.5, 127.0, -1e7, 1e7]),
)
_kv_rows = st.integers(1, 40).flatmap(
    lambda d: st.lists(st.lists(_kv_values, min_size=d, max_size=d), min_size=1, max_size=4)
)


def _kv_hand_made_rows() -> torch.Tensor:
    """[4 tokens, 2 KV heads, 16]: random; an all-zero row; a row past fp16's range;
    exact halves at scale 1 and at scale 0.5; a tiny row."""
    g = torch.Generator().manual_seed(105)
    x = torch.randn(4, 2, 16, generator=g) * 3  # [T, Hkv, D]
    x[1, 0] = 0.0  # scale 0, q 0
    x[1, 1] = torch.linspace(-1, 1, 16) * 4 * 127 * FP16_LARGEST  # saturates
    x[2, 0] = torch.arange(16) - 7.5  # halves: scale 1 once 127 sets it
    x[2, 0, 15] = 127.0
    x[2, 1] = (torch.arange(16) - 8) * 0.5 + 0.25  # x / 0.5 is a half; 63.5 sets 0.5
    x[2, 1, 0] = -63.5
    x[3, 1] = torch.linspace(-1, 1, 16) * 1e-4
    return x


def _first_bad_row(expected: torch.Tensor, got: torch.Tensor) -> str:
    """Where two [..., D] tensors first differ: the row's index, expected and got."""
    bad = (expected != got).reshape(-1, expected.shape[-1]).any(dim=-1).nonzero()[0].item()
    index = tuple(int(i) for i in np.unravel_index(bad, expected.shape[:-1]))
    row = (expected.reshape(-1, expected.shape[-1])[bad], got.reshape(-1, got.shape[-1])[bad])
    return f"first at row {index}: expected {row[0].tolist()}, got {row[1].tolist()}"


def _assert_kv_quantize(impl: ModuleType, x: torch.Tensor) -> None:
    """impl's quantize_int8(x) equals minserve's: q and scale, bit for bit."""
    want_q, want_scale = INT8_CODEC.quantize(x)
    got = impl.quantize_int8(x.clone())
    assert isinstance(got, tuple) and len(got) == 2, (
        f"quantize_int8 must return a pair (q, scale), got {type(got).__name__}"
    )
    q, scale = got
    what = f"quantize_int8(x {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')})"
    for name, value, want in (("q", q, want_q), ("scale", scale, want_scale)):
        assert isinstance(value, torch.Tensor) and value.dtype == want.dtype, (
            f"{what}: {name} must be a {want.dtype} tensor, got {type(value).__name__} "
            f"{getattr(value, 'dtype', '')}"
        )
        assert value.shape == want.shape, (
            f"{what}: {name} should be shaped {tuple(want.shape)}, got {tuple(value.shape)}"
        )
    assert torch.equal(scale, want_scale), f"{what}: scales differ, " + _first_bad_row(
        want_scale, scale
    )
    assert torch.equal(q, want_q), f"{what}: q differs, " + _first_bad_row(want_q, q)


def _assert_kv_dequantize(impl: ModuleType, x: torch.Tensor) -> None:
    """impl's dequantize_int8 of minserve's (q, scale) equals minserve's, bit for bit."""
    q, scale = INT8_CODEC.quantize(x)
    want = INT8_CODEC.dequantize(q, scale)
    got = impl.dequantize_int8(q.clone(), scale.clone())
    what = f"dequantize_int8(q {tuple(q.shape)}, scale {tuple(scale.shape)})"
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, (
        f"{what} must return a float32 tensor, got {type(got).__name__} {getattr(got, 'dtype', '')}"
    )
    assert got.shape == want.shape, f"{what}: expected {tuple(want.shape)}, got {tuple(got.shape)}"
    assert torch.equal(got, want), f"{what}: values differ, " + _first_bad_row(want, got)


def check_int8_quantize_matches_minserve(impl: ModuleType) -> None:
    """Hand-made KV rows (zero, past fp16's range, halves, tiny): minserve's q and scales.

    Bit for bit, from fp32 and from bf16."""
    x = _kv_hand_made_rows()
    _assert_kv_quantize(impl, x)
    _assert_kv_quantize(impl, x.bfloat16())


def check_int8_dequantize_matches_minserve(impl: ModuleType) -> None:
    """q times its fp16 scale, widened to fp32: minserve's values, bit for bit."""
    _assert_kv_dequantize(impl, _kv_hand_made_rows())


def check_int8_random_rows(impl: ModuleType) -> None:
    """Random KV rows (hypothesis): quantize and dequantize agree with minserve's on each."""

    @_SETTINGS
    @given(_kv_rows)
    def run(values: list[list[float]]) -> None:
        x = torch.tensor(values, dtype=torch.float32)  # [rows, D]
        _assert_kv_quantize(impl, x)
        _assert_kv_dequantize(impl, x)

    run()


KV_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@functools.cache
def _int8_llm() -> Any:
    """The bundled SmolLM2 on minserve's int8 KV cache, in torch attention (the oracle)."""
    from minserve.llm import LLM

    return LLM(num_blocks=16, kv_cache_dtype="int8", attention_backend="torch")


def _greedy_tokens(llm: Any) -> list[list[int]]:
    from minserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(KV_PROMPTS, params, use_tqdm=False)]


@functools.cache
def _int8_reference_tokens() -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(tokens) for tokens in _greedy_tokens(_int8_llm()))


def check_kv_codec_keeps_the_int8_engine_s_tokens(impl: ModuleType) -> None:
    """The engine on your int8 KV store (`LLM(kv_codec=...)`) keeps minserve's greedy tokens.

    `LLM(kv_cache_dtype="int8", kv_codec=KVCodec.from_module(module))` stores and reads
    every cached key and value with your pair; the oracle is the same engine on minserve's."""
    from minserve.llm import LLM
    from minserve.plugins import CoursePlugins

    impl.quantize_int8(torch.ones(1, 4))  # a stub stops here, before the model loads
    codec = KVCodec.from_module(impl)
    expected = [list(tokens) for tokens in _int8_reference_tokens()]
    llm = LLM(
        _int8_llm().loaded,
        num_blocks=16,
        kv_cache_dtype="int8",
        plugins=CoursePlugins(kv_codec=codec),
    )
    got = _greedy_tokens(llm)
    for prompt, want, tokens in zip(KV_PROMPTS, expected, got):
        assert tokens == want, (
            f"greedy tokens of {prompt!r} on your int8 KV cache: expected {want}, got {tokens}"
        )


check_kv_codec_keeps_the_int8_engine_s_tokens.time_limit_factor = 3  # type: ignore[attr-defined]


CHECKS: list[Callable[[ModuleType], None]] = [
    check_q8_0_quantize_matches_gguf,
    check_q8_0_dequantize_matches_gguf,
    check_q8_0_random_rows,
    check_nibbles_in_gguf_order,
    check_q4_0_matches_gguf,
    check_q4_1_matches_gguf,
    check_4_bit_random_rows,
    check_matmul_equals_widened_product,
    check_matmul_widens_slices_once,
    check_codec_runs_a_quantized_layer,
    check_quantize_weights_replaces_every_layer,
    check_quantize_weights_shares_a_tied_head,
    check_int8_quantize_matches_minserve,
    check_int8_dequantize_matches_minserve,
    check_int8_random_rows,
    check_kv_codec_keeps_the_int8_engine_s_tokens,
]


def passes_checks(impl: ModuleType, exercises: str = "10.1 10.2 10.3 10.4 10.5") -> bool:
    """Whether `impl` passes the checks of those exercises (the notebook falls back to the
    solutions until it does)."""
    try:
        for check in (c for c in CHECKS if _EXERCISE_OF[c.__name__] in exercises.split()):
            check(impl)
    except Exception:  # noqa: BLE001  (a stub's NotImplementedError, a wrong answer...)
        return False
    return True


_EXERCISE_OF = {
    check.__name__: exercise
    for exercise, checks in {
        "10.1": CHECKS[:3], "10.2": CHECKS[3:7], "10.3": CHECKS[7:10], "10.4": CHECKS[10:12],
        "10.5": CHECKS[12:],
    }.items()
    for check in checks
}  # fmt: skip

HINTS: dict[str, tuple[str, str, str]] = {
    "10.1": (
        "Q8_0 stores each block of 32 weights as one fp16 scale d and 32 signed bytes: the "
        "scale maps the block's largest magnitude to 127, every weight to round(w / d).",
        "Reshape the rows to [rows, blocks, 32]; per block take absmax / 127 as d and its "
        "inverse (0 where d is 0); round w times the inverse, halves away from zero; put the "
        "two bytes of d in front of the 32 int8 bytes; flatten back to [rows, bytes]. "
        "Dequantizing reads the same layout back and multiplies.",
        "d's bytes: d.to(torch.float16).view(torch.uint8); an int8 tensor's bytes: "
        "q.view(torch.uint8); rounding as gguf: n = |v|, then floor(n) + floor(2 * (n - "
        "floor(n))), with v's sign; reading back: bytes[..., 2:].contiguous().view(torch.int8).",
    ),
    "10.2": (
        "The 4-bit formats map a block onto 16 levels: Q4_1 from its minimum m in steps "
        "d = (max - min) / 15, Q4_0 symmetrically around 8 with d = (signed largest) / -8. "
        "Two levels share a byte: q_j low, q_(j+16) high.",
        "pack: the first 16 levels OR the last 16 shifted left by 4; unpack: low nibbles "
        "(& 0x0F) then high ones (>> 4), side by side. Quantize: per block compute d (and "
        "m), the inverse (0 where d is 0), the levels by truncating after adding 0.5 "
        "(Q4_1) or 8.5 (Q4_0), clamp to 0..15, then bytes: d, (m,) packed levels.",
        "Q4_0's d: w.gather(-1, w.abs().argmax(-1, keepdim=True)) / -8; Q4_1's levels: "
        "((w - m) * inverse + 0.5).trunc().clamp(0, 15); dequantize Q4_1 as q * d + m "
        "with d and m read from bytes 0:2 and 2:4 as fp16.",
    ),
    "10.3": (
        "The product x @ W.T is a sum over the input columns, so the weight can be widened "
        "a slice of columns at a time: each slice of x meets its slice of W, and the "
        "partial products add up. Only one slice of fp32 weights exists at any moment.",
        "Start from zeros [N, out]; walk the blocks of a row `step` at a time; for each "
        "group cut the byte columns of those blocks out of every row, widen them, multiply "
        "with the matching 32-wide columns of x, and accumulate.",
        "Block b's bytes are columns b * bytes_per_block to (b + 1) * bytes_per_block of "
        "`blocks`, and its weights columns b * 32 to (b + 1) * 32 of x; accumulate "
        "x_slice @ widen(bytes_slice, quant).T into the output.",
    ),
    "10.4": (
        "Quantizing a model is quantizing each weight matrix it reads: every linear layer "
        "and the embedding table become blocks, and the layers that read blocks take their "
        "place in the module tree.",
        "Quantize the embedding table first; walk the model's named modules (a list, since "
        "you replace as you go); for an embedding or a linear, build its quantized form and "
        "set it on the parent module under the same attribute name; a head whose weight is "
        "the table reuses the table's blocks. Count what you replaced.",
        "name.rpartition('.') gives the parent's name and the attribute; "
        "model.get_submodule(parent) the parent ('' is the model itself); "
        "QuantizedLinear(blocks, quant, layer.bias), QuantizedEmbedding(blocks, quant, dtype).",
    ),
    "10.5": (
        "An int8 KV row keeps one scale per token and KV head: the row's largest magnitude "
        "maps to 127, every value to round(x / scale). The scale is stored in fp16, so "
        "divide by the fp16 scale you store, not by the exact one.",
        "Per row (the last dim): absmax in fp32, divided by 127, capped at fp16's largest "
        "value, cast to fp16; divide x (in fp32) by that scale widened back (1 where the "
        "scale is 0), round, clamp to [-127, 127], cast to int8. Dequantizing widens both "
        "to fp32 and multiplies.",
        "absmax: x.float().abs().amax(dim=-1, keepdim=True); the fp16 scale: (absmax / "
        "INT8_MAX).clamp(max=torch.finfo(torch.float16).max).to(torch.float16); a divisor "
        "without zeros: torch.where(scale > 0, scale.float(), 1.0); then torch.round of x "
        "in fp32 over it, .clamp(-INT8_MAX, INT8_MAX), .to(torch.int8).",
    ),
}
