"""A step's grammar masks, filled in a background thread while the forward runs.

A constrained row needs its mask only when the sampler reads the logits, and the mask
depends only on tokens the sample already has (and, under speculative decoding, the
drafts proposed before the forward). So the worker hands the step's masks to a thread of
their own before the forward starts, and the sampler waits for them after it ends: the
forward (torch releases the GIL in its kernels) and xgrammar's mask fill (which releases
it too) overlap, and the sampler waits only for what is left (`StepTimings.masks_waited`
against `masks_filled`; docs/engine.md).

Per constrained sampling row of the step, the filler writes 1 + d rows of one int32
bitmask, where d is the number of drafts its sequence verifies: the state now, then after
each draft. It walks the matcher forward over the drafts (`accept`) and back
(`rollback(d)`), leaving it as it found it; the sample's one writer (`Sample.append`)
moves it on by the tokens verification keeps, after the step. Before that, on the
worker's thread, each draft list is cut at the first token the grammar forbids: the
target can never keep it or anything after it, so the forward need not score them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from minserve.messages import ScheduledChunk
from minserve.model.sampler import SamplingRow
from minserve.model.token_mask import bitmask_words
from minserve.structured.token_matcher import TokenMatcher, valid_prefix


@dataclass(frozen=True)
class _Walk:
    """One constrained row: its matcher, the drafts after it, its first row in the bitmask."""

    matcher: TokenMatcher
    drafts: tuple[int, ...]
    first_row: int


class StepMasks:
    """The bitmask of one step's constrained positions, being filled in the background."""

    def __init__(self, future: Future[tuple[torch.Tensor, float]]) -> None:
        self._future = future
        self.waited_s = 0.0  # how long readers waited for the fill to finish

    def bitmask(self) -> torch.Tensor:
        """int32 [positions, words], once filled (waits for the thread)."""
        if not self._future.done():
            start = time.perf_counter()
            self._future.result()
            self.waited_s += time.perf_counter() - start
        return self._future.result()[0]

    @property
    def filled_s(self) -> float:
        """Seconds the thread spent filling (after `bitmask()` or `finish()`)."""
        return self._future.result()[1]

    def finish(self) -> None:
        """Wait until the thread is done with the matchers (before anyone moves them on)."""
        self._future.exception()


class MaskRow:
    """A constraint the sampler reads: row `index` of a step's masks, and the `positions`
    rows after it (the same sample after each of its drafts)."""

    def __init__(self, masks: StepMasks, index: int, positions: int) -> None:
        self.masks, self.index, self.positions = masks, index, positions

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.masks.bitmask()[self.index]

    def after(self, token_ids: Sequence[int]) -> MaskRow:
        if len(token_ids) >= self.positions:
            raise ValueError(f"no mask was filled for {len(token_ids)} drafts ahead")
        return MaskRow(self.masks, self.index + len(token_ids), self.positions - len(token_ids))


class MaskFiller:
    """The worker's mask thread: `start` before the forward, the sampler reads after."""

    def __init__(self, vocab_size: int) -> None:
        self.words = bitmask_words(vocab_size)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="minserve-masks")

    def start(
        self, chunks: Sequence[ScheduledChunk], drafts: dict[int, list[int]]
    ) -> tuple[list[ScheduledChunk], StepMasks | None]:
        """Cut each constrained sequence's drafts (in place) where the grammar forbids one,
        start filling the masks, and return the chunks with their constrained rows reading
        them (None: no row is constrained; the chunks as they were)."""
        walks: list[_Walk] = []
        rows_of: dict[int, list[tuple[int, int]]] = {}  # chunk index -> (sample, walk index)
        for i, chunk in enumerate(chunks):
            for j, row in enumerate(chunk.samples):
                matcher = row.constraint
                if matcher is None:
                    continue
                own = drafts.get(chunk.seq_id, []) if j == 0 else []
                if own:
                    del own[valid_prefix(matcher, own) :]  # type: ignore[arg-type]
                first = walks[-1].first_row + len(walks[-1].drafts) + 1 if walks else 0
                walks.append(_Walk(matcher, tuple(own), first))  # type: ignore[arg-type]
                rows_of.setdefault(i, []).append((j, len(walks) - 1))
        if not walks:
            return list(chunks), None
        masks = StepMasks(self._thread.submit(self._fill, walks))
        out = list(chunks)
        for i, picked in rows_of.items():
            samples = list(chunks[i].samples)
            for j, w in picked:
                samples[j] = _reading(samples[j], masks, walks[w])
            out[i] = replace(chunks[i], samples=tuple(samples))
        return out, masks

    def _fill(self, walks: list[_Walk]) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        last = walks[-1]
        bitmask = torch.zeros(
            (last.first_row + len(last.drafts) + 1, self.words), dtype=torch.int32
        )
        for walk in walks:
            walk.matcher.fill_bitmask(bitmask, walk.first_row)
            for k, token_id in enumerate(walk.drafts, start=1):
                walk.matcher.accept(token_id)  # valid: the drafts were cut where one was not
                walk.matcher.fill_bitmask(bitmask, walk.first_row + k)
            if walk.drafts:
                walk.matcher.rollback(len(walk.drafts))
        return bitmask, time.perf_counter() - start

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)


def _reading(row: SamplingRow, masks: StepMasks, walk: _Walk) -> SamplingRow:
    return replace(row, constraint=MaskRow(masks, walk.first_row, len(walk.drafts) + 1))
