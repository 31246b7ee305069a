"""One layer's decode attention on a CPU, plain torch against the C kernels, side by side.

A synthetic pool with SmolLM2-135M's attention shapes (9 query heads, 3 KV heads of 64,
blocks of 16), each sequence's blocks scattered at random; each backend is timed on the
same step (store + attend), alternating, and the median kept. Chapter 02 and
`benchmarks/cpu_kernels.py` use it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from minserve.attention.metadata import AttentionMetadata
from minserve.attention.paged_cpu import CpuPagedAttention
from minserve.attention.paged_torch import TorchPagedAttention
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.model_config import ModelConfig

SMOLLM2_SHAPES = ModelConfig(  # SmolLM2-135M's layer shapes, one layer, a toy vocabulary
    architecture="llama",
    vocab_size=32,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=1,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
BACKENDS = {"torch": TorchPagedAttention, "cpu (C kernels)": CpuPagedAttention}


def decode_step(
    batch: int, context: int, block_size: int = 16, seed: int = 0
) -> tuple[PagedKVPool, AttentionMetadata, tuple[torch.Tensor, ...]]:
    """A pool, a decode step of `batch` sequences of `context` tokens, and its q, k, v."""
    gen = torch.Generator().manual_seed(seed)
    cfg = SMOLLM2_SHAPES
    per_seq = -(-context // block_size)
    pool = PagedKVPool(cfg, batch * per_seq, block_size, torch.float32, "cpu")
    pool.kv.normal_(generator=gen)
    order = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).tolist()
    last = context - 1
    metadata = AttentionMetadata.build(
        query_lens=[1] * batch,
        context_lens=[context] * batch,
        block_tables=order,
        slot_mapping=[t[last // block_size] * block_size + last % block_size for t in order],
    )
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, generator=gen)
    k = torch.randn(batch, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    v = torch.randn(batch, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    return pool, metadata, (q, k, v)


def time_decode_backends(
    batch_sizes: Sequence[int] = (1, 4, 16), context: int = 512, calls: int = 200, rounds: int = 5
) -> dict[str, dict[int, float]]:
    """Median microseconds per layer call, {backend: {batch size: us}}."""
    results: dict[str, dict[int, float]] = {name: {} for name in BACKENDS}
    for batch in batch_sizes:
        pool, metadata, (q, k, v) = decode_step(batch, context)
        runs = {name: cls(pool, metadata) for name, cls in BACKENDS.items()}
        samples: dict[str, list[float]] = {name: [] for name in BACKENDS}
        with torch.inference_mode():
            for _ in range(rounds):  # alternate, so that drift favours neither
                for name, attention in runs.items():
                    attention(0, q, k, v)  # warm
                    start = time.perf_counter()
                    for _ in range(calls):
                        attention(0, q, k, v)
                    samples[name].append((time.perf_counter() - start) / calls * 1e6)
        for name, times in samples.items():
            results[name][batch] = sorted(times)[len(times) // 2]
    return results
