"""The course's chapters: which minserve sources hold each chapter's exercises.

A chapter is one notebook (`chapters/NN_slug.ipynb`), one generated module in
`exercises/` and `solutions/`, and one list of checks run by `minserve check NN`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from minserve.course.regions import Kind

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # minserve/
REPO_ROOT = PACKAGE_DIR.parent  # holds exercises/ and solutions/ in a source checkout

Check = Callable[[ModuleType], None]


@dataclass(frozen=True)
class Chapter:
    """One chapter of the course and where its exercises come from."""

    number: str  # "00"
    slug: str  # "the_model_we_serve": the notebook is chapters/00_the_model_we_serve.ipynb
    title: str
    module: str  # "ch00_model": exercises/ch00_model.py, solutions/ch00_model.py
    sources: tuple[str, ...]  # relative to the minserve package: "model/sampler.py"
    header: str  # module docstring + imports of the generated file
    checks: str  # dotted path of a module with `CHECKS: list[Check]`

    def generated_path(self, kind: Kind) -> str:
        """Where the generated module lives, relative to the repo root."""
        return f"{kind}s/{self.module}.py"

    def source_modules(self) -> tuple[str, ...]:
        """The minserve modules holding the reference code: ("minserve.model.sampler",)."""
        return tuple("minserve." + s.removesuffix(".py").replace("/", ".") for s in self.sources)

    def load_checks(self) -> list[Check]:
        """The chapter's checks, in the order the report shows them."""
        return list(importlib.import_module(self.checks).CHECKS)


