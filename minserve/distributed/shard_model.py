"""Build one rank's slice of the decoder, loading only its shards from the checkpoint.

`minserve.model.llama.CausalLM` is reused unchanged: it is built on the meta device from
the rank's `local_config` (fewer heads, narrower MLP), then its projections, embedding and
LM head are swapped for the parallel layers, and every parameter is filled with its slice
of the checkpoint tensor of the same name:

    q_proj, k_proj, v_proj, gate_proj, up_proj   ColumnParallelLinear (heads / features)
    o_proj, down_proj                            RowParallelLinear: one all-reduce each
    embed_tokens, lm_head                        vocabulary blocks
    norms                                        replicated
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from minserve.distributed import layers
from minserve.distributed.checkpoint import CheckpointTensors
from minserve.distributed.comm import Communicator
from minserve.distributed.layers import load_shard
from minserve.distributed.layout import TPLayout
from minserve.distributed.vocab import ParallelLMHead, VocabParallelEmbedding
from minserve.errors import ModelLoadError
from minserve.model.llama import MLP, CausalLM, RotaryEmbedding, SelfAttention


def build_shard(
    source: CheckpointTensors,
    comm: Communicator,
    dtype: torch.dtype,
    device: torch.device,
    linear: ModuleType = layers,
) -> CausalLM:
    """This rank's decoder: parallel layers holding only their slices of the weights.

    `linear` is the module defining `ColumnParallelLinear` and `RowParallelLinear`, and
    optionally `parallelize_attention`, `VocabParallelEmbedding`, `ParallelLMHead` and
    `TPLayout` (minserve's own when it has none). Chapter 07: pass your
    `exercises.ch07_parallel_linear`, which defines them all.
    """
    attention = getattr(linear, "parallelize_attention", parallelize_attention)
    embedding_cls = getattr(linear, "VocabParallelEmbedding", VocabParallelEmbedding)
    head_cls = getattr(linear, "ParallelLMHead", ParallelLMHead)
    layout = getattr(linear, "TPLayout", TPLayout)(source.config, comm.rank, comm.world_size)
    config = layout.local_config()
    with torch.device("meta"):
        net = CausalLM(config)
    for layer in net.model.layers:
        attention(layer.self_attn, layout, comm, dtype, linear)
        _parallelize_mlp(layer.mlp, layout, comm, dtype, linear)
    hidden = config.hidden_size
    net.model.embed_tokens = embedding_cls(config.vocab_size, hidden, comm, dtype)
    net.lm_head = head_cls(net.model.embed_tokens, tied=config.tie_word_embeddings)
    _load(net, source, device, dtype)
    net.rope = RotaryEmbedding(config).to(device)  # computed, not loaded
    return net.eval()


# >>> exercise 7.3: the all-reduce of the attention block
def parallelize_attention(
    attn: SelfAttention, layout: TPLayout, comm: Communicator, dtype: torch.dtype, linear: Any
) -> None:
    """Query heads and their KV heads stay on this rank; o_proj sums the heads' outputs.

    Replace `attn`'s q_proj, k_proj, v_proj and o_proj (built on the meta device) with
    `linear.ColumnParallelLinear` / `linear.RowParallelLinear` so that one forward of the
    block makes exactly one all-reduce and no all-gather: the rank attends its own heads
    (q rows `layout.q_features()`, k and v rows `layout.kv_features()`) with no
    communication, and o_proj, whose input features are those heads' outputs, turns the
    rank's partial sum into the block's output. Sizes and biases come from
    `layout.config` (q_size, kv_size, hidden_size, qkv_bias, o_bias); pass `dtype` on.
    """
    # >>> solution
    cfg = layout.config
    hidden, q_rows, kv_rows = cfg.hidden_size, layout.q_features(), layout.kv_features()
    for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
        full = cfg.q_size if name == "q_proj" else cfg.kv_size
        column = linear.ColumnParallelLinear(
            hidden, full, comm, cfg.qkv_bias, rows=rows, dtype=dtype
        )
        setattr(attn, name, column)
    attn.o_proj = linear.RowParallelLinear(
        cfg.q_size, hidden, comm, cfg.o_bias, cols=q_rows, dtype=dtype
    )
    # <<< solution


# <<< exercise


def _parallelize_mlp(
    mlp: MLP, layout: TPLayout, comm: Communicator, dtype: torch.dtype, linear: Any
) -> None:
    """gate and up split by inner features, down sums them back: one all-reduce."""
    cfg, rows = layout.config, layout.mlp_features
    hidden, inner, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
    mlp.gate_proj = linear.ColumnParallelLinear(hidden, inner, comm, bias, rows=rows, dtype=dtype)
    mlp.up_proj = linear.ColumnParallelLinear(hidden, inner, comm, bias, rows=rows, dtype=dtype)
    mlp.down_proj = linear.RowParallelLinear(inner, hidden, comm, bias, cols=rows, dtype=dtype)


def _load(
    net: CausalLM, source: CheckpointTensors, device: torch.device, dtype: torch.dtype
) -> None:
    """Fill every parameter from the checkpoint: parallel layers take their slices."""
    tied = net.config.tie_word_embeddings
    for prefix, module in net.named_modules():
        if tied and prefix == "lm_head":
            continue  # shares the embedding's block
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if own:
            full = _read(source, [f"{prefix}.{name}" for name in own], device, dtype)
            _adopt(module, dict(zip(own, full)))
    if tied:
        net.lm_head.weight = net.model.embed_tokens.weight


def _read(
    source: CheckpointTensors, names: list[str], device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    """The full tensors `names`, on the rank's device (one module's worth at a time)."""
    missing = [n for n in names if n not in source.names()]
    if missing:
        raise ModelLoadError(f"checkpoint {source.path} is missing tensors {missing}")
    return [source.get(n).to(device=device, dtype=dtype) for n in names]


def _adopt(module: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Parallel layers keep their slice; anything else (norms) keeps the whole tensor."""
    if hasattr(module, "shard"):  # a parallel layer (minserve's or a student's)
        load_shard(module, full["weight"], full.get("bias"))
        return
    for name, value in full.items():
        setattr(module, name, nn.Parameter(value, requires_grad=False))


def parameter_bytes(net: nn.Module) -> int:
    """Bytes of this rank's parameters (a tied tensor counts once)."""
    return sum(p.numel() * p.element_size() for p in net.parameters())
