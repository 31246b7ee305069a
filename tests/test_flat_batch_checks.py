"""Exercise 3.4's checks: the solutions pass them, and the usual wrong flat batches are caught
with a message that names the field (or the logits row) that went wrong."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable

import pytest
import torch

from minserve.attention.metadata import AttentionMetadata
from minserve.course import checks_ch03_flat_batch as checks
from minserve.model import runner
from minserve.model.runner import ModelInputs, slot_of

Fix = Callable[[list, dict, int, ModelInputs], ModelInputs]


def _student(fix: Fix, drop_drafts: bool = False) -> types.SimpleNamespace:
    """minserve's flat batch with one mistake put back in by `fix`."""

    def flat_batch(chunks, drafts, block_size, to_device) -> ModelInputs:
        chunks = list(chunks)
        drafts = {} if drop_drafts else drafts
        inputs = runner.flat_batch(chunks, drafts, block_size, to_device)
        return fix(chunks, drafts, block_size, inputs)

    return types.SimpleNamespace(flat_batch=flat_batch)


def _metadata(md: AttentionMetadata, **lists: list) -> AttentionMetadata:
    """The same metadata with some of its per-sequence lists changed."""
    given = {
        "query_lens": md.query_lens_list(),
        "context_lens": md.context_lens_list(),
        "block_tables": md.block_tables.tolist(),
        "slot_mapping": md.slot_mapping.tolist(),
    }
    return AttentionMetadata.build(**{**given, **lists})


def _positions_from_zero(chunks, drafts, block_size, inputs) -> ModelInputs:
    """Forgets the cached prefix: every chunk counts its positions (and slots) from 0."""
    spans = [range(q) for q in inputs.metadata.query_lens_list()]
    positions = [p for span in spans for p in span]
    slots = [slot_of(c.block_table, block_size, p) for c, s in zip(chunks, spans) for p in s]
    metadata = _metadata(inputs.metadata, slot_mapping=slots)
    return dataclasses.replace(inputs, positions=torch.tensor(positions), metadata=metadata)


def _slot_without_block_size(chunks, drafts, block_size, inputs) -> ModelInputs:
    """block_table[p // block_size] + p % block_size: a block id taken for a slot."""
    slots = [
        c.block_table[p // block_size] + p % block_size
        for c, q in zip(chunks, inputs.metadata.query_lens_list())
        for p in range(c.start, c.start + q)
    ]
    return dataclasses.replace(inputs, metadata=_metadata(inputs.metadata, slot_mapping=slots))


def _context_is_the_query(chunks, drafts, block_size, inputs) -> ModelInputs:
    """The context length of a chunk taken as its own tokens: the cached prefix is unseen."""
    md = inputs.metadata
    return dataclasses.replace(inputs, metadata=_metadata(md, context_lens=md.query_lens_list()))


def _prompt_rows_interleaved(chunks, drafts, block_size, inputs) -> ModelInputs:
    """Each chunk's prompt-logprob rows right before its sampling rows, not after them all."""
    rows, first = [], 0
    for c, q in zip(chunks, inputs.metadata.query_lens_list()):
        own = len(drafts.get(c.seq_id, ()))
        rows += range(first, first + len(c.prompt_targets))
        if own or c.samples:  # the chunk's last token, and its drafts before it
            rows += range(first + q - 1 - own, first + q)
        first += q
    return dataclasses.replace(inputs, sample_indices=torch.tensor(rows))


def _host_tensors(chunks, drafts, block_size, inputs) -> ModelInputs:
    """Tensors built where they are, never handed to to_device."""
    return dataclasses.replace(inputs, input_ids=inputs.input_ids.clone())


def test_the_solutions_pass_every_flat_batch_check() -> None:
    import solutions.ch03_scheduler as solutions

    for check in checks.FLAT_BATCH_CHECKS:
        check(solutions)


@pytest.mark.parametrize(
    ("check", "student", "says"),
    [
        (
            checks.check_a_decode_and_prefill_chunks_lie_end_to_end,
            _student(_positions_from_zero),
            "expected positions [9, 4, 5, 6, 7, 8, 9, 0, 1, 2], got [0, 0, 1, 2, 3, 4, 5, 0",
        ),
        (
            checks.check_a_decode_and_prefill_chunks_lie_end_to_end,
            _student(_slot_without_block_size),
            "expected slot_mapping [29, 24, 25, 26, 27, 4, 5, 0, 1, 2], got [8, 6, 7, 8, 9,",
        ),
        (
            checks.check_a_decode_and_prefill_chunks_lie_end_to_end,
            _student(_context_is_the_query),
            "expected context_lens [10, 10, 3], got [1, 6, 3] (the tokens each chunk's",
        ),
        (
            checks.check_a_decode_and_prefill_chunks_lie_end_to_end,
            _student(_host_tensors),
            "input_ids did not come from to_device",
        ),
        (
            checks.check_drafts_and_prompt_logprob_rows_come_in_order,
            _student(_prompt_rows_interleaved),
            "expected sample_indices [0, 1, 2, 6, 3, 4, 5, 7, 8], got [0, 1, 2, 3, 4, 5, 6, 7, 8]",
        ),
        (
            checks.check_drafts_and_prompt_logprob_rows_come_in_order,
            _student(lambda chunks, drafts, block_size, inputs: inputs, drop_drafts=True),
            "expected input_ids [5, 8, 9, 20, 21, 22, 23, 30, 31], got [5, 20, 21, 22, 23, 30",
        ),
        (
            checks.check_random_steps_match_a_token_by_token_layout,
            _student(_slot_without_block_size),
            "expected slot_mapping",
        ),
        (
            checks.check_a_tiny_llama_on_your_flat_batches_matches_each_sequence_alone,
            _student(_context_is_the_query),
            "differs from the logits of sequence",
        ),
        (
            checks.check_a_tiny_llama_on_your_flat_batches_matches_each_sequence_alone,
            _student(lambda chunks, drafts, block_size, inputs: inputs, drop_drafts=True),
            "expected 11 logits rows",
        ),
    ],
    ids=[
        "positions-from-0",
        "slot-without-block-size",
        "context-is-the-query",
        "host-tensors",
        "prompt-rows-interleaved",
        "drafts-dropped",
        "random-slots",
        "llama-context",
        "llama-drafts",
    ],
)
def test_a_wrong_flat_batch_is_caught_with_what_went_wrong(check, student, says) -> None:
    with pytest.raises(AssertionError) as caught:
        check(student)
    assert says in str(caught.value), str(caught.value)
