"""The reference generation path: contiguous per-sequence KV, no paging, no chunking.

It is the oracle every optimised path is checked against and the baseline it must beat.
Each step runs one flat batch: whole prompts of newly admitted sequences plus the last
token of every running one, then samples one token per sequence. Its new tokens go through
the same output processor as the engine's, so text and stop strings are handled once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from minserve.attention.contiguous import Attend, ContiguousAttention, ContiguousSlice, SequenceKV
from minserve.errors import RequestsFailedError
from minserve.messages import NewTokens, SchedulerUpdate
from minserve.model.llama import CausalLM
from minserve.model.sampler import Sampler
from minserve.output_processor import OutputProcessor
from minserve.outputs import RequestOutput
from minserve.request import Request, Sample, StopRules


@dataclass
class _Running:
    """A sample admitted to the batch, with its private KV buffer."""

    request: Request
    sample: Sample
    kv: SequenceKV
    cached: int = 0  # tokens whose K/V are already in `kv`

    def next_input(self) -> list[int]:
        """Tokens to feed this step: the whole prompt first, then the last sampled token."""
        return (self.sample.prompt_token_ids + self.sample.token_ids)[self.cached :]


class ReferenceGenerator:
    """Runs requests to completion, up to `max_num_seqs` sequences at a time."""

    def __init__(
        self,
        model: CausalLM,
        sampler: Sampler,
        rules: StopRules,
        max_num_seqs: int = 256,
        attend: Attend | None = None,  # the attention function; None: minserve's own
    ) -> None:
        self.model = model
        self.attend = attend
        self.sampler = sampler
        self.rules = rules
        self.max_num_seqs = max_num_seqs
        self.param = next(model.parameters())

    def run(self, requests: list[Request], outputs: OutputProcessor) -> Iterator[RequestOutput]:
        """Every step's deltas (from `outputs`) until all requests finish."""
        waiting = deque((r, s) for r in requests for s in r.samples)
        running: list[_Running] = []
        while waiting or running:
            while waiting and len(running) < self.max_num_seqs:
                running.append(self._admit(*waiting.popleft()))
            processed = outputs.process(SchedulerUpdate(new_tokens=tuple(self.step(running))))
            for request_id, index in processed.stops.stopped:  # a stop string ended it
                (stopped,) = [r for r in running if (r.request.request_id, r.sample.index)
                              == (request_id, index)]  # fmt: skip
                stopped.sample.finish("stop")
            yield from processed.outputs
            running = [r for r in running if not r.sample.finished]

    def _admit(self, request: Request, sample: Sample) -> _Running:
        capacity = len(sample.prompt_token_ids)
        capacity += sample.params.max_tokens or self.rules.max_model_len
        capacity = min(capacity, self.rules.max_model_len)
        kv = SequenceKV(self.model.config, capacity, self.param.dtype, self.param.device)
        return _Running(request, sample, kv)

    @torch.inference_mode()
    def step(self, running: list[_Running]) -> list[NewTokens]:
        """One forward over the flat batch, one sampled token per sequence."""
        inputs = [r.next_input() for r in running]
        device = self.param.device
        input_ids = torch.tensor([t for ids in inputs for t in ids], device=device)  # [T]
        positions = torch.cat(
            [torch.arange(r.cached, r.cached + len(ids)) for r, ids in zip(running, inputs)]
        ).to(device)  # [T]
        slices = [ContiguousSlice(r.kv, r.cached, len(ids)) for r, ids in zip(running, inputs)]
        hidden = self.model(
            input_ids, positions, ContiguousAttention(slices, self.attend)
        )  # [T, hidden]
        last = torch.tensor([len(ids) for ids in inputs], device=device).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[last])  # [num_seqs, vocab]
        result = self.sampler(logits, [r.sample.sampling_row(self.rules) for r in running])
        if result.failed:  # the oracle stops at the first sign of trouble
            reasons = {running[i].request.request_id: why for i, why in result.failed.items()}
            raise RequestsFailedError.from_reasons(reasons, [])
        new_tokens = []
        for r, ids, token, logprobs in zip(running, inputs, result.token_ids, result.logprobs):
            r.cached += len(ids)
            r.sample.append(token, self.rules)
            new_tokens.append(
                NewTokens(r.request.request_id, r.sample.index, (token,), (logprobs,),
                          r.sample.finish_reason, r.sample.stop_reason)
            )  # fmt: skip
        return new_tokens
