"""Load a Hugging Face checkpoint folder: config.json, safetensors (single or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from minserve.errors import ModelLoadError
from minserve.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); the file may be corrupt") from e


def config_from_hf(folder: Path) -> ModelConfig:
    """Translate config.json (+ generation_config.json for EOS ids) into a ModelConfig."""
    raw = read_json(folder / "config.json")
    arch = _architecture(raw)
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"],
        num_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        head_dim=head_dim,
        rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        max_position_embeddings=raw["max_position_embeddings"],
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or attention_bias,
        o_bias=arch == "llama" and attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=arch == "qwen3",
        rope_scaling=_rope_scaling(rope),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(folder, raw),
    )


def _architecture(raw: dict) -> str:
    for name in raw.get("architectures") or []:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    model_type = raw.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES:
        return model_type
    found = raw.get("architectures") or model_type
    raise ModelLoadError(
        f"unsupported architecture {found!r}; minserve supports "
        f"{', '.join(_ARCHITECTURES)} (model_type {', '.join(SUPPORTED_ARCHITECTURES)})"
    )


def _rope_scaling(rope: dict) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelLoadError(f"unsupported rope scaling {kind!r}; minserve supports 'llama3'")
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def _eos_ids(folder: Path, raw: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (chat models list several)."""
    gen_path = folder / "generation_config.json"
    eos = read_json(gen_path).get("eos_token_id") if gen_path.exists() else None
    if eos is None:
        eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def weights_from_hf(folder: Path) -> dict[str, torch.Tensor]:
    """Read model.safetensors, or every shard named by model.safetensors.index.json."""
    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        weights.update(_load_safetensors(path))
    return weights


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files: model.safetensors, or the shards its index names."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(read_json(index)["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ModelLoadError(
            f"no weights in {folder}: expected model.safetensors or "
            "model.safetensors.index.json (minserve reads safetensors only)"
        )
    missing = [name for name in files if not (folder / name).exists()]
    if missing:
        shard = folder / missing[0]
        raise ModelLoadError(f"weight shard {shard} is listed in the index but missing")
    return [folder / name for name in files]


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{path} is corrupt or truncated: {e}") from e
