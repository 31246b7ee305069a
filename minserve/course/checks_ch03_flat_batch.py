"""Checks for exercise 3.4, one step's flat batch, run against any module that defines
`flat_batch`: minserve's own (`minserve.model.runner`), the solutions, or a student's file.

Two steps worked out on paper (a decode beside prefill chunks that cross a block boundary;
speculative drafts and prompt-logprob rows), then random steps against a token-by-token
layout written here (hypothesis), then the oracle that matters: a tiny random Llama run
through minserve's `ModelRunner` on your flat batches, step after step over a paged pool,
must give every logits row the logits its sequence gets when run alone, contiguously.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch
from hypothesis import given
from hypothesis import strategies as st

from minserve.attention.contiguous import ContiguousAttention, ContiguousSlice, SequenceKV
from minserve.attention.paged_torch import TorchPagedAttention
from minserve.course.nonfinite import lead_with_nonfinite
from minserve.course.randomized import randomized
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.messages import ScheduledChunk
from minserve.model.llama import CausalLM
from minserve.model.runner import ModelInputs, ModelRunner
from minserve.model.sampler import SamplingRow
from minserve.model_config import ModelConfig
from minserve.sampling_params import SamplingParams

ROW = SamplingRow(SamplingParams(), (), (), None)  # a chunk that samples has one or more


def _chunk(
    seq_id: int,
    token_ids: tuple[int, ...],
    start: int,
    block_table: tuple[int, ...],
    samples: int = 0,
    prompt_targets: tuple[int, ...] = (),
) -> ScheduledChunk:
    return ScheduledChunk(
        seq_id=seq_id,
        request_id=f"s{seq_id}",
        token_ids=token_ids,
        start=start,
        block_table=block_table,
        samples=(ROW,) * samples,
        num_prompt_tokens=start + len(token_ids),
        prompt_logprobs=1 if prompt_targets else 0,
        prompt_targets=prompt_targets,
    )


def _describe(chunks: list[ScheduledChunk], drafts: dict[int, list[int]]) -> str:
    parts = []
    for c in chunks:
        extra = f", drafts {drafts[c.seq_id]}" if c.seq_id in drafts else ""
        extra += f", {len(c.samples)} sample row(s)" if c.samples else ""
        extra += f", {len(c.prompt_targets)} prompt-logprob row(s)" if c.prompt_targets else ""
        parts.append(
            f"seq {c.seq_id}: tokens {list(c.token_ids)} from position {c.start}, "
            f"blocks {list(c.block_table)}{extra}"
        )
    return "; ".join(parts)


class _Recorder:
    """A `to_device` that keeps what it returned, to see that every tensor went through it."""

    def __init__(self) -> None:
        self.moved: list[torch.Tensor] = []

    def __call__(self, host: torch.Tensor) -> torch.Tensor:
        self.moved.append(host.clone())
        return self.moved[-1]

    def went_through(self, tensor: torch.Tensor) -> bool:
        return any(tensor is moved for moved in self.moved)


def _layout(
    impl: ModuleType, chunks: list[ScheduledChunk], drafts: dict[int, list[int]], block_size: int
) -> tuple[ModelInputs, _Recorder]:
    """Your flat batch of `chunks`, and the `to_device` it was given."""
    recorder = _Recorder()
    return impl.flat_batch(chunks, drafts, block_size, recorder), recorder


# what each field means, for the message when it is wrong
MEANING = {
    "input_ids": "each chunk's tokens, then its drafts, chunk after chunk",
    "positions": "chunk c's tokens sit at positions c.start, c.start + 1, ...",
    "slot_mapping": "token p's slot is block_table[p // block_size] * block_size + p % block_size",
    "query_start_loc": "where each chunk's tokens start in the flat batch, then the total",
    "context_lens": "the tokens each chunk's sequence has cached after the step: its start "
    "plus the tokens it computes",
    "block_tables": "each chunk's block table, padded with 0 to the longest",
    "sample_indices": "the logits rows: sampling rows first (a chunk with drafts: its token "
    "and each draft; another sampling chunk: its last token), then every chunk's "
    "prompt-logprob rows",
}


def _fields(inputs: ModelInputs) -> dict[str, list]:
    md = inputs.metadata
    return {
        "input_ids": inputs.input_ids.tolist(),
        "positions": inputs.positions.tolist(),
        "slot_mapping": md.slot_mapping.tolist(),
        "query_start_loc": md.query_start_loc.tolist(),
        "context_lens": md.context_lens.tolist(),
        "block_tables": md.block_tables.tolist(),
        "sample_indices": inputs.sample_indices.tolist(),
    }


def _assert_fields(got: ModelInputs, expected: dict[str, list], what: str) -> None:
    fields = _fields(got)
    for name, want in expected.items():
        assert fields[name] == want, (
            f"{what}: expected {name} {want}, got {fields[name]} ({MEANING[name]})"
        )


def _assert_moved(inputs: ModelInputs, recorder: _Recorder, what: str) -> None:
    md = inputs.metadata
    indices = {
        "input_ids": inputs.input_ids,
        "positions": inputs.positions,
        "sample_indices": inputs.sample_indices,
    }
    tensors = {**indices, "metadata.slot_mapping": md.slot_mapping}
    tensors["metadata.block_tables"] = md.block_tables
    astray = [name for name, tensor in tensors.items() if not recorder.went_through(tensor)]
    assert not astray, (
        f"{what}: {', '.join(astray)} did not come from to_device (on a GPU the model would "
        "find them on the host): pass every tensor through to_device, and give "
        "AttentionMetadata.build to_device=to_device"
    )
    wrong = {name: str(t.dtype) for name, t in indices.items() if t.dtype != torch.long}
    assert not wrong, f"{what}: expected torch.int64 (torch.long) tensors, got {wrong}"


def check_a_decode_and_prefill_chunks_lie_end_to_end(impl: ModuleType) -> None:
    """A decode, a prompt chunk over a block boundary and a short prompt, in one flat batch."""
    chunks = [
        _chunk(1, (42,), start=9, block_table=(5, 2, 7), samples=1),  # a decode
        _chunk(2, (11, 12, 13, 14, 15, 16), start=4, block_table=(3, 6, 1)),  # mid-prompt
        _chunk(3, (7, 8, 9), start=0, block_table=(0,), samples=1),  # a whole prompt
    ]
    inputs, recorder = _layout(impl, chunks, {}, block_size=4)
    what = f"blocks of 4 tokens; {_describe(chunks, {})}"
    _assert_fields(
        inputs,
        {
            "input_ids": [42, 11, 12, 13, 14, 15, 16, 7, 8, 9],
            "positions": [9, 4, 5, 6, 7, 8, 9, 0, 1, 2],
            "slot_mapping": [29, 24, 25, 26, 27, 4, 5, 0, 1, 2],
            "query_start_loc": [0, 1, 7, 10],
            "context_lens": [10, 10, 3],
            "block_tables": [[5, 2, 7], [3, 6, 1], [0, 0, 0]],
            "sample_indices": [0, 9],
        },
        what,
    )
    _assert_moved(inputs, recorder, what)


def check_drafts_and_prompt_logprob_rows_come_in_order(impl: ModuleType) -> None:
    """A decode with 2 drafts gets 3 logits rows; prompt-logprob rows come after all sampling."""
    chunks = [
        _chunk(1, (5,), start=6, block_table=(2, 3, 4), samples=1),
        _chunk(2, (20, 21, 22, 23), start=4, block_table=(0, 1), samples=1,
               prompt_targets=(21, 22, 23)),  # the prompt's end: its last token predicts output
        _chunk(3, (30, 31), start=0, block_table=(5,), prompt_targets=(31, 32)),
    ]  # fmt: skip
    drafts = {1: [8, 9]}
    inputs, _ = _layout(impl, chunks, drafts, block_size=4)
    _assert_fields(
        inputs,
        {
            "input_ids": [5, 8, 9, 20, 21, 22, 23, 30, 31],
            "positions": [6, 7, 8, 4, 5, 6, 7, 0, 1],
            "slot_mapping": [14, 15, 16, 4, 5, 6, 7, 20, 21],
            "query_start_loc": [0, 3, 7, 9],
            "context_lens": [9, 8, 2],
            "sample_indices": [0, 1, 2, 6, 3, 4, 5, 7, 8],
        },
        f"blocks of 4 tokens; {_describe(chunks, drafts)}",
    )


# --- random steps against a token-by-token layout -------------------------------------------


@dataclass(frozen=True)
class Step:
    """One step's chunks (with drafts) over blocks of `block_size` tokens."""

    block_size: int
    chunks: tuple[ScheduledChunk, ...]
    drafts: tuple[tuple[int, tuple[int, ...]], ...]

    def __str__(self) -> str:
        return f"blocks of {self.block_size} tokens; {_describe(list(self.chunks), self.draft_map)}"

    @property
    def draft_map(self) -> dict[int, list[int]]:
        return {seq_id: list(tokens) for seq_id, tokens in self.drafts}


