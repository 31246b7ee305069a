"""One entry point for every checkpoint: a GGUF file, a Hugging Face folder, or the default."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from minserve.errors import ModelLoadError
from minserve.model.config import ModelConfig
from minserve.model.default_model import default_model_path
from minserve.model.fused_projections import fuse_projections
from minserve.model.gguf_loader import config_from_gguf, open_gguf, weights_from_gguf
from minserve.model.greedy_head import attach_greedy_screen
from minserve.model.hf_loader import config_from_hf, weights_from_hf
from minserve.model.linear_choice import tune_kernel_rows
from minserve.model.llama import CausalLM, RotaryEmbedding
from minserve.model.packed_linear import can_prepack, prepack_linears
from minserve.model.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    """A ready model with its tokenizer and where it came from."""

    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The checkpoint's EOS ids, falling back to the tokenizer's own."""
        if self.config.eos_token_ids:
            return self.config.eos_token_ids
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (eos,)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """ "auto" is fp32 on CPU (exact, and CPUs are slow at bf16) and bf16 on GPUs."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_model(
    model: str | Path | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    prepack: bool = True,
    fuse: bool = True,
) -> LoadedModel:
    """Load a GGUF file or a Hugging Face checkpoint folder (None: the bundled SmolLM2).

    `fuse`: q/k/v and gate/up as one linear each (`fused_projections.py`); `prepack`: on a
    CPU, reorder the linear weights once for oneDNN (`packed_linear.py`)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {path} does not exist; pass a .gguf file or a Hugging Face "
            "checkpoint folder (config.json + safetensors + tokenizer.json)"
        )
    target = resolve_device(device)
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
    net = build_model(config, weights, resolve_dtype(dtype, target), target, prepack, fuse)
    return LoadedModel(path=path, config=config, model=net, tokenizer=tokenizer)


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    prepack: bool = False,
    fuse: bool = False,
) -> CausalLM:
    """Create the decoder without initialising it, then adopt the checkpoint's tensors."""
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
    if fuse:
        fuse_projections(net)
    if prepack and can_prepack(device, dtype):
        prepack_linears(net)
        tune_kernel_rows(net)  # oneDNN or the few-row C kernel for a decode, on this CPU
        attach_greedy_screen(net)  # greedy rows read the head in bfloat16, exactly
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
