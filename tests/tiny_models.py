"""Tiny random-weight checkpoints for tests: Hugging Face folders and GGUF files.

Weights are random (seeded) but scaled up from transformers' default init so logits are
far from uniform and greedy decoding is not decided by float noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

COMMON = dict(
    vocab_size=49152,  # SmolLM2's tokenizer, saved beside each tiny model
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
)

ARCHITECTURES = {
    "llama": dict(model_type="llama", tie_word_embeddings=True, rope_theta=10000.0),
    "llama3_rope": dict(
        model_type="llama",
        tie_word_embeddings=False,
        attention_bias=True,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False, rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True, head_dim=32, rope_theta=1000000.0),
}


def make_hf_model(kind: str, folder: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a tiny random `kind` model (see ARCHITECTURES) with SmolLM2's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    options = dict(COMMON, **ARCHITECTURES[kind])
    model_type = options.pop("model_type")
    config = AutoConfig.for_model(model_type, **options)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


def permute_for_gguf(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (rotate-half -> interleaved RoPE)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    stem, suffix = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        return f"blk.{layer}.{_GGUF_LAYER[part]}.{suffix}"
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[
        stem
    ] + f".{suffix}"


def write_llama_gguf(
    hf_folder: Path, out: Path, qtype: GGMLQuantizationType, tokenizer_gguf: Path | None
) -> Path:
    """Convert a tiny HF Llama folder to GGUF as llama.cpp does; 2-D weights stored as `qtype`.

    The tokenizer's metadata is copied from `tokenizer_gguf`; None writes weights only (a
    file that loads in seconds less: gguf's reader spends them on the 49k tokens and merges)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_folder)
    writer = GGUFWriter(out, "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if tokenizer_gguf is not None:
        _copy_tokenizer_metadata(writer, tokenizer_gguf)
    for name, tensor in load_file(hf_folder / "model.safetensors").items():
        w = tensor.float().numpy()
        if ".q_proj." in name:
            w = permute_for_gguf(w, cfg.num_attention_heads)
        elif ".k_proj." in name:
            w = permute_for_gguf(w, cfg.num_key_value_heads)
        if w.ndim == 2 and qtype != GGMLQuantizationType.F32:
            data = quantize(w.astype(np.float16) if qtype == GGMLQuantizationType.F16 else w, qtype)
            writer.add_tensor(gguf_name(name), data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _copy_tokenizer_metadata(writer: GGUFWriter, source: Path) -> None:
    reader = GGUFReader(source)
    writer.add_tokenizer_model(reader.get_field("tokenizer.ggml.model").contents())
    writer.add_tokenizer_pre(reader.get_field("tokenizer.ggml.pre").contents())
    writer.add_token_list(reader.get_field("tokenizer.ggml.tokens").contents())
    writer.add_token_types(reader.get_field("tokenizer.ggml.token_type").contents())
    writer.add_token_merges(reader.get_field("tokenizer.ggml.merges").contents())
    writer.add_bos_token_id(reader.get_field("tokenizer.ggml.bos_token_id").contents())
    writer.add_eos_token_id(reader.get_field("tokenizer.ggml.eos_token_id").contents())
    writer.add_add_bos_token(False)
    writer.add_chat_template(reader.get_field("tokenizer.chat_template").contents())


def truncate_tokenizer(source: Path, folder: Path, size: int) -> None:
    """Save `source`'s tokenizer cut to its first `size` ids (and the merges among them)."""
    data = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = {token: i for token, i in data["model"]["vocab"].items() if i < size}

    def parts(merge: str | list[str]) -> list[str]:
        return merge.split(" ", 1) if isinstance(merge, str) else list(merge)

    data["model"]["vocab"] = vocab
    data["model"]["merges"] = [
        m
        for m in data["model"]["merges"]
        if all(p in vocab for p in [*parts(m), "".join(parts(m))])
    ]
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < size]
    (folder / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            (folder / name).write_bytes((source / name).read_bytes())


def make_padded_vocab_model(
    folder: Path,
    tokenizer_dir: Path,
    prompts: list[str],
    tokenizer_size: int = 766,
    vocab_size: int = 768,
    seed: int = 0,
) -> Path:
    """A tiny Llama whose embedding has more rows than its tokenizer has ids, as checkpoints
    padded to a round size have. Each padding row is a row greedy decoding of `prompts`
    picks most, scaled up by 2%: where that token won with a positive logit, its padding
    twin now wins, so greedy decoding emits padding ids."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    truncate_tokenizer(tokenizer_dir, folder, tokenizer_size)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    options = dict(COMMON, **ARCHITECTURES["llama"], vocab_size=vocab_size)
    config = AutoConfig.for_model(options.pop("model_type"), **options)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    counts = torch.zeros(vocab_size)
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        counts += torch.bincount(out[0, ids.shape[1] :], minlength=vocab_size)
    favourites = counts[:tokenizer_size].topk(vocab_size - tokenizer_size).indices
    with torch.no_grad():  # tied: the head's rows change with the embedding's
        weight = model.get_input_embeddings().weight
        weight[tokenizer_size:] = 1.02 * weight[favourites]
    model.save_pretrained(folder)
    return folder
