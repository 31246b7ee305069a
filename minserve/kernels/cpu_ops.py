"""The decoder layer's small ops through the C kernels (`layer_ops.c`), where they apply:
fp32 or bfloat16 tensors, each op's inputs of one dtype.

The CPU platform decides at load whether the layers compute with these
(`platforms/cpu/ops.py`, `platforms/cpu/linears.py`); the torch code of `model/` is the
reference they are tested against (`tests/test_cpu_kernels.py`). They take CPU tensors
outside autograd (the kernels have no backward) once the library has been built. A
bfloat16 tensor is read widened to fp32, computed on in fp32 and rounded once on the way
out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minserve.kernels.build import cpu_kernels

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the layer kernels read and write


def applies(*tensors: torch.Tensor) -> bool:
    """True when the C kernels can stand in for torch on these tensors: CPU tensors of one
    dtype, fp32 or bfloat16, outside autograd, with the library built.

    Called several times per layer, so it is kept to cheap attribute reads."""
    grad = torch.is_grad_enabled()
    dtype = tensors[0].dtype
    if dtype not in KERNEL_DTYPES:
        return False
    for t in tensors:
        if not t.is_cpu or t.dtype is not dtype or (grad and t.requires_grad):
            return False
    return cpu_kernels() is not None


def kernel_for(name: str, dtype: torch.dtype) -> Callable[..., None]:
    """The library's `name_f32` or `name_bf16`, for tensors of `dtype`."""
    suffix = "bf16" if dtype is torch.bfloat16 else "f32"
    return getattr(cpu_kernels(), f"{name}_{suffix}")


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x [..., dim] as rows [N, dim] whose elements are contiguous (x itself when 2-D)."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x [..., dim], weight [dim] -> [..., dim]."""
    rows = rows_of(x)  # [N, dim]
    out = torch.empty(rows.shape, dtype=x.dtype)
    n, dim = rows.shape
    kernel_for("rms_norm", x.dtype)(
        out.data_ptr(), rows.data_ptr(), weight.contiguous().data_ptr(),
        n, dim, rows.stride(0), dim, eps,
    )  # fmt: skip
    return out if rows is x else out.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [T, heads, D] (heads contiguous), cos/sin [T, 1, D] -> [T, heads, D]."""
    num_tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    kernel_for("rope", x.dtype)(
        out.data_ptr(), x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        num_tokens, heads, head_dim, x.stride(0),
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: gate_up [..., 2 * inner], gate then up -> silu(gate) * up."""
    rows = rows_of(gate_up)  # [N, 2 * inner]
    n, inner = rows.shape[0], rows.shape[1] // 2
    out = torch.empty((n, inner), dtype=gate_up.dtype)
    kernel = kernel_for("silu_mul", gate_up.dtype)
    kernel(out.data_ptr(), rows.data_ptr(), n, inner, rows.stride(0), inner)
    return out if rows is gate_up else out.view(*gate_up.shape[:-1], inner)


def linear_applies(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when the few-row kernel can stand in for a linear layer: CPU rows and weight of
    one dtype, fp32 or bfloat16, outside autograd, with the C kernels built."""
    dtype = weight.dtype
    if dtype not in KERNEL_DTYPES or rows.dtype is not dtype or not (rows.is_cpu and weight.is_cpu):
        return False
    if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad):
        return False
    return cpu_kernels() is not None


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A few rows through a linear layer: x [N, in] . weight [out, in]^T (+ bias [out]) ->
    [N, out] in x's dtype, the weight streamed once (`linear_rows.c`).

    x, weight, bias and the output are all fp32 or all bfloat16. A bfloat16 weight is read as
    its raw bits and widened in the kernel, x widened once, and the fp32 sums rounded back to
    bfloat16 at the end: the products and sums of torch's bfloat16 linear, in another order."""
    x = x.contiguous()  # [N, in]
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()  # [out]; itself in the usual case
    num_rows, out_features = x.shape[0], weight.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype)
    kernels = cpu_kernels()
    kernel = kernels.linear_rows_bf16 if x.dtype is torch.bfloat16 else kernels.linear_rows_f32
    status = kernel(
        out.data_ptr(), x.data_ptr(), weight.data_ptr(),
        None if bias is None else bias.data_ptr(), num_rows, out_features, weight.shape[1],
    )  # fmt: skip
    if status:  # the bfloat16 kernel's scratch for the widened rows
        raise MemoryError(f"linear_rows could not allocate scratch for {num_rows} rows")
    return out


