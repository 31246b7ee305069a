"""KV-cache memory utilization: tokens stored over slots reserved, paged against contiguous.

A contiguous KV cache reserves each request's whole buffer when the request is admitted:
`max_model_len` slots (Hugging Face, FasterTransformer), or at best `prompt + max_tokens`
(Orca with an oracle). PagedAttention (Kwon et al., 2023) allocates a block when the
sequence needs it, so only the last, partly filled block of a sequence has empty slots.

Two measurements, used by chapter 01 and `benchmarks/kv_utilization.py`:
- `kv_utilization`: on paper, for a workload of (prompt_len, output_len) pairs;
- `measure_engine`: from a real engine run, reading the allocator and the block tables.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from minserve.engine import LLMEngine
from minserve.kvcache.block_table import BlockTable
from minserve.sampling_params import SamplingParams

Workload = Sequence[tuple[int, int]]  # (prompt_len, output_len) per request


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Paged:
    """PagedAttention: blocks come as the sequence grows; only its last block has empty slots."""

    block_size: int = 16

    @property
    def label(self) -> str:
        return f"paged, block_size={self.block_size}"

    def reserved(self, prompt_len: int, output_len: int, length: int) -> int:
        return _ceil_to(length, self.block_size)


@dataclass(frozen=True)
class ContiguousMaxLen:
    """One buffer of `max_model_len` slots per request, reserved when it is admitted."""

    max_model_len: int = 2048

    @property
    def label(self) -> str:
        return f"contiguous, max_model_len={self.max_model_len}"

    def reserved(self, prompt_len: int, output_len: int, length: int) -> int:
        return self.max_model_len


@dataclass(frozen=True)
class ContiguousMaxTokens:
    """One buffer of prompt + max_tokens slots per request (max_tokens = the output length:
    the best a contiguous cache can do, Orca's "oracle")."""

    @property
    def label(self) -> str:
        return "contiguous, prompt + max_tokens"

    def reserved(self, prompt_len: int, output_len: int, length: int) -> int:
        return prompt_len + output_len


Layout = Paged | ContiguousMaxLen | ContiguousMaxTokens


@dataclass(frozen=True)
class Utilization:
    """One layout on one workload, summed over every step of every request."""

    label: str
    tokens_stored: int  # sum over (request, step) of the tokens in its KV cache
    slots_reserved: int  # sum over (request, step) of the slots set aside for it
    request_steps: int  # number of (request, step) pairs: the sum of output lengths
    budget_tokens: int  # KV slots available

    @property
    def utilization(self) -> float:
        """Fraction of reserved slots that hold a token, at a random moment."""
        return self.tokens_stored / self.slots_reserved

    @property
    def requests_fit(self) -> int:
        """Requests the budget holds at once: budget / slots a request reserves on average."""
        return self.budget_tokens * self.request_steps // self.slots_reserved


def request_lengths(prompt_len: int, output_len: int) -> range:
    """Tokens in a request's KV cache at each of its steps: the prefill computes the prompt,
    each later step one generated token; the last sampled token's KV is never computed."""
    if prompt_len < 1 or output_len < 1:
        raise ValueError(
            f"need prompt_len >= 1 and output_len >= 1, got {prompt_len}, {output_len}"
        )
    return range(prompt_len, prompt_len + output_len)


def kv_utilization(workload: Workload, layout: Layout, budget_tokens: int) -> Utilization:
    """Tokens stored / slots reserved for `layout` over the lives of the workload's requests,
    and how many such requests a budget of `budget_tokens` KV slots holds at once."""
    stored = reserved = steps = 0
    for i, (prompt_len, output_len) in enumerate(workload):
        total = prompt_len + output_len
        if layout.reserved(prompt_len, output_len, total) < total:
            raise ValueError(f"request {i} needs {total} tokens; {layout.label} cannot hold it")
        for length in request_lengths(prompt_len, output_len):
            stored += length
            reserved += layout.reserved(prompt_len, output_len, length)
        steps += output_len
    if steps == 0:
        raise ValueError("the workload is empty")
    return Utilization(layout.label, stored, reserved, steps, budget_tokens)


def compare_layouts(
    workload: Workload, layouts: Iterable[Layout], budget_tokens: int
) -> list[Utilization]:
    """`kv_utilization` for each layout, in order."""
    return [kv_utilization(workload, layout, budget_tokens) for layout in layouts]


# ---------------------------------------------------------------- the real engine


def tokens_stored(tables: Iterable[BlockTable]) -> int:
    """Distinct pool slots holding a token: a block shared by forked sequences counts once."""
    filled: dict[int, int] = {}  # physical block -> slots in use
    for table in tables:
        for i, block in enumerate(table.blocks):
            in_block = min(table.block_size, table.num_tokens - i * table.block_size)
            filled[block] = max(filled.get(block, 0), in_block)
    return sum(filled.values())


@dataclass(frozen=True)
class PoolSnapshot:
    """The KV pool after one engine step, read from the allocator and the block tables."""

    tokens_stored: int  # slots holding a token
    slots_reserved: int  # allocated blocks x block_size
    num_seqs: int  # sequences holding blocks
    contiguous_max_tokens: int  # what prompt + max_tokens buffers would reserve for them

    @property
    def utilization(self) -> float:
        return self.tokens_stored / self.slots_reserved if self.slots_reserved else 1.0


def pool_snapshot(engine: LLMEngine) -> PoolSnapshot:
    """Read the engine's pool now: allocated blocks from the allocator, tokens from the tables."""
    holding = [
        s for s in engine.scheduler.running + engine.scheduler.waiting if s.block_table.blocks
    ]
    allocator = engine.kv.allocator
    return PoolSnapshot(
        tokens_stored=tokens_stored(s.block_table for s in holding),
        slots_reserved=(allocator.num_blocks - allocator.num_free) * engine.kv.block_size,
        num_seqs=len(holding),
        contiguous_max_tokens=sum(
            len(s.sample.prompt_token_ids) + (s.sample.params.max_tokens or 0) for s in holding
        ),
    )


@dataclass(frozen=True)
class EngineRun:
    """Snapshots of the pool after every step of one run, and the pool's size."""

    snapshots: list[PoolSnapshot]
    pool_slots: int  # num_blocks x block_size
    max_model_len: int
    num_preemptions: int

    @property
    def peak(self) -> PoolSnapshot:
        """The step at which the most slots were reserved."""
        return max(self.snapshots, key=lambda s: s.slots_reserved)

    @property
    def mean_utilization(self) -> float:
        """Tokens stored / slots reserved, summed over all steps."""
        reserved = sum(s.slots_reserved for s in self.snapshots)
        return sum(s.tokens_stored for s in self.snapshots) / reserved

    @property
    def max_seqs(self) -> int:
        """The most sequences that held KV at once."""
        return max(s.num_seqs for s in self.snapshots)

    def contiguous_utilization(self, snapshot: PoolSnapshot) -> dict[str, float]:
        """What contiguous buffers would have used for the same sequences at that step."""
        return {
            ContiguousMaxLen(self.max_model_len).label: snapshot.tokens_stored
            / (snapshot.num_seqs * self.max_model_len),
            ContiguousMaxTokens().label: snapshot.tokens_stored / snapshot.contiguous_max_tokens,
        }


def measure_engine(
    engine: LLMEngine, prompts: Sequence[list[int]], output_lens: Sequence[int]
) -> EngineRun:
    """Run greedy requests (EOS ignored, exactly `output_lens` tokens each) to completion,
    reading the pool after every step."""
    for i, (prompt, output_len) in enumerate(zip(prompts, output_lens, strict=True)):
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        engine.add_request(f"kv-{i}", None, list(prompt), params)
    preemptions_before = engine.scheduler.stats.num_preemptions
    snapshots = []
    while engine.has_unfinished_requests():
        engine.step()
        snapshots.append(pool_snapshot(engine))
    allocator = engine.kv.allocator
    return EngineRun(
        snapshots=[s for s in snapshots if s.slots_reserved],
        pool_slots=allocator.num_blocks * engine.kv.block_size,
        max_model_len=engine.max_model_len,
        num_preemptions=engine.scheduler.stats.num_preemptions - preemptions_before,
    )
