"""Which slice of every weight a tensor-parallel rank holds (Megatron-LM's layout).

Attention is split by heads: rank r computes query heads [r * Hq/N, (r+1) * Hq/N) with
their KV heads. With at least as many KV heads as ranks, KV heads are split the same way;
with fewer (SmolLM2 has 3 for 9 query heads; at N = 6 say), each KV head is *replicated*
on the N/Hkv ranks whose query heads read it. The MLP is split by its inner features, the
vocabulary by blocks. The rank's model is an ordinary decoder with fewer heads and a
narrower MLP: `local_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minserve.model_config import ModelConfig


class TensorParallelError(ValueError):
    """The model cannot be split over this many ranks (the message says why)."""


# >>> exercise 7.5: which heads and features a rank holds
@dataclass(frozen=True)
class TPLayout:
    """Rank `rank` of `world_size`: its query heads, KV heads and MLP features.

    Everything is a contiguous `range`, rank 0 first. Query heads and MLP features split
    evenly. KV heads split evenly too when there are at least as many as ranks; with fewer
    (grouped-query attention at high TP), rank r holds the one KV head its query heads
    read, so each KV head is replicated on world_size / num_kv_heads neighbouring ranks.
    """

    config: ModelConfig
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        check_divisible(self.config, self.world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside 0 .. {self.world_size - 1}")

    @property
    def kv_replicated(self) -> bool:
        """Fewer KV heads than ranks: each KV head lives on several ranks."""
        return self.config.num_kv_heads < self.world_size

    @property
    def q_heads(self) -> range:
        """This rank's query heads: its even share, num_heads / world_size of them."""
        # >>> solution
        per_rank = self.config.num_heads // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)
        # <<< solution

    @property
    def kv_heads(self) -> range:
        """The KV heads this rank's query heads read (one, when KV heads are replicated)."""
        # >>> solution
        cfg = self.config
        if self.kv_replicated:
            head = self.rank // (self.world_size // cfg.num_kv_heads)
            return range(head, head + 1)
        per_rank = cfg.num_kv_heads // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)
        # <<< solution

    @property
    def mlp_features(self) -> range:
        """This rank's MLP inner features: rows of gate/up, columns of down_proj."""
        # >>> solution
        per_rank = self.config.intermediate_size // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)
        # <<< solution

    def q_features(self) -> range:
        """Rows of q_proj (columns of o_proj) for this rank's query heads."""
        # >>> solution
        return _features(self.q_heads, self.config.head_dim)
        # <<< solution

    def kv_features(self) -> range:
        """Rows of k_proj and v_proj for this rank's KV heads."""
        # >>> solution
        return _features(self.kv_heads, self.config.head_dim)
        # <<< solution

    def local_config(self) -> ModelConfig:
        """The decoder this rank runs: its heads and MLP width; hidden and vocab unchanged."""
        # >>> solution
        return replace(
            self.config,
            num_heads=len(self.q_heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=len(self.mlp_features),
        )
        # <<< solution


def _features(heads: range, head_dim: int) -> range:
    """The features (rows of a projection) of `heads`: head_dim consecutive ones each."""
    # >>> solution
    return range(heads.start * head_dim, heads.stop * head_dim)
    # <<< solution


def check_divisible(config: ModelConfig, world_size: int) -> None:
    """Raise `TensorParallelError` unless heads, KV heads and the MLP split over the ranks.

    world_size must be at least 1 and divide the query heads and the MLP's features; KV
    heads and world_size must divide one another (either one splits the other). Each
    message names tensor_parallel_size and the number it fails on.
    """
    # >>> solution
    if world_size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be at least 1, got {world_size}")
    heads, kv, inner = config.num_heads, config.num_kv_heads, config.intermediate_size
    if heads % world_size:
        raise TensorParallelError(
            f"tensor_parallel_size={world_size} must divide the model's {heads} query heads"
        )
    if kv % world_size and world_size % kv:
        raise TensorParallelError(
            f"tensor_parallel_size={world_size} and the model's {kv} KV heads must divide one "
            "another (KV heads are split over ranks, or replicated when there are fewer)"
        )
    if inner % world_size:
        raise TensorParallelError(
            f"tensor_parallel_size={world_size} must divide the MLP's {inner} features"
        )
    # <<< solution


# <<< exercise