@st.composite
def steps(draw: st.DrawFn) -> Step:
    block_size = draw(st.integers(1, 4))
    free = random.Random(draw(st.integers(0, 2**16))).sample(range(64), 64)  # block ids
    chunks, drafts = [], []
    for seq_id in range(draw(st.integers(1, 5))):
        start, n = draw(st.integers(0, 12)), draw(st.integers(1, 6))
        samples = draw(st.integers(0, 2))
        own = draw(st.integers(0, 3)) if n == 1 and samples == 1 else 0
        targets = 0 if own else draw(st.integers(0, n))
        need = -(-(start + n + own) // block_size)  # blocks covering every token
        table, free = tuple(free[:need]), free[need:]
        tokens = tuple(draw(st.lists(st.integers(0, 99), min_size=n, max_size=n)))
        chunks.append(_chunk(seq_id, tokens, start, table, samples, tokens[:targets]))
        if own:
            drafts.append((seq_id, tuple(range(100, 100 + own))))
    return Step(block_size, tuple(chunks), tuple(drafts))


def _token_by_token(step: Step) -> dict[str, list]:
    """The flat batch, one token at a time: what each field must hold."""
    ids, positions, slots, starts, context, rows, prompt_rows = [], [], [], [0], [], [], []
    for c in step.chunks:
        own = step.draft_map.get(c.seq_id, [])
        for i, token in enumerate([*c.token_ids, *own]):
            position = c.start + i
            block = c.block_table[position // step.block_size]
            ids.append(token)
            positions.append(position)
            slots.append(block * step.block_size + position % step.block_size)
            if i < len(c.prompt_targets):
                prompt_rows.append(len(ids) - 1)
            if (own and i >= len(c.token_ids) - 1) or (c.samples and i == len(c.token_ids) - 1):
                rows.append(len(ids) - 1)
        starts.append(len(ids))
        context.append(positions[-1] + 1)
    width = max(len(c.block_table) for c in step.chunks)
    return {
        "input_ids": ids,
        "positions": positions,
        "slot_mapping": slots,
        "query_start_loc": starts,
        "context_lens": context,
        "block_tables": [list(c.block_table) + [0] * (width - len(c.block_table))
                         for c in step.chunks],
        "sample_indices": rows + prompt_rows,
    }  # fmt: skip


def check_random_steps_match_a_token_by_token_layout(impl: ModuleType) -> None:
    """Random chunks, block sizes, drafts and prompt-logprob rows: each token where it belongs"""

    @randomized(80)
    @given(steps())
    def lay_out(step: Step) -> None:
        inputs, _ = _layout(impl, list(step.chunks), step.draft_map, step.block_size)
        _assert_fields(inputs, _token_by_token(step), str(step))

    lay_out()


# --- the oracle: a tiny Llama on your flat batches, each sequence as if alone ----------------

BLOCK_SIZE = 4


@cache
def _tiny_llama() -> CausalLM:
    """A seeded random 2-layer Llama (GQA: 6 query heads over 2 KV heads)."""
    config = ModelConfig(
        architecture="llama", vocab_size=64, hidden_size=48, intermediate_size=96,
        num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm weights
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5)
    return model


SEQUENCES = {  # each sequence's whole token list, computed chunk by chunk below
    1: [3, 17, 40, 8, 61, 25, 9, 33, 50, 12, 7, 44, 2],
    2: [55, 6, 19, 28, 37, 46, 1, 10, 23, 31, 42, 58, 14, 5, 27],
    3: [11, 29, 47, 60, 4, 16],
}
# (seq, start, end, samples, drafts, prompt-logprob rows) per chunk, per step: prefills,
# an extend beside a decode, a decode verifying drafts, a recompute of a whole sequence
STEPS = [
    [(1, 0, 8, 1, 0, 0), (2, 0, 5, 0, 0, 5)],
    [(1, 8, 9, 1, 2, 0), (2, 5, 12, 1, 0, 6), (3, 0, 3, 1, 0, 0)],
    [(3, 3, 4, 1, 0, 0), (2, 12, 13, 1, 2, 0), (1, 11, 12, 1, 0, 0)],
    [(3, 0, 6, 1, 0, 3)],  # seq 3 again from its first token (a recompute)
]


def _contiguous_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """One sequence alone, in a contiguous cache: logits at every position [n, vocab]."""
    n = len(ids)
    kv = SequenceKV(model.config, n, torch.float32, torch.device("cpu"))
    attention = ContiguousAttention([ContiguousSlice(kv, 0, n)])
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), attention))


