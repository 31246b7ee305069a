"""`CoursePlugins`: a student's classes, rules and codecs in place of minserve's own.

Each chapter's exercise plugs into the live engine through one of these fields, and the
engine runs on it exactly as on minserve's part of the same shape:

    LLM(plugins=CoursePlugins(block_allocator_cls=MyAllocator))      # chapter 01
    LLM(plugins=CoursePlugins(chunk_rule=my_rules.prefill_chunk))     # chapter 04

They are checked once, against the engine's options, before anything loads (`check`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from minserve.attention.contiguous import Attend
from minserve.attention.triton_decode import DecodeKernels
from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.block_table import BlockTable
from minserve.kvcache.host_tier import HostPrefixTier
from minserve.kvcache.kv_format import KVCodec, check_kv_codec
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.kvcache.radix_cache import RadixCache
from minserve.kvcache.swap import HostSwapSpace
from minserve.loader import LoadedModel
from minserve.model.ops import ModelOps
from minserve.model.quant_blocks import QuantCodec
from minserve.model.quantized_linear import use_quant_codec
from minserve.model.runner import FlatBatchFn
from minserve.model.sampler import Sampler
from minserve.output_processor import SampleOutput, check_stop_matcher_cls
from minserve.scheduler.scheduler import Scheduler
from minserve.scheduler.step_cost import StepCostModel
from minserve.stop_strings import StopStringMatcher

if TYPE_CHECKING:
    from minserve.engine_args import EngineArgs


@dataclass(frozen=True)
class CoursePlugins:
    """The course's plug-ins (docs/course.md); every field left alone is minserve's own.

    model_ops: `ModelOps.from_module(m)`: the layers' rms_norm, apply_rope and swiglu, and
    `attend` over each sequence's K/V (chapter 00); set on the loaded model, so an LLM
    sharing it shares them. sampler: draws each step's tokens (chapter 00).
    block_allocator_cls, block_table_cls, kv_pool_cls (chapter 01), scheduler_cls (chapter 03),
    prefix_cache_cls and host_tier_cls (chapter 05, with enable_prefix_caching; the host tier
    with kv_offloading_size > 0 too), sample_output_cls and
    stop_matcher_cls (chapter 09), swap_space_cls (chapter 04, with swap_space > 0): a class
    of the same shape as minserve's. flat_batch: how the model runner lays a step's chunks
    out as one batch, a function of the shape of `model.runner.flat_batch` (chapter 03).
    chunk_rule and preemption_rule: chapter 04's two scheduling decisions, as
    `scheduler.budget.prefill_chunk` and `scheduler.preemption.preemption_mode`.
    step_cost_model_cls: chapter 04's model of step time, of the shape of
    `scheduler.step_cost.StepCostModel`, which the step-time scheduler fits and sizes prompt
    chunks with (with target_tpot_ms or target_ttft_ms).
    decode_kernels: chapter 02's Triton kernels (with attention_backend="triton").
    tensor_parallel_layers: the module, by name, whose parallel layers every rank builds
    its shard with (chapter 07). quant_codec: chapter 10's
    block dequantization (with quantization="gguf"); kv_codec: chapter 10's int8 KV
    arithmetic (with kv_cache_dtype="int8"). choice_matcher_cls: chapter 12's matcher of a
    `choice` constraint (`structured.choice_dfa.ChoiceMatcher`'s shape: `build(choices,
    vocab)` and the matcher protocol), used instead of xgrammar for `choice` requests.
    grammar_can_end: chapter 12's test of whether a compiled grammar can end
    (`structured.grammar_ends.can_end`'s shape: its print -> bool), run on every grammar.
    block_keys: chapter 11's chained block key (`kvcache.block_key.block_keys`' shape),
    naming every cached block for KV events and the disk tier (with kv_events_config or
    kv_disk_path); load_plan: chapter 11's load-or-recompute rule
    (`kvcache.load_plan.plan_load`'s shape), which the disk tier asks (with kv_disk_path).
    """

    model_ops: ModelOps | None = None
    sampler: Sampler | None = None
    block_allocator_cls: type = BlockAllocator
    block_table_cls: type = BlockTable
    kv_pool_cls: type = PagedKVPool
    scheduler_cls: type = Scheduler
    flat_batch: FlatBatchFn | None = None
    prefix_cache_cls: type = RadixCache
    host_tier_cls: type = HostPrefixTier
    sample_output_cls: type = SampleOutput
    stop_matcher_cls: type = StopStringMatcher
    swap_space_cls: type = HostSwapSpace
    chunk_rule: Callable[[int, int, bool], int] | None = None
    preemption_rule: Callable[[int, int, int], str] | None = None
    step_cost_model_cls: type = StepCostModel
    decode_kernels: DecodeKernels | None = None
    tensor_parallel_layers: str | None = None
    quant_codec: QuantCodec | None = None
    kv_codec: KVCodec | None = None
    choice_matcher_cls: type | None = None
    grammar_can_end: Callable[[str], bool] | None = None
    block_keys: Callable[..., list[bytes]] | None = None
    load_plan: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        check_stop_matcher_cls(self.stop_matcher_cls)

    @property
    def attend(self) -> Attend | None:
        """A student's attention function, or None for the engine's own backend."""
        return self.model_ops.attend if self.model_ops is not None else None

    @property
    def scheduling_rules(self) -> dict[str, Callable[..., Any]]:
        """The scheduler's decision functions that were given (the others stay minserve's),
        and the step-time model's class when it is not minserve's."""
        given = {"chunk_rule": self.chunk_rule, "preemption_rule": self.preemption_rule}
        rules = {name: rule for name, rule in given.items() if rule is not None}
        if self.step_cost_model_cls is not StepCostModel:
            rules["step_cost_model_cls"] = self.step_cost_model_cls
        return rules

    def changed(self) -> list[str]:
        """The names of the fields that differ from minserve's own."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]

    def check(self, args: EngineArgs) -> None:
        """Refuse a plug-in the engine these options build would never call."""
        if args.tensor_parallel_size != 1:
            given = [n for n in ("model_ops", "quant_codec") if getattr(self, n) is not None]
            given += ["kv_pool_cls"] if self.kv_pool_cls is not PagedKVPool else []
            if given:
                raise ValueError(
                    f"{', '.join(given)} runs in one process; leave tensor_parallel_size at 1"
                )
        if self.decode_kernels is not None and (
            args.engine != "paged" or args.tensor_parallel_size != 1
        ):
            raise ValueError("decode_kernels runs on the paged engine with one process only")
        check_kv_codec(args.kv_cache_dtype, self.kv_codec)
        if self.tensor_parallel_layers is not None and args.tensor_parallel_size == 1:
            raise ValueError("tensor_parallel_layers applies with tensor_parallel_size > 1")
        paged_only = [name for name in self.changed() if name in PAGED_ENGINE_PLUGINS] + list(
            self.scheduling_rules
        )
        if paged_only and args.engine != "paged":
            raise ValueError(
                f"{', '.join(paged_only)} plugs into the paged engine; "
                f"engine={args.engine!r} has none"
            )
        if self.prefix_cache_cls is not RadixCache and not args.enable_prefix_caching:
            raise ValueError("prefix_cache_cls is used only with enable_prefix_caching=True")
        if self.host_tier_cls is not HostPrefixTier and not (
            args.enable_prefix_caching and args.kv_offloading_size > 0
        ):
            raise ValueError(
                "host_tier_cls is used only with enable_prefix_caching=True and "
                "kv_offloading_size > 0 (GiB of host memory for evicted prefix blocks)"
            )
        if self.step_cost_model_cls is not StepCostModel and not (
            args.target_tpot_ms or args.target_ttft_ms
        ):
            raise ValueError(
                "step_cost_model_cls is fitted by the step-time scheduler: give target_tpot_ms "
                "(or target_ttft_ms)"
            )
        if self.block_keys is not None and not (args.kv_events is not None or args.kv_disk_path):
            raise ValueError(
                "block_keys names the cached blocks for KV events and the disk tier: give "
                "kv_events_config or kv_disk_path (with enable_prefix_caching=True)"
            )
        if self.load_plan is not None and args.kv_disk_path is None:
            raise ValueError("load_plan is the disk tier's rule: give kv_disk_path")
        if self.swap_space_cls is not HostSwapSpace and args.swap_space <= 0:
            raise ValueError("swap_space_cls is used only with swap_space > 0 (GiB of host memory)")
        if self.choice_matcher_cls is not None and not callable(
            getattr(self.choice_matcher_cls, "build", None)
        ):
            raise ValueError(
                "choice_matcher_cls must be a class with a `build(choices, vocab)` classmethod, "
                "as chapter 12's ChoiceMatcher"
            )

    def install(self, loaded: LoadedModel) -> None:
        """Set the model's ops (the student's, or its platform's) and its block codec."""
        loaded.model.use_ops(self.model_ops or loaded.platform.ops)
        if use_quant_codec(loaded.model, self.quant_codec) == 0 and self.quant_codec is not None:
            raise ValueError(
                'quant_codec widens GGUF blocks; load a .gguf model with quantization="gguf"'
            )


# the plug-ins only the paged engine calls (its KV cache manager, scheduler, runner, swap
# space)
PAGED_ENGINE_PLUGINS = (
    "block_allocator_cls", "block_table_cls", "kv_pool_cls", "scheduler_cls", "flat_batch",
    "prefix_cache_cls", "host_tier_cls", "swap_space_cls", "choice_matcher_cls", "grammar_can_end",
    "block_keys", "load_plan",
)  # fmt: skip


NO_PLUGINS = CoursePlugins()  # minserve's own parts everywhere


def plugin_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(CoursePlugins))
