"""`EngineArgs`: every option of an engine, with vLLM's names, validated once.

`LLM(...)`, `minserve serve`, the tensor-parallel driver and the prefill/decode instances
all start from one of these (vLLM's `EngineArgs`). The course's plug-ins (a student's
classes, rules and codecs) travel beside it in `CoursePlugins` (`minserve/plugins.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minserve.config import CacheConfig, KVEventsConfig, SchedulerConfig
from minserve.plugins import plugin_names
from minserve.speculative.config import SpeculativeConfig

if TYPE_CHECKING:
    from minserve.loader import LoadedModel

ENGINES = ("paged", "reference")


@dataclass(frozen=True)
class EngineArgs:
    """What to load and how to run it (vLLM's option names; docs/engine.md).

    model: a .gguf file or a Hugging Face checkpoint folder; None means the bundled
    SmolLM2-135M-Instruct; an already loaded model (`other_llm.loaded`) is shared, not
    loaded again (leave dtype, device and quantization as they are then).
    engine="reference" runs the contiguous-KV reference path (the oracle) instead of the
    paged engine.
    """

    model: str | Path | LoadedModel | None = None
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    quantization: str | None = None  # "gguf" (a .gguf file's blocks as stored) or "int8"
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    swap_space: float = 0.0
    enable_prefix_caching: bool = False
    kv_offloading_size: float = 0.0
    kv_cache_dtype: str = "auto"
    kv_disk_path: str | Path | None = None  # the disk tier's directory (docs/state_plane.md)
    kv_disk_size: float = 16.0  # GiB
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # a name, or a class built from the KV cache manager (chapter 05: LongestPrefixMatch)
    scheduling_policy: str | Callable[..., Any] = "fcfs"
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    # vLLM's dict: {"method": "ngram", "num_speculative_tokens": 4} (docs/speculative.md)
    speculative_config: dict[str, Any] | None = None
    engine: str = "paged"
    # under overload: the step time decodes keep, the first-token time a request must be
    # predicted to get (docs/server.md, "Under overload"); None or 0: off (`minserve serve`
    # turns both on)
    target_tpot_ms: float | None = None
    target_ttft_ms: float | None = None
    # vLLM's dict: {"enable_kv_cache_events": True} publishes the prefix cache's blocks for a
    # router (docs/state_plane.md)
    kv_events_config: dict[str, Any] | None = None
    cache: CacheConfig = field(init=False, repr=False, compare=False)
    scheduler: SchedulerConfig = field(init=False, repr=False, compare=False)
    speculative: SpeculativeConfig | None = field(init=False, repr=False, compare=False)
    kv_events: KVEventsConfig | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; choose one of {', '.join(ENGINES)}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        self._check_one_process()
        cache = CacheConfig(
            self.block_size, self.num_blocks, self.kv_cache_memory_bytes, self.swap_space,
            self.enable_prefix_caching, self.kv_offloading_size, self.gpu_memory_utilization,
            self.kv_cache_dtype,
            None if self.kv_disk_path is None else str(self.kv_disk_path), self.kv_disk_size,
        )  # fmt: skip
        scheduler = SchedulerConfig(
            self.max_num_seqs, self.max_num_batched_tokens, self.enable_chunked_prefill,
            self.scheduling_policy, self.target_tpot_ms, self.target_ttft_ms,
        )  # fmt: skip
        speculative = (
            SpeculativeConfig.from_dict(self.speculative_config)
            if self.speculative_config is not None
            else None
        )
        object.__setattr__(self, "cache", cache)
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "speculative", speculative)
        object.__setattr__(self, "kv_events", self._kv_events())

    def _kv_events(self) -> KVEventsConfig | None:
        """The KV events config, when events are on (they describe the prefix cache)."""
        if self.kv_events_config is None:
            return None
        config = KVEventsConfig.from_dict(self.kv_events_config)
        if not config.enable_kv_cache_events:
            return None
        if not self.enable_prefix_caching or self.engine != "paged":
            raise ValueError(
                "KV events report the prefix cache's blocks: kv_events_config needs "
                "enable_prefix_caching=True on the paged engine"
            )
        return config

    def _check_one_process(self) -> None:
        """The options that run on the paged engine in one process only."""
        one_process = self.engine == "paged" and self.tensor_parallel_size == 1
        if self.speculative_config is not None and not one_process:
            raise ValueError(
                "speculative_config needs engine='paged' and tensor_parallel_size=1 "
                f"(got engine={self.engine!r}, tensor_parallel_size={self.tensor_parallel_size})"
            )
        if self.kv_disk_path is not None and not one_process:
            raise ValueError(
                "kv_disk_path writes whole blocks from one process's pool; use engine='paged' "
                "with tensor_parallel_size=1"
            )
        if self.quantization is not None and self.tensor_parallel_size != 1:
            raise ValueError("quantization runs in one process; leave tensor_parallel_size at 1")
        if self.kv_cache_dtype != "auto" and not one_process:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} stores the paged engine's KV pool in "
                "one process; use engine='paged' with tensor_parallel_size=1, or "
                "kv_cache_dtype='auto'"
            )
        if self.tensor_parallel_size != 1 and self.engine != "paged":
            raise ValueError(
                "tensor_parallel_size > 1 runs the paged engine, not engine='reference'"
            )

    @classmethod
    def from_options(cls, **options: Any) -> EngineArgs:
        """Options by name; an unknown name is refused, naming the options there are (and
        pointing a course plug-in to `plugins=CoursePlugins(...)`)."""
        known = option_names()
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(_unknown_options(unknown, known))
        return cls(**options)


def option_names() -> tuple[str, ...]:
    """The names `EngineArgs` takes (its derived configs aside)."""
    return tuple(f.name for f in fields(EngineArgs) if f.init)


def _unknown_options(unknown: list[str], known: tuple[str, ...]) -> str:
    plugins = [name for name in unknown if name in plugin_names()]
    if plugins:
        given = ", ".join(f"{name}=..." for name in plugins)
        return (
            f"{', '.join(plugins)}: a course plug-in, not an engine option; pass "
            f"plugins=CoursePlugins({given}) (from minserve import CoursePlugins)"
        )
    return f"unknown engine option(s) {', '.join(unknown)}; the options are {', '.join(known)}"
