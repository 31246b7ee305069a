"""One entry point for every checkpoint: a GGUF file, a Hugging Face folder, or the default."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from minserve.device import use_device
from minserve.errors import ModelLoadError
from minserve.execution import ExecutionConfig, resolve_execution
from minserve.model.default_model import default_model_path
from minserve.model.fused_decode import FusedDecode
from minserve.model.fused_projections import fuse_projections
from minserve.model.gguf_loader import (
    config_from_gguf,
    open_gguf,
    quantized_blocks,
    weights_from_gguf,
)
from minserve.model.greedy_head import attach_greedy_screen
from minserve.model.hf_loader import config_from_hf, weights_from_hf
from minserve.model.int8_linear import use_int8_weights
from minserve.model.linear_choice import Shape, tune_kernel_rows
from minserve.model.llama import CausalLM, RotaryEmbedding
from minserve.model.packed_linear import PackedLinear, prepack_linears
from minserve.model.quantized_linear import QUANTS, use_quantized_blocks, weight_bytes
from minserve.model.tokenizer import Tokenizer
from minserve.model_config import ModelConfig


@dataclass(frozen=True)
class LoadedModel:
    """A ready model with its tokenizer, where it came from and how it runs."""

    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    execution: ExecutionConfig

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The checkpoint's EOS ids, falling back to the tokenizer's own."""
        if self.config.eos_token_ids:
            return self.config.eos_token_ids
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (eos,)


def load_model(
    model: str | Path | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    prepack: bool = True,
    fuse: bool = True,
    quantization: str | None = None,
) -> LoadedModel:
    """Load a GGUF file or a Hugging Face checkpoint folder (None: the bundled SmolLM2).

    `fuse`: q/k/v and gate/up as one linear each (`fused_projections.py`); `prepack`: on a
    CPU, reorder the linear weights once for oneDNN (`packed_linear.py`); `quantization`:
    None dequantizes a GGUF file's matrices at load, "gguf" keeps its Q8_0, Q4_0 and Q4_1
    ones as stored (`quantized_linear.py`), "int8" stores every weight matrix of any
    checkpoint as int8 with a scale per output channel (`int8_linear.py`). How it runs is
    resolved here, once (`minserve/execution.py`), and kept as `LoadedModel.execution`."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {path} does not exist; pass a .gguf file or a Hugging Face "
            "checkpoint folder (config.json + safetensors + tokenizer.json)"
        )
    check_quantization(quantization, path)
    execution = resolve_execution(device, dtype, prepack=prepack)
    found: dict[str, tuple[str, torch.Tensor]] = {}
    use_device(execution.device)  # kernels launch on the current device: make it this one
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
        config = config_from_hf(path)
        weights = weights_from_hf(path)
        tokenizer = Tokenizer.from_pretrained_dir(path)
    else:
        reader = open_gguf(path)
        config = config_from_gguf(reader)
        weights = weights_from_gguf(reader, config)
        tokenizer = Tokenizer.from_gguf(path)
        if quantization == "gguf":
            found = quantized_blocks(reader, config, QUANTS)
    net = build_model(config, weights, execution.dtype, execution.device, fuse, found)
    del weights  # the dequantized copies of the quantized matrices go with it
    if quantization == "int8":
        layers = use_int8_weights(net, config.tie_word_embeddings, execution.dtype)
    execution = set_up_execution(net, execution)
    if quantization == "gguf":
        execution = replace(execution, quantization=quantized_summary(found, net))
    if quantization == "int8":
        summary = f"int8(per channel: {layers} layers; weights {weight_bytes(net) / 2**20:.1f} MiB)"
        execution = replace(execution, quantization=summary)
    return LoadedModel(path, config, net, tokenizer.for_model(config.vocab_size), execution)


QUANTIZATIONS = (None, "gguf", "int8")


def check_quantization(quantization: str | None, path: Path) -> None:
    """None, "gguf" for a GGUF file, or "int8" for any checkpoint (vLLM's names)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose None, 'gguf' or 'int8'")
    if quantization == "gguf" and path.is_dir():
        raise ValueError(f'quantization="gguf" serves a .gguf file as stored; {path} is a folder')


def quantized_summary(found: dict[str, tuple[str, torch.Tensor]], net: CausalLM) -> str:
    """What the start-up line says: "gguf(Q4_1:210,Q8_0:1; weights 97.1 MiB)"."""
    counts: dict[str, int] = {}
    for quant, _ in found.values():
        counts[quant] = counts.get(quant, 0) + 1
    kinds = ",".join(f"{q}:{n}" for q, n in sorted(counts.items())) or "none kept"
    return f"gguf({kinds}; weights {weight_bytes(net) / 2**20:.1f} MiB)"


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    fuse: bool = False,
    quantized: dict[str, tuple[str, torch.Tensor]] | None = None,
) -> CausalLM:
    """Create the decoder without initialising it, then adopt the checkpoint's tensors;
    the matrices in `quantized` (HF name -> (format, blocks)) are served as stored."""
    with torch.device("meta"):
        net = CausalLM(config)
    expected = set(net.state_dict())
    if config.tie_word_embeddings:
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        expected.discard("lm_head.weight")
    _check_names(expected, set(weights))
    weights = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
    net.load_state_dict(weights, strict=False, assign=True)
    net.rope = RotaryEmbedding(config).to(device)  # computed, not loaded
    if config.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    if quantized:
        use_quantized_blocks(net, quantized, config.tie_word_embeddings, dtype)
    if fuse:
        fuse_projections(net)
    return net.eval()


def set_up_execution(net: CausalLM, execution: ExecutionConfig) -> ExecutionConfig:
    """Give `net` the paths `execution` chose; return it with what was measured and set."""
    net.use_c_kernels(execution.c_kernels)
    if not execution.prepack:
        return execution
    prepack_linears(net, panels=execution.c_kernels)
    # oneDNN or the few-row C kernel for a decode's rows, per layer shape, on this CPU
    # (layers packed in panels take their own kernel at every row count)
    rows = tune_kernel_rows(net, execution.linear_rows)
    if execution.greedy_screen:
        attach_greedy_screen(net)  # greedy rows read the head in bfloat16, exactly
    if execution.c_kernels and FusedDecode.fits(net.config, net.model.layers):
        net.fused_decode = FusedDecode(net.config, net.model.layers)
    return replace(
        execution,
        fused_decode=net.fused_decode is not None,
        rows_by_shape=tuple((shape_name(shape), n) for shape, n in rows.items()),
        packed_as=packed_as(net),
        greedy_screen=net.greedy_screen is not None,
    )


def packed_as(net: CausalLM) -> str:
    """How the loader packed the linears: "panels", "oneDNN" or "panels+oneDNN"."""
    kinds = {m.panels for m in net.modules() if isinstance(m, PackedLinear)}
    return "+".join(name for on, name in ((True, "panels"), (False, "oneDNN")) if on in kinds)


def shape_name(shape: Shape) -> str:
    """A linear's shape as the execution summary shows it: "576x1536", "+bias" if any."""
    in_features, out_features, _, bias = shape
    return f"{in_features}x{out_features}" + ("+bias" if bias else "")


def _check_names(expected: set[str], found: set[str]) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    if unexpected:
        raise ModelLoadError(
            f"checkpoint has {len(unexpected)} tensors this architecture does not use, "
            f"e.g. {unexpected[:3]}"
        )