PANEL = 16  # output columns per packed panel (`bf16_panels.c`)


def panels_native() -> bool:
    """True when the C kernels are built with AVX512-BF16, the instruction that multiplies
    the panels' bfloat16 pairs (`bf16_panels.c`)."""
    kernels = cpu_kernels()
    return kernels is not None and kernels.bf16_panels_native() == 1


def panels_apply(weight: torch.Tensor) -> bool:
    """True when a linear's weight [out, in] can be packed into panels of bfloat16 pairs:
    a bfloat16 CPU weight, out a multiple of 32, in even, and `panels_native()`."""
    out_features, in_features = weight.shape
    if weight.dtype is not torch.bfloat16 or not weight.is_cpu:
        return False
    if out_features % (2 * PANEL) or in_features % 2:
        return False
    return panels_native()


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> [out / 16, in / 2, 16, 2]: panel p holds columns 16p .. 16p + 15,
    and for each pair of inputs (2t, 2t + 1) their 16 columns' weights side by side, the
    64 bytes one vdpbf16ps reads (`bf16_panels.c`)."""
    out_features, in_features = weight.shape
    panels = weight.detach().reshape(out_features // PANEL, PANEL, in_features // 2, 2)
    return panels.permute(0, 2, 1, 3).contiguous()  # [out / 16, in / 2, 16, 2]


def linear_panels(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [N, in] bfloat16 . the packed weight (`pack_panels`) (+ bias [out]) -> [N, out]
    bfloat16: the fp32 sums of the products, each rounded once (`bf16_panels.c`)."""
    x = x.contiguous()  # [N, in]
    num_panels, pairs = packed.shape[:2]
    out_features, in_features = num_panels * PANEL, 2 * pairs
    if x.dtype is not torch.bfloat16 or x.shape[-1] != in_features:
        raise ValueError(
            f"linear_panels takes bfloat16 rows of {in_features} features, "
            f"got {x.dtype} rows of shape {tuple(x.shape)}"
        )
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()  # [out]; itself in the usual case
    out = torch.empty((x.shape[0], out_features), dtype=torch.bfloat16)
    status = cpu_kernels().linear_panels_bf16(
        out.data_ptr(), x.data_ptr(), packed.data_ptr(),
        None if bias is None else bias.data_ptr(), x.shape[0], out_features, in_features,
    )  # fmt: skip
    if status:
        raise RuntimeError("the C kernels were built without AVX512-BF16: no panel kernel")
    return out


