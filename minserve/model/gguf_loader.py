"""Load a GGUF file (llama.cpp's format): metadata -> ModelConfig, tensors -> fp32 weights.

Quantized tensors (Q8_0, Q4_0, Q4_1, ...) are dequantized with the `gguf` package's
reference code; `quantized_blocks` also hands over the Q8_0, Q4_0 and Q4_1 matrices as
stored, for `quantization="gguf"` (`quantized_linear.py`). llama.cpp stores Llama's q/k
projections with their rows permuted for its interleaved RoPE; we undo that so the
weights match Hugging Face's "rotate half" layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from minserve.errors import ModelLoadError
from minserve.model.gguf_file import GGUFFile, GGUFTensor, read_gguf_file
from minserve.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

# GGUF tensor-name stem -> Hugging Face name, per layer ("blk.N.<stem>") or global.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

CPU = torch.device("cpu")


def open_gguf(path: Path) -> GGUFFile:
    """Open a GGUF file, turning a corrupt or truncated file into a clear error."""
    try:
        return read_gguf_file(path)
    except (ValueError, IndexError, OSError, KeyError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (corrupt or truncated?): {e}"
        ) from e


def field_value(reader: GGUFFile, key: str, default: object = None) -> object:
    return reader.field(key, default)


def config_from_gguf(reader: GGUFFile) -> ModelConfig:
    """Translate GGUF metadata ("<arch>.block_count", ...) into a ModelConfig."""
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; minserve supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def meta(key: str, default: object = None) -> object:
        value = field_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata {arch}.{key} is missing")
        return value

    num_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(
            "this GGUF uses per-frequency RoPE factors (rope_freqs, Llama 3.1 style); "
            "load the Hugging Face checkpoint folder instead"
        )
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(field_value(reader, f"{arch}.vocab_size", int(embd.shape[1]))),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length")),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def hf_name(gguf_name: str) -> str:
    """ "blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"."""
    stem, suffix = gguf_name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    elif stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")


def tensor_to_numpy(tensor: GGUFTensor) -> np.ndarray:
    """Dequantize one GGUF tensor to fp32, shaped as PyTorch expects ([out, in] for weights)."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        values = dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise ModelLoadError(f"GGUF tensor {tensor.name} has unsupported type {qtype.name}") from e
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    values = values.reshape(shape).astype(np.float32, copy=False)
    return np.require(values, requirements=["C", "W"])  # memory-mapped F32 is read-only


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE -> rotate-half layout)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def weights_from_gguf(reader: GGUFFile, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors of the file, dequantized and renamed to Hugging Face names."""
    return {hf_name(t.name): read_gguf_tensor(t, config) for t in reader.tensors}


def quantized_blocks(
    reader: GGUFFile,
    config: ModelConfig,
    quants: tuple[str, ...],
    device: torch.device = CPU,
) -> dict[str, tuple[str, torch.Tensor]]:
    """The file's matrices stored in one of `quants`, as they are stored: Hugging Face name ->
    (format, blocks uint8 [rows, row bytes] on `device`, the model's: its embedding indexes
    them with the step's token ids), llama's q/k rows back in HF's layout (a row's blocks
    move with it)."""
    found = {}
    for tensor in reader.tensors:
        qtype = GGMLQuantizationType(tensor.tensor_type)
        if qtype.name not in quants or len(tensor.data.shape) != 2:
            continue
        blocks = np.array(tensor.data, dtype=np.uint8)  # [rows, row bytes], a copy
        rows = torch.from_numpy(_hf_rows(blocks, tensor.name, config))
        found[hf_name(tensor.name)] = (qtype.name, rows.to(device))
    return found


def _hf_rows(rows: np.ndarray, name: str, config: ModelConfig) -> np.ndarray:
    """llama's q/k rows back in HF's layout; any other tensor as it is."""
    if config.architecture == "llama" and ".attn_q." in name:
        return np.ascontiguousarray(unpermute_rope_rows(rows, config.num_heads))
    if config.architecture == "llama" and ".attn_k." in name:
        return np.ascontiguousarray(unpermute_rope_rows(rows, config.num_kv_heads))
    return rows


def read_gguf_tensor(tensor: GGUFTensor, config: ModelConfig) -> torch.Tensor:
    """One tensor of the file, dequantized, with llama's q/k rows back in HF's layout."""
    return torch.from_numpy(_hf_rows(tensor_to_numpy(tensor), tensor.name, config))
