"""Chapter 10's pictures and measurements: the roofline of a decode step, number formats
bit by bit, GGUF's blocks byte by byte, and what a format costs a model's next token.

A decode step at batch B does 2 * B FLOPs per weight and reads the weight once, so its
arithmetic intensity is 2 * B / (bytes per weight): at batch 1 far left of the ridge
where a CPU's (or a GPU's) bandwidth stops being the limit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from matplotlib.figure import Figure
from torch import nn

from minserve.model.quant_blocks import QuantCodec
from minserve.model_config import ModelConfig
from minserve.viz.naive import generate_with_cache, next_token_logits

# (name, sign, exponent, mantissa bits) of the floating-point formats drawn
FLOAT_FORMATS = (
    ("fp32", 1, 8, 23),
    ("bf16", 1, 8, 7),
    ("fp16", 1, 5, 10),
    ("fp8 e4m3", 1, 4, 3),
    ("fp8 e5m2", 1, 5, 2),
)
# (name, [(field, bytes)]) of GGUF's blocks of 32 weights
BLOCK_LAYOUTS = (
    ("Q8_0", [("d", 2), ("q_0 .. q_31, int8", 32)]),
    ("Q4_0", [("d", 2), ("byte j: q_j | q_(j+16) << 4", 16)]),
    ("Q4_1", [("d", 2), ("m", 2), ("byte j: q_j | q_(j+16) << 4", 16)]),
)
_FIELD_COLOURS = {"sign": "tab:red", "exponent": "tab:blue", "mantissa": "tab:green"}


def decode_intensity(batch: int, bytes_per_weight: float) -> float:
    """FLOPs per byte of a batch-`batch` decode step: 2 * batch per weight read once."""
    return 2 * batch / bytes_per_weight


def plot_roofline(
    bandwidth: float, ceilings: Mapping[str, float], points: Mapping[str, tuple[float, float]]
) -> Figure:
    """Attainable FLOP/s against FLOPs per byte: the bandwidth slope, one flat ceiling per
    measured matmul dtype, and measured points (name -> (intensity, FLOP/s))."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    xs = torch.logspace(-1, 3, 200)
    top = max(ceilings.values())
    roof = torch.clamp(xs * bandwidth, max=top)  # [200] attainable FLOP/s
    ax.loglog(xs, roof, color="black", label="bandwidth x intensity")
    for (name, flops), style in zip(ceilings.items(), ("-", "--", ":")):
        ax.axhline(flops, color="grey", linestyle=style, linewidth=1, label=f"{name} matmul")
    for name, (intensity, flops) in points.items():
        ax.scatter([intensity], [flops], zorder=3)
        ax.annotate(name, (intensity, flops), textcoords="offset points", xytext=(5, -12))
    ax.set_xlabel("arithmetic intensity (FLOPs per byte of weights read)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(f"Roofline of this machine: {bandwidth / 1e9:.1f} GB/s, decode points measured")
    ax.legend(loc="lower right", fontsize=8)
    return fig


def plot_formats() -> Figure:
    """Left: the bit layouts of fp32, bf16, fp16 and the two fp8s; right: GGUF's blocks."""
    fig = Figure(figsize=(12, 3.6), layout="constrained")
    bits_ax, blocks_ax = fig.subplots(1, 2, width_ratios=(1.1, 1))
    for row, (_, *widths) in enumerate(FLOAT_FORMATS):
        start = 0
        for field, width in zip(_FIELD_COLOURS, widths):
            bits_ax.barh(row, width, left=start, color=_FIELD_COLOURS[field], edgecolor="white")
            if width >= 2:
                bits_ax.text(start + width / 2, row, str(width), ha="center", va="center")
            start += width
    bits_ax.set_yticks(range(len(FLOAT_FORMATS)), [f[0] for f in FLOAT_FORMATS])
    bits_ax.invert_yaxis()
    bits_ax.set_xlabel("bits (red: sign, blue: exponent, green: mantissa)")
    bits_ax.set_title("Floats: the exponent sets the range, the mantissa the precision")
    for row, (_, fields) in enumerate(BLOCK_LAYOUTS):
        start = 0
        for i, (field, size) in enumerate(fields):
            colour = "tab:orange" if i < len(fields) - 1 else "tab:purple"
            blocks_ax.barh(row, size, left=start, color=colour, edgecolor="white")
            blocks_ax.text(start + size / 2, row, field, ha="center", va="center", fontsize=7)
            start += size
        blocks_ax.text(
            start + 0.5, row, f"{start} B = {start * 8 / 32:.2f} bits/weight", va="center"
        )
    blocks_ax.set_yticks(range(len(BLOCK_LAYOUTS)), [b[0] for b in BLOCK_LAYOUTS])
    blocks_ax.invert_yaxis()
    blocks_ax.set_xlim(0, 50)
    blocks_ax.set_xlabel("bytes of one block of 32 weights (orange: fp16 scale d, offset m)")
    blocks_ax.set_title("GGUF blocks: fp16 scales, small integers")
    return fig


@dataclass(frozen=True)
class QuantEffect:
    """What quantizing every weight of a model to one format changed, against fp32."""

    quant: str
    weight_rms_error: float  # relative, over all weights
    max_logit_change: float  # next-token logits of the prompt, largest |difference|
    kl_divergence: float  # KL(fp32 next-token distribution || quantized one), nats
    same_top_token: bool
    greedy_agreement: (
        float  # share of the greedy continuation equal to fp32's, up to the first difference
    )


def _matrices(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight matrix a decode step reads (the tied table once)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            found.setdefault(module.weight.data_ptr(), (name, module.weight))
    return dict(found.values())


@contextmanager
def quantized_weights(model: nn.Module, quant: str, codec: QuantCodec) -> Iterator[float]:
    """Inside, every weight matrix of `model` (a plain fp32 one) is dequantize(quantize(w)):
    the same model computing with `quant`'s weights; yields the relative RMS error."""
    saved = {name: w.detach().clone() for name, w in _matrices(model).items()}
    error = total = 0.0
    with torch.no_grad():
        for weight in _matrices(model).values():
            widened = codec.dequantize(codec.quantize(weight.float(), quant), quant)
            error += (widened - weight).pow(2).sum().item()
            total += weight.pow(2).sum().item()
            weight.copy_(widened)
    try:
        yield (error / total) ** 0.5
    finally:
        with torch.no_grad():
            for name, weight in _matrices(model).items():
                weight.copy_(saved[name])


@dataclass(frozen=True)
class Baseline:
    """The fp32 model's next-token logits [vocab] and greedy continuation of a prompt."""

    prompt_ids: list[int]
    logits: torch.Tensor
    greedy: list[int]

    @classmethod
    def of(cls, model: nn.Module, prompt_ids: list[int], new_tokens: int) -> Baseline:
        greedy = generate_with_cache(model, prompt_ids, new_tokens).token_ids
        return cls(prompt_ids, next_token_logits(model, prompt_ids), greedy)


def quantization_effect(
    model: nn.Module, baseline: Baseline, quant: str, codec: QuantCodec
) -> QuantEffect:
    """Quantize `model`'s weights to `quant` with `codec`, compare its next-token logits
    and greedy continuation with the fp32 `baseline`'s, then restore the weights."""
    with quantized_weights(model, quant, codec) as rms:
        logits = next_token_logits(model, baseline.prompt_ids)  # [vocab]
        tokens = generate_with_cache(model, baseline.prompt_ids, len(baseline.greedy)).token_ids
    reference = baseline.logits
    kl = torch.nn.functional.kl_div(
        logits.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="sum"
    )
    pairs = zip(baseline.greedy, tokens)
    agree = next((i for i, (a, b) in enumerate(pairs) if a != b), len(baseline.greedy))
    return QuantEffect(
        quant, rms, (logits - reference).abs().max().item(), kl.item(),
        bool(logits.argmax() == reference.argmax()), agree / len(baseline.greedy),
    )  # fmt: skip


def kv_bytes_per_token(config: ModelConfig, bytes_per_value: float) -> float:
    """Bytes one token's keys and values take in every layer: 2 x layers x KV heads x
    head_dim values."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * bytes_per_value
