"""A Llama-family decoder (Llama, Qwen2, Qwen3) in plain torch, readable top to bottom.

The forward pass takes a *flat* batch: the tokens of every sequence in this step laid end
to end, each with its own position. Attention is the only place sequences interact, so it
is delegated to an `AttentionFn` built per step by whoever owns the KV cache (the
contiguous reference path here, the paged engine later). Parameter names follow Hugging
Face's, so checkpoints load by name. The math of RMSNorm, RoPE and SwiGLU is in `ops.py`,
called through the model's `ModelOps` (`CausalLM.use_ops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minserve.kernels import cpu_ops
from minserve.model.fused_decode import FusedDecode
from minserve.model.greedy_head import GreedyScreen, screens
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
        self.c_kernels = True  # the execution config's switch (`CausalLM.use_c_kernels`)
        self.ops: ModelOps = MODEL_OPS  # `CausalLM.use_ops`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is MODEL_OPS and self.c_kernels and cpu_ops.applies(x, self.weight):
            return cpu_ops.rms_norm(x, self.weight, self.eps)  # fp32 on a CPU: one C call
        if self.ops is MODEL_OPS and x.dtype == torch.float32:  # the same math, one call
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.ops.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, "rotate half" layout (Hugging Face's).

    cos/sin are computed once per step from that step's positions (no 128k-row table for a
    128k-token model) and shared by every layer's q and k.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.c_kernels = True  # the execution config's switch (`CausalLM.use_c_kernels`)
        self.ops: ModelOps = MODEL_OPS  # `CausalLM.use_ops`

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """positions [T] -> the step's rotation: cos and sin [T, 1, head_dim] each."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim / 2]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # [T, 1, head_dim]
        return Rotation(angles.cos().to(dtype), angles.sin().to(dtype), self.c_kernels, self.ops)


@dataclass(frozen=True)
class Rotation:
    """One step's RoPE factors, broadcast over heads."""

    cos: torch.Tensor  # [T, 1, head_dim]
    sin: torch.Tensor  # [T, 1, head_dim]
    c_kernels: bool = True  # RotaryEmbedding's switch: RoPE in C where it applies
    ops: ModelOps = MODEL_OPS

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] -> x rotated by each token's position."""
        if self.ops is MODEL_OPS and self.c_kernels and cpu_ops.applies(x, self.cos):
            return cpu_ops.rope(x, self.cos, self.sin)  # fp32 on a CPU: one C call
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
            q, k = self.q_norm(q), self.k_norm(k)
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
        self.c_kernels = True  # the execution config's switch (`CausalLM.use_c_kernels`)
        self.ops: ModelOps = MODEL_OPS  # `CausalLM.use_ops`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate_up = self.gate_up_proj(x)  # [T, 2 * inner]: gate, then up
            if self.ops is MODEL_OPS and self.c_kernels and cpu_ops.applies(gate_up):
                return self.down_proj(cpu_ops.silu_mul(gate_up))  # fp32 on a CPU: one C call
            gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.ops.swiglu(gate, up))


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
        x = x + self.self_attn(self.input_layernorm(x), rotation, attention, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self.greedy_screen: GreedyScreen | None = None  # set by the loader on a CPU
        self.fused_decode: FusedDecode | None = None  # set by the loader: decode layers in C
        self.c_kernels = True  # the execution config's switch, for the screen
        self.ops: ModelOps = MODEL_OPS  # what the layers compute with (`use_ops`)

    def use_c_kernels(self, on: bool) -> None:
        """Switch the C kernels in every layer on (where they apply) or off (torch code
        only). The loader sets it from the execution config; benchmarks flip it to compare."""
        for module in self.modules():
            if hasattr(module, "c_kernels"):
                module.c_kernels = on
        self.layers_changed()

    def layers_changed(self) -> None:
        """Called when a switch changes which kernels the layers run: the fused decode loop
        builds its structs again."""
        if self.fused_decode is not None:
            self.fused_decode.clear()

    def use_ops(self, ops: ModelOps) -> None:
        """Compute RMSNorm, RoPE (its frequencies too) and SwiGLU with `ops` in every layer
        (MODEL_OPS: minserve's own, with the C kernels where they apply; others: their
        functions, always)."""
        self.ops = ops
        inv_freq = ops.rope_inverse_frequencies(self.config)  # [head_dim / 2]
        self.rope.inv_freq = inv_freq.to(self.rope.inv_freq.device, torch.float32)
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops
        self.layers_changed()

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
        rotation = self.rope(positions, x.dtype)
        if num_layers is None and self.fused_decode is not None and self.runs_own_kernels:
            # a decode step whose every layer runs C kernels: the same kernels from one C call
            hidden = self.fused_decode(x, rotation.cos, rotation.sin, attention)
            if hidden is not None:
                return self.model.norm(hidden)
        for i, layer in enumerate(self.model.layers[:num_layers]):
            x = layer(x, rotation, attention, i)
        return self.model.norm(x)

    @property
    def runs_own_kernels(self) -> bool:
        """The C kernels are on and the layers compute with minserve's own ops."""
        return self.c_kernels and self.ops is MODEL_OPS

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> fp32 logits [N, vocab] (only for tokens we sample from)."""
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> the argmax of each row's fp32 logits [N] (greedy decoding);
        through the bfloat16 screen of the head where it applies (greedy_head.py)."""
        if self.c_kernels and screens(self.greedy_screen, hidden):
            return self.greedy_screen.tokens(hidden)
        return self.compute_logits(hidden).argmax(dim=-1)