def draw_rows(
    logits: torch.Tensor, rows: list[int], temperatures: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """One token per listed row of logits [N, vocab] (fp32, CPU), drawn at temperatures [R]
    with uniforms [R] in [0, 1): the sampler's shift, divide, softmax and inverse-CDF draw
    in two passes over each row (`draw_rows.c`) -> [R] int64."""
    if logits.dtype != torch.float32 or logits.stride(-1) != 1 or not logits.is_cpu:
        raise ValueError(f"draw_rows takes CPU fp32 rows, got {logits.dtype} on {logits.device}")
    index = torch.tensor(rows, dtype=torch.int64)
    temperatures = temperatures.to(torch.float32).contiguous()
    uniforms = uniforms.to(torch.float32).contiguous()
    out = torch.empty(len(rows), dtype=torch.int64)
    cpu_kernels().draw_rows(
        out.data_ptr(), logits.data_ptr(), index.data_ptr(), len(rows), logits.shape[-1],
        logits.stride(0), temperatures.data_ptr(), uniforms.data_ptr(),
    )  # fmt: skip
    return out


def mask_rows(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured output's mask, in place: every token the int32 bitmask [N, words] forbids
    (bit j of word w is token 32 w + j) gets -inf in logits [N, vocab] (fp32, CPU;
    `token_mask.c`). Returns `logits`."""
    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1 or not logits.is_cpu:
        raise ValueError(f"mask_rows takes CPU fp32 rows, got {logits.dtype} on {logits.device}")
    bitmask = bitmask.to(torch.int32).contiguous()
    if bitmask.shape[0] != rows or bitmask.shape[1] * 32 < vocab:
        raise ValueError(
            f"a bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}"
        )
    cpu_kernels().mask_rows(
        logits.data_ptr(), bitmask.data_ptr(), rows, vocab, logits.stride(0), bitmask.shape[1]
    )
    return logits


QUANT_BLOCK = 32  # weights per GGUF block
QUANT_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # the block formats `quant_rows.c` reads


def check_blocks_hold(blocks: torch.Tensor, quant: str, x: torch.Tensor) -> tuple[int, int]:
    """(out, in) features of a layer stored as `quant` blocks uint8 [out, row bytes], checked
    against x [N, in]."""
    out_features, row_bytes = blocks.shape
    in_features = row_bytes // QUANT_BLOCK_BYTES[quant] * QUANT_BLOCK
    if x.shape[-1] != in_features or blocks.dtype != torch.uint8:
        raise ValueError(
            f"{quant} blocks of {tuple(blocks.shape)} ({blocks.dtype}) hold rows of "
            f"{in_features} weights; x has {x.shape[-1]} features"
        )
    return out_features, in_features


def quant_rows(
    x: torch.Tensor, blocks: torch.Tensor, quant: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """A few rows through a GGUF-quantized linear layer, read as stored: x [N, in] fp32 or
    bfloat16, blocks uint8 [out, in / 32 * block bytes] (each weight row's blocks, as in the
    file) -> [N, out] in x's dtype: the sums of the dequantized weights (+ bias [out]), in
    fp32, rounded once (`quant_rows.c`)."""
    out_features, in_features = check_blocks_hold(blocks, quant, x)
    kernel = getattr(cpu_kernels(), f"quant_rows_{quant.lower()}")
    return _rows_through(kernel, x, out_features, blocks.contiguous(), None, bias)


def quant_panels(
    x: torch.Tensor, blocks: torch.Tensor, quant: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Many bfloat16 rows through a GGUF-quantized linear layer: x [N, in] bfloat16 -> [N,
    out] bfloat16, the weights widened to bfloat16 (as `dequantize_blocks(..., bfloat16)`)
    a pair of panels at a time in cache and multiplied there by the panel kernel
    (`quant_rows.c`, `bf16_panels.c`). Needs `panels_native()` and out a multiple of 32."""
    out_features, in_features = check_blocks_hold(blocks, quant, x)
    if x.dtype is not torch.bfloat16 or out_features % (2 * PANEL):
        raise ValueError(
            f"quant_panels takes bfloat16 rows and a multiple of {2 * PANEL} outputs, got "
            f"{x.dtype} rows and {out_features} outputs"
        )
    x = x.contiguous()
    if bias is not None:
        bias = bias.detach().to(torch.bfloat16).contiguous()  # [out]
    out = torch.empty((x.shape[0], out_features), dtype=torch.bfloat16)
    kernel = getattr(cpu_kernels(), f"quant_panels_{quant.lower()}")
    status = kernel(
        out.data_ptr(), x.data_ptr(), blocks.contiguous().data_ptr(),
        None if bias is None else bias.data_ptr(), x.shape[0], out_features, in_features,
    )  # fmt: skip
    if status:
        raise MemoryError(f"quant_panels could not allocate its scratch (status {status})")
    return out


def int8_rows(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """A few rows through a weight-only int8 linear layer, read as stored: x [N, in] fp32 or
    bfloat16, weight int8 [out, in] (in a multiple of 32), scales fp32 [out] -> [N, out] in
    x's dtype: each output channel's int8 sums times its scale (+ bias) (`quant_rows.c`)."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.int8 or in_features % QUANT_BLOCK or x.shape[-1] != in_features:
        raise ValueError(
            f"int8 rows need an int8 weight whose {in_features} columns are a multiple of "
            f"{QUANT_BLOCK} and x with as many features; got {weight.dtype}, x {tuple(x.shape)}"
        )
    scales = scales.to(torch.float32).contiguous()
    kernel = cpu_kernels().int8_rows
    return _rows_through(kernel, x, out_features, weight.contiguous(), scales, bias)


def _rows_through(
    kernel: Callable[..., int], x: torch.Tensor, out_features: int, weight: torch.Tensor,
    scales: torch.Tensor | None, bias: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """Call a `quant_rows.c` entry point on x [N, in] (fp32, or bfloat16 as it is) -> [N, out]
    in x's dtype."""
    if x.dtype not in KERNEL_DTYPES:
        x = x.float()
    x = x.contiguous()
    bias32 = None if bias is None else bias.detach().to(torch.float32).contiguous()
    out = torch.empty((x.shape[0], out_features), dtype=x.dtype)
    args = [out.data_ptr(), x.data_ptr(), weight.data_ptr()]
    args += [] if scales is None else [scales.data_ptr()]
    args += [None if bias32 is None else bias32.data_ptr()]
    status = kernel(*args, x.shape[0], out_features, x.shape[1], int(x.dtype == torch.bfloat16))
    if status:
        raise MemoryError(f"the quantized rows kernel could not widen {x.shape[0]} rows")
    return out


def dequantize_blocks(
    blocks: torch.Tensor, quant: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """GGUF blocks uint8 [rows, row bytes] -> their weights [rows, in] in `dtype` (fp32, or
    bfloat16: the fp32 weights rounded to nearest), widened by the C kernel (`quant_rows.c`)
    with the arithmetic of the `gguf` package's dequantize."""
    rows, row_bytes = blocks.shape
    in_features = row_bytes // QUANT_BLOCK_BYTES[quant] * QUANT_BLOCK
    out = torch.empty((rows, in_features), dtype=dtype)
    suffix = {torch.float32: "", torch.bfloat16: "_bf16"}[dtype]
    kernel = getattr(cpu_kernels(), f"dequantize_{quant.lower()}{suffix}")
    kernel(out.data_ptr(), blocks.contiguous().data_ptr(), rows, in_features)
    return out


def bf16_logits(bits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [B, hidden] fp32 against a bfloat16 head (its raw bits, int16 [vocab, hidden]) ->
    fp32 logits [B, vocab], summed in fp32 (`bf16_head.c`)."""
    x = x.contiguous()
    vocab, hidden = bits.shape
    out = torch.empty((x.shape[0], vocab), dtype=torch.float32)
    cpu_kernels().bf16_logits_f32(
        out.data_ptr(), bits.data_ptr(), x.data_ptr(), vocab, hidden, x.shape[0]
    )
    return out


def screen_candidates(
    logits: torch.Tensor, slack: torch.Tensor, x_norm: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Screened logits [B, vocab], per-token slack [vocab], |x| [B] -> each row's top
    candidate [B] and number of candidates [B] (int64), and which tokens are candidates
    [B, vocab] (bool) (`bf16_head.c`)."""
    batch, vocab = logits.shape
    best = torch.empty(batch, dtype=torch.int64)
    count = torch.empty(batch, dtype=torch.int64)
    is_candidate = torch.empty((batch, vocab), dtype=torch.bool)  # one byte each, as in C
    cpu_kernels().screen_candidates_f32(
        best.data_ptr(), count.data_ptr(), is_candidate.data_ptr(), logits.data_ptr(),
        slack.data_ptr(), x_norm.contiguous().data_ptr(), vocab, batch,
    )  # fmt: skip
    return best, count, is_candidate