def _rows_of(step: list[tuple]) -> list[tuple[int, int, str]]:
    """(seq, position, kind) of each logits row the step must return, in order."""
    sampling, prompt = [], []
    for seq, start, end, samples, drafts, targets in step:
        if drafts:
            sampling += [(seq, p, "draft row") for p in range(end - 1, end + drafts)]
        elif samples:
            sampling.append((seq, end - 1, "sampling row"))
        prompt += [(seq, p, "prompt-logprob row") for p in range(start, start + targets)]
    return sampling + prompt


@torch.inference_mode()
def check_a_tiny_llama_on_your_flat_batches_matches_each_sequence_alone(impl: ModuleType) -> None:
    """A tiny Llama over your flat batches: every logits row as its sequence run alone."""
    model = _tiny_llama()
    pool = PagedKVPool(model.config, 24, BLOCK_SIZE, torch.float32, "cpu")
    runner = ModelRunner(model, pool, TorchPagedAttention)
    runner.use_flat_batch(impl.flat_batch)
    alone = {seq: _contiguous_logits(model, ids) for seq, ids in SEQUENCES.items()}
    free = [17, 3, 22, 8, 0, 13, 5, 20, 11, 2, 15, 7, 23, 9, 1, 18]
    tables: dict[int, list[int]] = {seq: [] for seq in SEQUENCES}
    for number, step in enumerate(STEPS):
        chunks, drafts = [], {}
        for seq, start, end, samples, own, targets in step:
            ids = SEQUENCES[seq]
            while len(tables[seq]) * BLOCK_SIZE < end + own:
                tables[seq].append(free.pop())
            chunks.append(_chunk(seq, tuple(ids[start:end]), start, tuple(tables[seq]),
                                 samples, tuple(ids[start + 1 : start + 1 + targets])))  # fmt: skip
            if own:
                drafts[seq] = ids[end : end + own]
        logits = runner.forward(runner.prepare(chunks, drafts))  # [rows, vocab]
        rows = _rows_of(step)
        what = f"step {number} ({_describe(chunks, drafts)}; blocks of {BLOCK_SIZE} tokens)"
        assert logits.shape[0] == len(rows), (
            f"{what}: expected {len(rows)} logits rows {rows} (sequence, position, kind), "
            f"got {logits.shape[0]}: look at sample_indices"
        )
        for i, (seq, position, kind) in enumerate(rows):
            error = (logits[i] - alone[seq][position]).abs().max().item()
            assert error < 1e-4, lead_with_nonfinite(
                logits[i],
                f"{what}: logits row {i}, the {kind} of sequence {seq} at position "
                f"{position}, differs from the logits of sequence {seq} run alone by "
                f"{error:.3g} (expected < 1e-4): its token, its position, the slots its "
                "keys went to, or the context it attends over are not the sequence's",
            )


