"""`Sequence.token_slice`: the tokens a chunk runs, read without building the whole list."""

from __future__ import annotations

from minserve.kvcache.block_table import BlockTable
from minserve.request import Request
from minserve.sampling_params import SamplingParams
from minserve.scheduler.sequence import Sequence


def test_token_slice_equals_slicing_prompt_plus_output_everywhere() -> None:
    request = Request.create("a", [11, 12, 13, 14], SamplingParams())
    seq = Sequence(request, request.samples[0], BlockTable(2))
    seq.sample.token_ids.extend([15, 16, 17])
    for start in range(8):
        for end in range(start, 8):
            assert seq.token_slice(start, end) == tuple(seq.token_ids[start:end]), (start, end)
