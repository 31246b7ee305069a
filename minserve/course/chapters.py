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
    slug: str  # "sampling": the notebook is chapters/00_sampling.ipynb
    title: str
    module: str  # "ch00_sampling": exercises/ch00_sampling.py, solutions/ch00_sampling.py
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
        slug="sampling",
        title="The model we serve",
        module="ch00_sampling",
        sources=("model/sampler.py",),
        header=(
            '"""Chapter 00, The model we serve: the sampler\'s filters (top-k, top-p, min-p).\n\n'
            "Each function takes logits [rows, vocab] and one setting per row, and returns new\n"
            "logits in which the tokens the filter rejects are -inf.\n"
            '"""\n\n'
            "import torch\n"
        ),
        checks="minserve.course.checks_ch00",
    ),
    Chapter(
        number="01",
        slug="block_allocator",
        title="KV cache and the block allocator",
        module="ch01_block_allocator",
        sources=("kvcache/block_allocator.py",),
        header=(
            '"""Chapter 01, KV cache and the block allocator: free list and reference counts.\n\n'
            "The paged KV pool is cut into blocks; `BlockAllocator` hands out block ids and\n"
            "counts who holds each one. Plug your class into the engine with\n"
            "`LLM(block_allocator_cls=BlockAllocator)`.\n"
            '"""\n\n'
            "from collections import deque\n\n"
            "from minserve.kvcache import NoFreeBlocksError\n"
        ),
        checks="minserve.course.checks_ch01",
    ),
    Chapter(
        number="02",
        slug="paged_attention",
        title="Paged attention",
        module="ch02_paged_attention",
        sources=("attention/triton_decode.py",),
        header=(
            '"""Chapter 02, Paged attention: the Triton decode kernel.\n\n'
            "One program attends one sequence's query heads (those sharing a KV head) over its\n"
            "keys and values, found through the block table, with an online softmax. Launch\n"
            "your kernel with `paged_decode(..., kernel=paged_decode_kernel)`; on a CPU it runs\n"
            "in Triton's interpreter (TRITON_INTERPRET=1, set by minserve.attention.triton_env).\n"
            '"""\n\n'
            "import triton\n"
            "import triton.language as tl\n\n"
            "from minserve.attention import triton_env  # noqa: F401  (before any @triton.jit)\n"
            "from minserve.attention.triton_decode import paged_decode  # noqa: F401\n"
        ),
        checks="minserve.course.checks_ch02",
    ),
    Chapter(
        number="03",
        slug="continuous_batching",
        title="Continuous batching",
        module="ch03_scheduler",
        sources=("scheduler/scheduler.py",),
        header=(
            '"""Chapter 03, Continuous batching: the scheduler that builds every step\'s batch.\n\n'
            "Each step, running sequences go first (decodes, then prefill chunks), preempting\n"
            "when the KV cache runs out of blocks; then waiting ones are admitted in policy\n"
            "order while the token budget, the seats and the blocks last. Plug your class\n"
            "into the engine with `LLM(scheduler_cls=Scheduler)`.\n"
            '"""\n\n'
            "from collections.abc import Callable\n\n"
            "from minserve.config import SchedulerConfig\n"
            "from minserve.kvcache.manager import KVCacheManager\n"
            "from minserve.messages import (\n"
            "    ModelRunnerOutput,\n"
            "    NewTokens,\n"
            "    SampledTokens,\n"
            "    ScheduledChunk,\n"
            "    SchedulerOutput,\n"
            ")\n"
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
        sources=("scheduler/budget.py", "scheduler/preemption.py"),
        header=(
            '"""Chapter 04, Chunked prefill and preemption: the scheduler\'s two decisions\n'
            "when time or memory runs short.\n\n"
            "`prefill_chunk`: how many tokens a sequence computes out of what is left of the\n"
            "step's token budget (Sarathi-Serve's chunked prefill). `preemption_mode`:\n"
            "whether a preempted sequence's blocks go to the host swap space or are freed and\n"
            "recomputed (vLLM). Plug yours into the engine with\n"
            "`LLM(chunk_rule=prefill_chunk, preemption_rule=preemption_mode)`.\n"
            '"""\n\n'
            "from minserve.scheduler.preemption import PreemptionMode\n"
        ),
        checks="minserve.course.checks_ch04",
    ),
    Chapter(
        number="05",
        slug="sharing_prefixes",
        title="Sharing prefixes",
        module="ch05_radix_cache",
        sources=("kvcache/radix_cache.py",),
        header=(
            '"""Chapter 05, Sharing prefixes: the radix tree of the prefix cache.\n\n'
            "A radix tree over token ids at block granularity (SGLang's RadixAttention): you\n"
            "write `match_prefix`, `insert` and `evict`. Plug your class into the engine with\n"
            "`LLM(enable_prefix_caching=True, prefix_cache_cls=RadixCache)`.\n"
            '"""\n\n'
            "import heapq\n"
            "import itertools\n\n"
            "from minserve.kvcache.block_allocator import BlockAllocator\n"
            "from minserve.kvcache.radix_cache import PrefixMatch, RadixNode\n"
        ),
        checks="minserve.course.checks_ch05",
    ),
    Chapter(
        number="06",
        slug="speculative_decoding",
        title="Sampling and speculative decoding",
        module="ch06_rejection_sampling",
        sources=("speculative/verify.py",),
        header=(
            '"""Chapter 06, Sampling and speculative decoding: verifying a draft distribution.\n\n'
            "A draft q proposes tokens; the target p keeps each with probability min(1, p/q)\n"
            "and, at the first rejection, draws from the residual max(0, p - q) normalised, so\n"
            "every token returned is distributed exactly as p (Leviathan et al., Chen et al.).\n"
            '"""\n\n'
            "import torch\n"
        ),
        checks="minserve.course.checks_ch06",
    ),
    Chapter(
        number="07",
        slug="tensor_parallelism",
        title="Tensor parallelism",
        module="ch07_parallel_linear",
        sources=("distributed/layers.py",),
        header=(
            '"""Chapter 07, Tensor parallelism: column- and row-parallel linear layers.\n\n'
            "Megatron-LM splits a linear layer over N ranks by its output features (column-\n"
            "parallel: no communication) or by its input features (row-parallel: one\n"
            "all-reduce). `comm` is the rank's `Communicator` (all_reduce, all_gather).\n"
            '"""\n\n'
            "import torch\n"
            "import torch.nn.functional as F  # noqa: F401  (your code will want it)\n"
            "from torch import nn\n\n"
            "from minserve.distributed.comm import Communicator\n"
            "from minserve.distributed.layers import even_split, meta_parameter\n"
        ),
        checks="minserve.course.checks_ch07",
    ),
    Chapter(
        number="08",
        slug="disaggregating_prefill_and_decode",
        title="Disaggregating prefill and decode",
        module="ch08_transfer_rule",
        sources=("disagg/transfer_rule.py", "disagg/pd_worker.py"),
        header=(
            '"""Chapter 08, Disaggregating prefill and decode: transfer or recompute, and the\n'
            "decode side of the KV hand-off.\n\n"
            "After a prefill, a request's KV cache either travels to the decode instance\n"
            "(latency + bytes / bandwidth) or the decode instance computes the prompt again\n"
            "(prompt tokens x seconds per prefill token). You write `TransferRule.decide`,\n"
            "then `admit`: the decode instance takes an offered request, blocks first.\n"
            '"""\n\n'
            "from dataclasses import dataclass\n\n"
            "from minserve.disagg.engine_hooks import add_prefilled  # noqa: F401\n"
            "from minserve.disagg.kv_transfer import KVOffer\n"
            "from minserve.disagg.transfer_rule import (\n"
            "    POLICIES,\n"
            "    TransferDecision,\n"
            "    log,  # noqa: F401  (to log each decision)\n"
            ")\n"
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
        sources=("router/policy.py", "output_processor.py"),
        header=(
            '"""Chapter 09, Assembling the server: routing by cached prefix, and streaming.\n\n'
            "You write `CacheAware.choose`, the router's pick of a replica (the longest prefix\n"
            "it is expected to hold, unless that replica is too busy), then\n"
            "`SampleOutput.update`, the output processor's turn of new tokens into the text\n"
            "delta a stream sends. Plug your policy into the router with\n"
            "`build_router(config, policy=CacheAware(PrefixIndex(2)))` and your outputs into\n"
            "the engine with `LLM(sample_output_cls=SampleOutput)`.\n"
            '"""\n\n'
            "from collections.abc import Sequence\n"
            "from dataclasses import dataclass\n\n"
            "from minserve.messages import NewTokens\n"
            "from minserve.model.detokenizer import IncrementalDetokenizer\n"
            "from minserve.outputs import CompletionOutput\n"
            "from minserve.router.policy import Decision, _Turns\n"
            "from minserve.router.prefix_index import Key, PrefixIndex\n"
            "from minserve.stop_strings import StopStringMatcher\n"
        ),
        checks="minserve.course.checks_ch09",
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
