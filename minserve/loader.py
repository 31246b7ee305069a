"""One entry point for every checkpoint: a GGUF file, a Hugging Face folder, or the default."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from minserve.device import use_device
from minserve.errors import ModelLoadError
from minserve.execution import ExecutionConfig, resolve_execution
from minserve.model.default_model import default_model_path
from minserve.model.fused_projections import fuse_projections
from minserve.model.gguf_loader import (
    config_from_gguf,
    open_gguf,
    quantized_blocks,
    weights_from_gguf,
)
from minserve.model.hf_loader import config_from_hf, weights_from_hf
from minserve.model.int8_linear import use_int8_weights
from minserve.model.llama import CausalLM, RotaryEmbedding
from minserve.model.quantized_linear import QUANTS, use_quantized_blocks, weight_bytes
from minserve.model.tokenizer import Tokenizer
from minserve.model_config import ModelConfig
from minserve.platforms import Platform, set_up_platform


@dataclass(frozen=True)
class LoadedModel:
    """A ready model with its tokenizer, where it came from and how it runs."""

    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    execution: ExecutionConfig
    platform: Platform  # its ops and runner, chosen at load (`minserve/platforms/`)

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
    CPU, reorder the linear weights once (`platforms/cpu/packed_linear.py`); `quantization`:
    None dequantizes a GGUF file's matrices at load, "gguf" keeps its Q8_0, Q4_0 and Q4_1
    ones as stored (`quantized_linear.py`), "int8" stores every weight matrix of any
    checkpoint as int8 with a scale per output channel (`int8_linear.py`). How it runs is
    resolved here, once (`minserve/execution.py`), the device's platform sets the model up
    (`minserve/platforms/`), and both are kept on the `LoadedModel`."""
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
            found = quantized_blocks(reader, config, QUANTS, execution.device)
    net = build_model(config, weights, execution.dtype, execution.device, fuse, found)
    del weights  # the dequantized copies of the quantized matrices go with it
    if quantization == "int8":
        layers = use_int8_weights(net, config.tie_word_embeddings, execution.dtype)
    execution, platform = set_up_platform(net, execution)
    if quantization == "gguf":
        execution = replace(execution, quantization=quantized_summary(found, net))
    if quantization == "int8":
        summary = f"int8(per channel: {layers} layers; weights {weight_bytes(net) / 2**20:.1f} MiB)"
        execution = replace(execution, quantization=summary)
    tokenizer = tokenizer.for_model(config.vocab_size)
    return LoadedModel(path, config, net, tokenizer, execution, platform)


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


def _check_names(expected: set[str], found: set[str]) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    if unexpected:
        raise ModelLoadError(
            f"checkpoint has {len(unexpected)} tensors this architecture does not use, "
            f"e.g. {unexpected[:3]}"
        )
