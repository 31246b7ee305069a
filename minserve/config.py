"""Engine configuration as frozen dataclasses, with vLLM's option names.

`LLM(**options)` splits its keyword arguments into these; each validates itself so a bad
value fails at construction with a message naming the option.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB when neither num_blocks nor a budget is given
# how the KV cache stores values (vLLM's names; "fp8" is fp8_e4m3): minserve/kvcache/kv_format.py
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: block size and how many blocks (a count or a byte budget)."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    swap_space: float = 0.0  # GiB of host memory for preempted sequences' blocks (0: recompute)
    enable_prefix_caching: bool = False  # keep computed prompt blocks in a radix tree for reuse
    kv_offloading_size: float = 0.0  # GiB of host memory for evicted cached blocks (0: drop them)
    gpu_memory_utilization: float = 0.9  # on a GPU with no size given: the share of its memory
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "fp8_e4m3", "fp8_e5m2", "int8"
    kv_disk_path: str | None = None  # a directory for the disk tier (None: no disk tier)
    kv_disk_size: float = 16.0  # GiB of blocks the disk tier keeps (least recently used go)

    def __post_init__(self) -> None:
        self._check_disk()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; "
                f"choose one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.num_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_memory_bytes, not both")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space (GiB) must be >= 0, got {self.swap_space}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_offloading_size < 0:
            raise ValueError(
                f"kv_offloading_size (GiB) must be >= 0, got {self.kv_offloading_size}"
            )
        if self.kv_offloading_size > 0 and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offloading_size keeps evicted prefix-cache blocks in host memory; "
                "it needs enable_prefix_caching=True"
            )

    def _check_disk(self) -> None:
        if self.kv_disk_path is None:
            return
        if not self.enable_prefix_caching:
            raise ValueError(
                "kv_disk_path writes the prefix cache's blocks to disk; it needs "
                "enable_prefix_caching=True"
            )
        if not self.kv_disk_size > 0:
            raise ValueError(f"kv_disk_size (GiB) must be > 0, got {self.kv_disk_size}")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV events (vLLM's `kv_events_config`): the engine publishes the blocks its prefix
    cache's tiers store and remove, for a router's exact index (docs/state_plane.md)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # the only one: a ZMQ PUB socket and a replay socket
    endpoint: str = "tcp://127.0.0.1:0"  # PUB; port 0: any free port (GET /v1/kv_events says)
    replay_endpoint: str = "tcp://127.0.0.1:0"  # answers "the batches since N"
    buffer_steps: int = 10_000  # batches kept for replay

    def __post_init__(self) -> None:
        if self.publisher != "zmq":
            raise ValueError(f"kv_events_config publisher must be 'zmq', got {self.publisher!r}")
        if self.buffer_steps < 1:
            raise ValueError(f"kv_events_config buffer_steps must be >= 1, got {self.buffer_steps}")
        (host, _), (replay_host, _) = self.address(), tcp_address(self.replay_endpoint)
        if host != replay_host:
            raise ValueError(
                f"kv_events_config endpoint and replay_endpoint bind one host, got {host!r} "
                f"and {replay_host!r}"
            )

    def address(self) -> tuple[str, tuple[int, int]]:
        """The host to bind, and the PUB and replay ports (0: any free port)."""
        host, port = tcp_address(self.endpoint)
        return host, (port, tcp_address(self.replay_endpoint)[1])

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> KVEventsConfig:
        names = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(
                f"unknown kv_events_config key(s) {', '.join(unknown)}; the keys are "
                f"{', '.join(sorted(names))}"
            )
        return cls(**options)


def tcp_address(endpoint: str) -> tuple[str, int]:
    """("host", port) of "tcp://host:port"; a clear ValueError for anything else."""
    rest = endpoint.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    if rest == endpoint or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"an endpoint is tcp://HOST:PORT (PORT 0: any free), got {endpoint!r}")
    return host, int(port)


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level batching limits (vLLM names): sequences and tokens per step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # a name, or a class (any callable) built from the KV cache manager that returns the
    # policy's sort key: `LLM(scheduling_policy=LongestPrefixMatch)` (chapter 05)
    scheduling_policy: str | Callable[[Any], Callable[[Any], tuple]] = "fcfs"
    # Under overload (docs/server.md): targets in ms, None or 0 for off (the default, so the
    # offline LLM batches as before). target_tpot_ms: the mean step time decodes should see;
    # prompt chunks beside them shrink to keep it (`scheduler/step_time.py`).
    # target_ttft_ms: the server refuses (503) a request predicted to start later than this.
    target_tpot_ms: float | None = None
    target_ttft_ms: float | None = None

    def __post_init__(self) -> None:
        self._check_targets()
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if callable(self.scheduling_policy):
            return
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"unknown scheduling_policy {self.scheduling_policy!r}; "
                f"choose one of {', '.join(SCHEDULING_POLICIES)}"
            )

    def _check_targets(self) -> None:
        for name in ("target_tpot_ms", "target_ttft_ms"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number of ms >= 0 (0: off), got {value}")
        if self.target_tpot_ms and not self.enable_chunked_prefill:
            raise ValueError(
                "target_tpot_ms shrinks prompt chunks to keep the step time; it needs "
                "enable_chunked_prefill=True"
            )


def resolve_max_model_len(requested: int | None, model_limit: int, caps: dict[str, int]) -> int:
    """The longest sequence allowed: the model's positions, capped so any one sequence can
    always run alone (it fits the KV pool, and one step's budget without chunked prefill)."""
    if requested is None:
        return min(model_limit, *caps.values())
    if not 0 < requested <= model_limit:
        raise ValueError(
            f"max_model_len must be in [1, {model_limit}] for this model, got {requested}"
        )
    for name, cap in caps.items():
        if requested > cap:
            raise ValueError(
                f"max_model_len {requested} exceeds {name} ({cap}); lower max_model_len, "
                "or raise num_blocks / kv_cache_memory_bytes / max_num_batched_tokens"
            )
    return requested
