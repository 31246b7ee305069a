"""A Llama-family decoder (Llama, Qwen2, Qwen3) in plain torch, readable top to bottom.

The forward pass takes a *flat* batch: the tokens of every sequence in this step laid end
to end, each with its own position. Attention is the only place sequences interact, so it
is delegated to an `AttentionFn` built per step by whoever owns the KV cache (the
contiguous reference path here, the paged engine later). Parameter names follow Hugging
Face's, so checkpoints load by name. The math of RMSNorm, RoPE and SwiGLU is in `ops.py`,
called through the model's `ModelOps` (`CausalLM.use_ops`): minserve's torch functions, a
platform's kernels (`minserve/platforms/`) or a student's, values of one kind. The model
never asks which device it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from minserve.model.ops import MODEL_OPS, ModelOps
from minserve.model.rope import rope_inverse_frequencies
from minserve.model_config import ModelConfig


class AttentionFn(Protocol):
    """Attention over the KV cache for one step: stores the new k/v, returns the output."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] (already rotated) -> [T, Hq, D]."""
        ...


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (no mean subtraction, no bias), computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, "rotate half" layout (Hugging Face's).

    cos/sin are computed once per step from that step's positions (no 128k-row table for a
    128k-token model) and shared by every layer's q and k.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, ops: ModelOps) -> Rotation:
        """positions [T] -> the step's rotation: cos and sin [T, 1, head_dim] each."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim / 2]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # [T, 1, head_dim]
        return Rotation(angles.cos().to(dtype), angles.sin().to(dtype), ops)


@dataclass(frozen=True)
class Rotation:
    """One step's RoPE factors, broadcast over heads."""

    cos: torch.Tensor  # [T, 1, head_dim]
    sin: torch.Tensor  # [T, 1, head_dim]
    ops: ModelOps = MODEL_OPS  # the model's ops: whose `apply_rope` rotates

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] -> x rotated by each token's position."""
        return self.ops.apply_rope(x, self.cos, self.sin)


class SelfAttention(nn.Module):
    """Grouped-query self-attention: project, (Qwen3: norm q/k), rotate, attend, project."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, config.q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, config.kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, config.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, hidden, bias=config.o_bias)
        self.qkv_proj: nn.Linear | None = None  # q, k, v in one (`fused_projections.py`)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rotation: Rotation, attention: AttentionFn, layer: int
    ) -> torch.Tensor:
        q, k, v = self.rotated_qkv(x, rotation)
        out = attention(layer, q, k, v)  # [T, Hq, D]
        return self.o_proj(out.reshape(x.shape[0], self.config.q_size))

    def rotated_qkv(
        self, x: torch.Tensor, rotation: Rotation
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, Hq, D], k and v [T, Hkv, D]; q, k rotated (Qwen3: normed 1st)."""
        cfg = self.config
        num_tokens = x.shape[0]
        if self.qkv_proj is not None and not cfg.qk_norm:
            # q's heads and k's sit side by side in the fused output: rotate them in one pass
            qk, v = self.qkv_proj(x).split((cfg.q_size + cfg.kv_size, cfg.kv_size), dim=-1)
            qk = rotation.apply(qk.view(num_tokens, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim))
            q, k = qk.split((cfg.num_heads, cfg.num_kv_heads), dim=1)  # [T, Hq, D], [T, Hkv, D]
            return q, k, v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        q, k, v = self.project(x)
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        if cfg.qk_norm:
            q, k = self.q_norm(q, rotation.ops), self.k_norm(k, rotation.ops)
        return rotation.apply(q), rotation.apply(k), v

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, q_size], k and v [T, kv_size]: three linears, or one fused."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        cfg = self.config
        q, k, v = self.qkv_proj(x).split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        return q, k, v


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.gate_up_proj: nn.Linear | None = None  # gate and up in one (`fused_projections.py`)

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:  # [T, 2 * inner]: gate, then up, side by side
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(ops.swiglu(gate, up))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, rotation: Rotation, attention: AttentionFn, layer: int
    ) -> torch.Tensor:
        ops = rotation.ops
        x = x + self.self_attn(self.input_layernorm(x, ops), rotation, attention, layer)
        return x + self.mlp(self.post_attention_layernorm(x, ops), ops)


class DecoderBody(nn.Module):
    """Embedding, the stack of decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole decoder: token ids and positions in, hidden states out, logits on demand."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        self.rope = RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.ops: ModelOps = MODEL_OPS  # what the layers compute with (`use_ops`)
        # bumped whenever what the layers compute with changes (their ops, a quantized
        # layer's codec): whatever caches a view of the layers keys on it
        self.revision = 0

    def use_ops(self, ops: ModelOps) -> None:
        """Compute RMSNorm, RoPE (its frequencies too) and SwiGLU with `ops` in every layer."""
        self.ops = ops
        self.revision += 1
        inv_freq = ops.rope_inverse_frequencies(self.config)  # [head_dim / 2]
        self.rope.inv_freq = inv_freq.to(self.rope.inv_freq.device, torch.float32)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] (a flat batch) -> final hidden states [T, hidden].

        `num_layers` stops after the first layers, then applies the final norm: the draft
        of early-exit self-speculation (LayerSkip) reads the same head from there."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        rotation = self.rope(positions, x.dtype, self.ops)
        for i, layer in enumerate(self.model.layers[:num_layers]):
            x = layer(x, rotation, attention, i)
        return self.final_norm(x)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's output [T, hidden] -> the head's input [T, hidden]."""
        return self.model.norm(hidden, self.ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> fp32 logits [N, vocab] (only for tokens we sample from)."""
        return self.lm_head(hidden).float()
