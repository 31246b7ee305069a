"""Hugging Face folders: config translation and sharded safetensors."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from minserve.loader import load_model
from minserve.model.hf_loader import config_from_hf, weights_from_hf


def test_sharded_checkpoint_loads_the_same_weights(tiny_model, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    source = tiny_model("qwen2")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(source).save_pretrained(sharded, max_shard_size="1MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").exists()
    assert not (sharded / "model.safetensors").exists()
    single, shards = weights_from_hf(source), weights_from_hf(sharded)
    assert single.keys() == shards.keys()
    for name in single:
        assert torch.equal(single[name], shards[name]), name
    assert load_model(sharded).config == load_model(source).config


def test_config_translation_per_architecture(tiny_model) -> None:
    llama, qwen2, qwen3 = (config_from_hf(tiny_model(k)) for k in ("llama", "qwen2", "qwen3"))
    assert (llama.architecture, llama.qkv_bias, llama.qk_norm, llama.tie_word_embeddings) == (
        "llama",
        False,
        False,
        True,
    )
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.tie_word_embeddings) == (True, False, False)
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.q_size) == (True, 32, 128)  # head_dim != 64 / 4
    assert llama.num_kv_heads == 2 and llama.num_heads == 4  # grouped-query attention
    assert llama.eos_token_ids == (2,)
    biased = config_from_hf(tiny_model("llama3_rope"))
    assert biased.qkv_bias and biased.o_bias  # Llama's attention_bias covers o_proj too