CHAPTERS: tuple[Chapter, ...] = (
    Chapter(
        number="00",
        slug="the_model_we_serve",
        title="The model we serve",
        module="ch00_model",
        sources=("model/ops.py", "attention/contiguous.py", "model/sampler.py", "model/rope.py"),
        header=(
            '"""Chapter 00, The model we serve: the decoder\'s math and the sampler\'s filters.\n\n'
            "0.1-0.4 are the model's math (RMSNorm, RoPE, SwiGLU, grouped-query causal\n"
            "attention); plug them into the engine with\n"
            "`LLM(plugins=CoursePlugins(model_ops=ModelOps.from_module(module)))`. 0.5-0.7 are\n"
            "the sampler's filters (top-k, top-p, min-p): each takes logits [rows, vocab] and\n"
            "one setting per row and returns new logits in which the tokens it rejects are\n"
            "-inf; plug them in with\n"
            "`LLM(plugins=CoursePlugins(sampler=Sampler.from_module(module)))`. 0.8 is the\n"
            "sampler's repetition, frequency and presence penalties; `Sampler.from_module`\n"
            "takes it too. 0.9 is\n"
            "RoPE's frequencies (with Llama 3's scaling); `ModelOps.from_module` takes it\n"
            "with 0.1-0.4, and the model's rotary embedding uses it.\n"
            '"""\n\n'
            "import math\n"
            "from collections.abc import Sequence\n\n"
            "import torch\n"
            "import torch.nn.functional as F\n\n"
            "from minserve.model.sampler import (  # noqa: F401  (used by 0.8)\n"
            "    FLOAT32_MAX,\n"
            "    SamplingRow,\n"
            "    flat_token_ids,\n"
            "    has_penalties,\n"
            "    per_row,\n"
            ")\n"
            "from minserve.model_config import ModelConfig\n"
        ),
        checks="minserve.course.checks_ch00",
    ),
    Chapter(
        number="01",
        slug="block_allocator",
        title="KV cache and the block allocator",
        module="ch01_block_allocator",
        sources=("kvcache/block_allocator.py", "kvcache/block_table.py", "kvcache/paged_pool.py"),
        header=(
            '"""Chapter 01, KV cache and the block allocator: free list, reference counts,\n'
            "block tables and the paged pool.\n\n"
            "The paged KV pool is cut into blocks; `BlockAllocator` hands out block ids and\n"
            "counts who holds each one; a sequence's `BlockTable` maps its logical blocks to\n"
            "physical ones, shares them on fork and copies a shared last block before writing\n"
            "into it; `PagedKVPool` is the memory itself: sized in blocks from a byte budget,\n"
            "one tensor for every layer's K and V, and block copies by index. Plug your\n"
            "classes into the engine with `LLM(plugins=CoursePlugins(\n"
            "block_allocator_cls=BlockAllocator, block_table_cls=BlockTable,\n"
            "kv_pool_cls=PagedKVPool))`.\n"
            '"""\n\n'
            "from __future__ import annotations\n\n"
            "from collections import deque\n\n"
            "import torch\n\n"
            "from minserve.config import DEFAULT_KV_CACHE_BYTES, CacheConfig\n"
            "from minserve.kvcache import NoFreeBlocksError\n"
            "from minserve.kvcache.kv_format import KVFormat\n"
            "from minserve.kvcache.paged_pool import as_format, holds_no_block\n"
            "from minserve.model_config import ModelConfig\n"
        ),
        checks="minserve.course.checks_ch01",
    ),
    Chapter(
        number="02",
        slug="paged_attention",
        title="Paged attention",
        module="ch02_paged_attention",
        sources=(
            "attention/triton_first_steps.py",
            "attention/triton_tiles.py",
            "attention/triton_decode.py",
            "attention/triton_store.py",
            "attention/triton_prefill.py",
        ),
        header=(
            '"""Chapter 02, Paged attention: the Triton kernels of the engine\'s attention.\n\n'
            "2.1-2.3 are Triton's first moves: one program per block (`tl.program_id`,\n"
            "`tl.arange`), masked loads and stores, a 2-D tile through strides; launch them with\n"
            "`scale_vector`, `add_vectors` and `copy_tile`. 2.4 gathers a sequence's K rows\n"
            "through its block table; 2.5 attends one query over a context that fits one tile;\n"
            "2.6 is the engine's decode kernel, an online softmax tile after tile; 2.7 merges the\n"
            "splits of flash-decoding; 2.8 stores a step's new keys and values in the pool by\n"
            "slot; 2.9 attends a prefill chunk causally over its cached prefix and itself. Launch\n"
            "them with `gather_kv`, `tile_attention`, `paged_decode(..., kernel=,\n"
            "combine_kernel=)`, `paged_store(..., kernel=)` and `paged_prefill(..., kernel=)`;\n"
            'run the engine on 2.6-2.9 with `LLM(attention_backend="triton",\n'
            "plugins=CoursePlugins(decode_kernels=DecodeKernels.from_module(module)))`.\n"
            "On a CPU they run in Triton's interpreter (TRITON_INTERPRET=1, set by\n"
            "minserve.attention.triton_env).\n"
            '"""\n\n'
            "import triton\n"
            "import triton.language as tl\n\n"
            "from minserve.attention import triton_env  # noqa: F401  (before any @triton.jit)\n"
            "from minserve.attention.triton_decode import DecodeKernels  # noqa: F401\n"
            "from minserve.attention.triton_decode import paged_decode  # noqa: F401\n"
            "from minserve.attention.triton_store import paged_store  # noqa: F401\n"
            "from minserve.attention.triton_env import dot_precision  # noqa: F401\n"
            "from minserve.attention.triton_first_steps import (  # noqa: F401\n"
            "    add_vectors,\n"
            "    copy_tile,\n"
            "    scale_vector,\n"
            ")\n"
            "from minserve.attention.triton_prefill import paged_prefill  # noqa: F401\n"
            "from minserve.attention.triton_tiles import gather_kv, tile_attention  # noqa: F401\n"
        ),
        checks="minserve.course.checks_ch02",
    ),
    Chapter(
        number="03",
        slug="continuous_batching",
        title="Continuous batching",
        module="ch03_scheduler",
        sources=("scheduler/scheduler.py", "model/runner.py"),
        header=(
            '"""Chapter 03, Continuous batching: the scheduler that builds every step\'s batch.\n\n'
            "3.1 appends a sequence's sampled tokens through the stop rules. 3.2: each step,\n"
            "running sequences go first (decodes, then prefill chunks), preempting when the\n"
            "KV cache runs out of blocks; then waiting ones are admitted in policy order\n"
            "while the token budget, the seats and the blocks last. 3.3 moves every sequence\n"
            "on by what the step produced. Plug your class (it calls the module's 3.1 and\n"
            "3.3) into the engine with `LLM(plugins=CoursePlugins(scheduler_cls=Scheduler))`.\n"
            "3.4 lays the step's chunks end to end as the model runner's one flat batch;\n"
            "plug it in with `LLM(plugins=CoursePlugins(flat_batch=flat_batch))`.\n"
            '"""\n\n'
            "from __future__ import annotations  # 3.1 names 3.2's Scheduler\n\n"
            "from collections.abc import Callable, Iterable, Mapping\n\n"
            "import torch\n\n"
            "from minserve.attention.metadata import AttentionMetadata\n"
            "from minserve.config import SchedulerConfig\n"
            "from minserve.kvcache.manager import KVCacheManager\n"
            "from minserve.messages import (\n"
            "    ModelRunnerOutput,\n"
            "    NewTokens,\n"
            "    OutputStops,\n"
            "    SampledTokens,\n"
            "    ScheduledChunk,\n"
            "    SchedulerOutput,\n"
            "    SchedulerUpdate,\n"
            ")\n"
            "from minserve.model.runner import ModelInputs, ToDevice, slot_of\n"
            "from minserve.request import StopRules\n"
            "from minserve.scheduler.budget import prefill_chunk\n"
            "from minserve.scheduler.policy import get_policy\n"
            "from minserve.scheduler.preemption import PreemptionMode, preemption_mode\n"
            "from minserve.scheduler.scheduler import ScheduledSeq, SchedulerStats, StepPlan\n"
            "from minserve.scheduler.sequence import SeqStatus, Sequence\n"
            "from minserve.scheduler.draft_planner import DraftPlanner\n"
        ),
        checks="minserve.course.checks_ch03",
    ),
    Chapter(
        number="04",
        slug="chunked_prefill_and_preemption",
        title="Chunked prefill and preemption",
        module="ch04_chunked_prefill",
        sources=(
            "scheduler/budget.py",
            "scheduler/preemption.py",
            "kvcache/swap.py",
            "scheduler/step_cost.py",
        ),
        header=(
            '"""Chapter 04, Chunked prefill and preemption: the scheduler\'s two decisions\n'
            "when time or memory runs short, the swap space a preempted sequence goes to,\n"
            "and the model of step time that sizes prompt chunks for a latency target.\n\n"
            "`prefill_chunk`: how many tokens a sequence computes out of what is left of the\n"
            "step's token budget (Sarathi-Serve's chunked prefill). `preemption_mode`:\n"
            "whether a preempted sequence's blocks go to the host swap space or are freed and\n"
            "recomputed (vLLM). `HostSwapSpace`: the account of the host memory swapped-out\n"
            "blocks wait in. Plug yours into the engine with\n"
            "`LLM(swap_space=0.05, plugins=CoursePlugins(chunk_rule=prefill_chunk,\n"
            "preemption_rule=preemption_mode, swap_space_cls=HostSwapSpace))`.\n"
            "`StepCost` and `StepCostModel`: a step's time predicted, inverted into the largest\n"
            "prompt chunk a time budget holds, and fitted online to the steps measured; plug\n"
            "them in with `LLM(target_tpot_ms=..., plugins=CoursePlugins(\n"
            "step_cost_model_cls=StepCostModel))`.\n"
            '"""\n\n'
            "from __future__ import annotations\n\n"
            "import itertools\n"
            "import sys\n"
            "from dataclasses import astuple, dataclass\n\n"
            "import numpy as np\n\n"
            "from minserve.config import CacheConfig\n"
            "from minserve.kvcache.swap import GIB\n"
            "from minserve.kvcache.swap import SwapSpaceFullError  # noqa: F401\n"
            "from minserve.messages import DropSwapped, SwapIn, SwapOut\n"
            "from minserve.scheduler.preemption import PreemptionMode\n"
            "from minserve.scheduler.step_cost import COEFFICIENT_NAMES, NUM_FEATURES, StepShape\n"
        ),
        checks="minserve.course.checks_ch04",
    ),
    Chapter(
        number="05",
        slug="sharing_prefixes",
        title="Sharing prefixes",
        module="ch05_radix_cache",
        sources=("scheduler/cache_aware.py", "kvcache/radix_cache.py", "kvcache/host_tier.py"),
        header=(
            '"""Chapter 05, Sharing prefixes: the scheduling policy that serves cache hits\n'
            "first, the radix tree of the prefix cache, and its host tier.\n\n"
            "First `LongestPrefixMatch`, SGLang's longest-prefix-match policy: plug it in with\n"
            "`LLM(enable_prefix_caching=True, scheduling_policy=LongestPrefixMatch)`. Then a\n"
            "radix tree over token ids at block granularity (SGLang's RadixAttention): you\n"
            "write `match_prefix`, `insert` and `evict`. Plug your class into the engine with\n"
            "`LLM(enable_prefix_caching=True,\n"
            "plugins=CoursePlugins(prefix_cache_cls=RadixCache))`. Last, `HostPrefixTier`:\n"
            "evicted blocks demoted to host memory under their content keys, promoted back\n"
            "when a match continues into them; plug it in with\n"
            "`LLM(enable_prefix_caching=True, kv_offloading_size=0.01,\n"
            "plugins=CoursePlugins(host_tier_cls=HostPrefixTier))`.\n"
            '"""\n\n'
            "import heapq\n"
            "import itertools\n"
            "import time\n"
            "from collections import OrderedDict\n"
            "from collections.abc import Callable\n\n"
            "from minserve.kvcache.block_allocator import BlockAllocator\n"
            "from minserve.kvcache.block_key import UNSHARED_ROOT, BlockKey, block_keys\n"
            "from minserve.kvcache.host_tier import TierCosts\n"
            "from minserve.kvcache.manager import KVCacheManager\n"
            "from minserve.kvcache.radix_cache import PrefixMatch, RadixNode\n"
            "from minserve.messages import BlockOp, Demote, Promote\n"
            "from minserve.scheduler.cache_aware import DEFAULT_MAX_WAIT_S\n"
            "from minserve.scheduler.sequence import SeqStatus, Sequence\n"
        ),
        checks="minserve.course.checks_ch05",
    ),
    Chapter(
        number="06",
        slug="speculative_decoding",
        title="Sampling and speculative decoding",
        module="ch06_rejection_sampling",
        sources=(
            "speculative/verify.py",
            "speculative/ngram.py",
            "speculative/draft_length.py",
            "speculative/early_exit.py",
        ),
        header=(
            '"""Chapter 06, Sampling and speculative decoding: verifying a draft distribution,\n'
            "and proposing drafts by prompt lookup and by early exit.\n\n"
            "A draft q proposes tokens; the target p keeps each with probability min(1, p/q)\n"
            "and, at the first rejection, draws from the residual max(0, p - q) normalised, so\n"
            "every token returned is distributed exactly as p (Leviathan et al., Chen et al.).\n"
            "The n-gram proposer guesses the tokens that followed the latest earlier match of\n"
            'the last n tokens; plug it in with `LLM(speculative_config={"method": "ngram",\n'
            '"num_speculative_tokens": 4, "proposer_cls": NgramProposer})`. The adaptive\n'
            "draft length picks, per request, the g in [1, k] with the best expected speedup\n"
            "at its running acceptance rate; plug your `DraftLengths` in with\n"
            '`speculative_config={..., "draft_length": "adaptive", "draft_lengths_cls":\n'
            "DraftLengths}`. The early-exit proposer drafts with the target's own first\n"
            "layers, reading and writing the target's KV pool; plug it in with\n"
            '`speculative_config={"method": "early_exit", ..., "proposer_cls":\n'
            "EarlyExitProposer}`.\n"
            '"""\n\n'
            "from collections.abc import Hashable\n"
            "from dataclasses import dataclass\n\n"
            "import torch\n\n"
            "from minserve.attention.metadata import AttentionMetadata\n"
            "from minserve.messages import ScheduledChunk\n"
            "from minserve.model.runner import ModelInputs, ModelRunner, slot_of\n"
            "from minserve.model.sampler import Sampler\n"
            "from minserve.speculative.config import SpeculativeConfig\n"
            "from minserve.speculative.distributions import choose_drafts, row_after\n"
            "from minserve.speculative.draft import Draft\n"
            "from minserve.speculative.draft_length import (\n"
            "    DECAY,\n"
            "    PRIOR_RATE,\n"
            "    PRIOR_WEIGHT,\n"
            "    TOLERANCE,\n"
            "    expected_speedup,\n"
            ")\n"
        ),
        checks="minserve.course.checks_ch06",
    ),
    Chapter(
        number="07",
        slug="tensor_parallelism",
        title="Tensor parallelism",
        module="ch07_parallel_linear",
        sources=(
            "distributed/layers.py",
            "distributed/shard_model.py",
            "distributed/vocab.py",
            "distributed/layout.py",
        ),
        header=(
            '"""Chapter 07, Tensor parallelism: column- and row-parallel linear layers,\n'
            "where the attention block's all-reduce goes, the vocabulary split, and which\n"
            "heads and features each rank holds.\n\n"
            "Megatron-LM splits a linear layer over N ranks by its output features (column-\n"
            "parallel: no communication) or by its input features (row-parallel: one\n"
            "all-reduce). `comm` is the rank's `Communicator` (all_reduce, all_gather,\n"
            "gather). Plug this module into the engine with `LLM(tensor_parallel_size=3,\n"
            'plugins=CoursePlugins(tensor_parallel_layers="exercises.ch07_parallel_linear"))`:\n'
            "every rank builds\n"
            "its shard with your layers, your vocabulary blocks and your `TPLayout`.\n"
            '"""\n\n'
            "from __future__ import annotations  # 7.3 names TPLayout, which 7.5 defines\n\n"
            "import math\n"
            "from dataclasses import dataclass, replace\n"
            "from typing import Any\n\n"
            "import torch\n"
            "import torch.nn.functional as F  # noqa: F401  (your code will want it)\n"
            "from torch import nn\n\n"
            "from minserve.distributed.comm import Communicator\n"
            "from minserve.distributed.layers import even_split, meta_parameter\n"
            "from minserve.distributed.layout import TensorParallelError\n"
            "from minserve.model.llama import SelfAttention\n"
            "from minserve.model_config import ModelConfig\n"
        ),
        checks="minserve.course.checks_ch07",
    ),
    Chapter(
        number="08",
        slug="disaggregating_prefill_and_decode",
        title="Disaggregating prefill and decode",
        module="ch08_transfer_rule",
        sources=("disagg/transfer_rule.py", "disagg/hand_off.py", "disagg/simulator.py"),
        header=(
            '"""Chapter 08, Disaggregating prefill and decode: transfer or recompute, the KV\n'
            "hand-off, both sides, and the capacity simulator's event loop.\n\n"
            "After a prefill, a request's KV cache either travels to the decode instance\n"
            "(latency + bytes / bandwidth) or the decode instance computes the prompt again\n"
            "(prompt tokens x seconds per prefill token). You write `TransferRule.decide`,\n"
            "then `admit` (the decode instance takes an offered request, blocks first), then\n"
            "the hand-off's two sides: `send_prefilled` (offer, acks, blocks, free) and\n"
            "`receive_prefilled` (offers, admit, ack or refuse with a reason, blocks in).\n"
            "Plug them into the pair with `PrefillDecodePair(model, admit=admit,\n"
            "send=send_prefilled, receive=receive_prefilled)`. Last, the capacity\n"
            "simulator's event loop (`ClusterRun`: arrivals, steps, KV hand-offs); plug\n"
            "`simulate` into the planner with `search_shapes(..., simulator=simulate)`.\n"
            '"""\n\n'
            "import heapq\n"
            "import itertools\n"
            "from dataclasses import dataclass\n\n"
            "from minserve.disagg.costs import StepCosts\n"
            "from minserve.disagg.engine_hooks import add_prefilled  # noqa: F401\n"
            "from minserve.disagg.hand_off import (  # noqa: F401  (your code will want them)\n"
            "    Admit,\n"
            "    HandOffLostError,\n"
            "    receive_into_blocks,\n"
            "    refusal,\n"
            ")\n"
            "from minserve.disagg.kv_transfer import KVAck, KVOffer, KVTransfer\n"
            "from minserve.disagg.sim_instance import PlannedStep, SimInstance, SimState\n"
            "from minserve.disagg.simulator import (\n"
            "    ClusterShape,\n"
            "    RequestTimes,\n"
            "    SimConfig,\n"
            "    SimResult,\n"
            ")\n"
            "from minserve.disagg.transfer_rule import (\n"
            "    POLICIES,\n"
            "    TransferDecision,\n"
            "    log,  # noqa: F401  (to log each decision)\n"
            ")\n"
            "from minserve.disagg.workload import SimRequest\n"
            "from minserve.engine import LLMEngine\n"
            "from minserve.scheduler.sequence import Sequence\n"
        ),
        checks="minserve.course.checks_ch08",
    ),
    Chapter(
        number="09",
        slug="assembling_the_server",
        title="Assembling the server",
        module="ch09_server",
        sources=(
            "bench/serve_metrics.py",
            "router/policy.py",
            "output_processor.py",
            "stop_strings.py",
            "server/limits.py",
        ),
        header=(
            '"""Chapter 09, Assembling the server: prefix routing, streaming, goodput, stop\n'
            "strings.\n\n"
            "You write a request's TTFT, ITL and TPOT from its timestamps and the goodput of a\n"
            "run at an SLO, then `CacheAware.choose`, the router's pick of a replica (the\n"
            "longest prefix it is expected to hold, unless that replica is too busy), then\n"
            "`SampleOutput.update`, the output processor's turn of new tokens into the text\n"
            "delta a stream sends, then `StopStringMatcher`, which cuts a\n"
            "stream of text at its first stop string, then `ServerLimits`, the server's\n"
            "refusal of what a request can never get. Plug your policy into the router with\n"
            "`build_router(config, policy=CacheAware(PrefixIndex(2)))` and your outputs into\n"
            "the engine with `LLM(plugins=CoursePlugins(sample_output_cls=SampleOutput,\n"
            "stop_matcher_cls=StopStringMatcher))`; feed your timings and goodput the records\n"
            "of a load test (`run_load(...).records`), and your limits into the server with\n"
            "`build_server(llm.engine, ServerConfig(...), limits_cls=ServerLimits)`.\n"
            '"""\n\n'
            "from __future__ import annotations  # 9.4 names 9.5's StopStringMatcher\n\n"
            "from collections.abc import Sequence\n"
            "from dataclasses import dataclass\n\n"
            "from minserve.bench.serve_metrics import RequestRecord\n"
            "from minserve.messages import NewTokens\n"
            "from minserve.model.detokenizer import IncrementalDetokenizer\n"
            "from minserve.outputs import CompletionOutput\n"
            "from minserve.router.policy import Decision, _Turns\n"
            "from minserve.router.prefix_index import Key, PrefixIndex\n"
            "from minserve.sampling_params import SamplingParams\n"
            "from minserve.server.errors import APIError\n"
        ),
        checks="minserve.course.checks_ch09",
    ),
    Chapter(
        number="10",
        slug="fewer_bytes",
        title="Fewer bytes",
        module="ch10_quant_blocks",
        sources=("model/quant_blocks.py", "model/quantize_model.py", "kvcache/kv_format.py"),
        header=(
            '"""Chapter 10, Fewer bytes: GGUF\'s block formats, both ways, and the matmul that\n'
            "widens them a slice at a time.\n\n"
            "10.1 is Q8_0 (an fp16 scale and 32 int8 a block), 10.2 the 4-bit Q4_0 and Q4_1\n"
            "(two weights a byte: q_j low, q_(j+16) high), each checked byte for byte against\n"
            "the `gguf` package; 10.3 multiplies by a blocked weight without widening all of it.\n"
            'Plug them into the engine with `LLM(model=<gguf file>, quantization="gguf",\n'
            "plugins=CoursePlugins(quant_codec=QuantCodec.from_module(module)))`: every\n"
            "quantized layer then widens its blocks with your dequantize functions and\n"
            "multiplies with your matmul. 10.4 quantizes a loaded fp32 model's layers with your\n"
            "quantize functions: serve it with\n"
            "`LLM(model=loaded, plugins=CoursePlugins(quant_codec=...))`. 10.5 is the int8 KV\n"
            "cache's row: one fp16 scale per token and KV head, q = round(x / scale) in\n"
            '[-127, 127]; plug it in with `LLM(kv_cache_dtype="int8",\n'
            "plugins=CoursePlugins(kv_codec=KVCodec.from_module(module)))`: the engine then\n"
            "stores and reads every cached key and value with your two functions.\n"
            '"""\n\n'
            "import torch\n"
            "from torch import nn\n\n"
            "from minserve.kernels.cpu_ops import QUANT_BLOCK, QUANT_BLOCK_BYTES\n"
            "from minserve.kvcache.kv_format import INT8_MAX, KVCodec  # noqa: F401\n"
            "from minserve.model.quant_blocks import QuantCodec  # noqa: F401\n"
            "from minserve.model.quant_blocks import (  # noqa: F401  (your code will want them)\n"
            "    Widen,\n"
            "    as_blocks,\n"
            "    block_bytes,\n"
            "    half,\n"
            "    half_bytes,\n"
            ")\n"
            "from minserve.model.quant_blocks import Quantize\n"
            "from minserve.model.quantized_linear import QuantizedEmbedding, QuantizedLinear\n"
        ),
        checks="minserve.course.checks_ch10",
    ),
    Chapter(
        number="11",
        slug="the_state_plane",
        title="The state plane",
        module="ch11_state_plane",
        sources=(
            "kvcache/block_key.py",
            "kvcache/load_plan.py",
            "router/exact_index.py",
            "router/journal.py",
            "disagg/stage_planner.py",
        ),  # fmt: skip
        header=(
            '"""Chapter 11, The state plane: KV blocks with an identity, tiers, and a router\n'
            "that knows where they are.\n\n"
            "11.1 names a block by its content: a chained BLAKE2b key over the previous\n"
            "block's key and the block's tokens, the same in every process; plug it in with\n"
            "`LLM(enable_prefix_caching=True, kv_disk_path=..., plugins=CoursePlugins(\n"
            "block_keys=block_keys))`: the disk tier's files and the KV events then carry your\n"
            "keys. 11.2 decides how many of a prompt's leading blocks to load from lower tiers\n"
            "and how many to recompute, every cut point priced; plug it into the disk tier with\n"
            "`CoursePlugins(load_plan=plan_load)`. 11.3 keeps the router's index of every\n"
            "replica's blocks from numbered event batches that may arrive with gaps; plug it\n"
            "into the router with `build_router(config, KVAware(KVBlocks(n,\n"
            "index_cls=ExactIndex)))`. 11.4 keeps a stream's journal and rebuilds the request\n"
            "from it when its replica dies, splicing the next replica's stream into the\n"
            "client's; plug it in with `build_router(config, journal_cls=Journal)`. 11.5 plans\n"
            "live migration's pre-copy stages; a disaggregated engine's decode instances use\n"
            "yours with `cluster.migrate(request_id, rank,\n"
            'StagePolicy(planner="exercises.ch11_state_plane:next_stage"))`.\n'
            '"""\n\n'
            "from __future__ import annotations  # Journal's methods name their class\n\n"
            "import hashlib  # noqa: F401  (your code will want it)\n"
            "import json  # noqa: F401\n"
            "from collections.abc import Iterable, Sequence\n"
            "from dataclasses import dataclass, field\n"
            "from typing import Any\n\n"
            "from minserve.kvcache.block_key import KEY_BYTES, BlockKey  # noqa: F401\n"
            "from minserve.kvcache.kv_events import MEDIA, EventBatch, apply_event  # noqa: F401\n"
            "from minserve.kvcache.load_plan import DEVICE, LoadPlan, TierSpeed, check_plan\n"
            "from minserve.disagg.stage_planner import FINAL\n"
            "from minserve.router.exact_index import ReplicaBlocks\n"
            "from minserve.router.journal import (  # noqa: F401  (your code will want them)\n"
            "    IDENTITY,\n"
            "    Chunk,\n"
            "    is_one_prompt,\n"
            "    is_token_ids,\n"
            ")\n"
        ),
        checks="minserve.course.checks_ch11",
    ),
    Chapter(
        number="12",
        slug="structured_output",
        title="Structured output",
        module="ch12_structured_output",
        sources=("model/token_mask.py", "structured/choice_dfa.py", "structured/grammar_ends.py"),
        header=(
            '"""Chapter 12, Structured output: token masks, and a `choice` constraint as a DFA\n'
            "over the model's tokens.\n\n"
            "12.1 applies a token bitmask to the logits (bit j of word w is token 32 w + j);\n"
            "plug it into the sampler with\n"
            "`LLM(plugins=CoursePlugins(sampler=Sampler(bitmask_fn=apply_token_bitmask)))`.\n"
            "12.2 builds the trie of the choices' bytes as a DFA, each state's allowed tokens\n"
            "as one bitmask row (computed once), and `ChoiceMatcher`, the engine's matcher\n"
            "over them; 12.3 rolls a matcher back (speculative decoding); 12.4 finds the text\n"
            "the choices force next (jump-forward). Plug your matcher into the engine with\n"
            "`LLM(plugins=CoursePlugins(choice_matcher_cls=ChoiceMatcher))`: it then serves\n"
            "`StructuredOutputsParams(choice=[...])` instead of xgrammar.\n"
            "12.5 decides whether a grammar can end (its productive rules, by a fixpoint), on\n"
            "xgrammar's print of the compiled grammar; plug it in with\n"
            "`LLM(plugins=CoursePlugins(grammar_can_end=can_end))`: every grammar compiled\n"
            "is then refused, or not, by your test.\n"
            '"""\n\n'
            "from __future__ import annotations  # ChoiceMatcher's methods name their class\n\n"
            "from collections.abc import Iterator, Sequence  # noqa: F401\n\n"
            "import torch\n\n"
            "from minserve.structured.choice_dfa import (  # noqa: F401  (your code wants them)\n"
            "    DONE,\n"
            "    ChoiceDFA,\n"
            "    Vocabulary,\n"
            "    pack_bitmask,\n"
            "    whole_characters,\n"
            ")\n"
            "from minserve.structured.grammar_ends import (  # noqa: F401\n"
            "    Alternatives,\n"
            "    Item,\n"
            "    Token,\n"
            "    rule_tokens,\n"
            ")\n"
            "from minserve.structured.token_matcher import MatcherAfter\n"
        ),
        checks="minserve.course.checks_ch12",
    ),
)


def get_chapter(number: str) -> Chapter:
    """The chapter numbered `number` ("00", "0" or "ch00"); KeyError names the known ones."""
    wanted = number.removeprefix("ch")
    for chapter in CHAPTERS:
        if wanted.isdigit() and int(wanted) == int(chapter.number):
            return chapter
    known = ", ".join(chapter.number for chapter in CHAPTERS)
    raise KeyError(f"no chapter {number!r}; the course has chapters {known}")