FLAT_BATCH_CHECKS: list[Callable[[ModuleType], None]] = [
    check_a_decode_and_prefill_chunks_lie_end_to_end,
    check_drafts_and_prompt_logprob_rows_come_in_order,
    check_random_steps_match_a_token_by_token_layout,
    check_a_tiny_llama_on_your_flat_batches_matches_each_sequence_alone,
]

FLAT_BATCH_PROGRESS = "each pass must move on to the next chunk"

FLAT_BATCH_HINTS = (
    "Continuous batching runs every sequence of the step in one forward: their tokens are "
    "laid end to end in one flat list, with no padding, and everything that tells the "
    "sequences apart goes into side lists: where each token sits in its own sequence "
    "(its position), where its key and value go in the paged pool (its slot), how many "
    "tokens each sequence computes and sees, and which tokens need logits.",
    "One loop over the chunks, appending to plain Python lists: a chunk's tokens are "
    "c.token_ids followed by its drafts; their positions run from c.start; each position "
    "maps to a slot through slot_of; each chunk adds one query length, one context length "
    "(start plus its tokens) and its block table. Keep two row lists, sampling rows and "
    "prompt-logprob rows, and join them at the end. Then AttentionMetadata.build and "
    "ModelInputs, each tensor through to_device.",
    "Note the chunk's first flat index before adding its tokens, and its last after. With "
    "drafts, the rows are range(last - len(drafts), last + 1); else, when c.samples is not "
    "empty, the row is last; the prompt rows are range(first, first + "
    "len(c.prompt_targets)). Build the metadata from query_lens, context_lens, "
    "block_tables (lists) and the slots with to_device=to_device; input_ids, positions and "
    "sample_indices + prompt_rows become torch.long tensors.",
)
