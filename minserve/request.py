"""A request as the scheduler sees it: token ids, sampling settings and the token stop rules.

One `Request` holds `n` `Sample`s (vLLM's `n`): each is one sequence with its own output
tokens, random generator and finish reason. A seeded sample's generator is re-seeded before
every draw from (seed, sample index, position, purpose) (`minserve/model/seeded_draws.py`):
its tokens follow from the request and the tokens before them, so a request continued from
its prompt plus the tokens generated so far draws the same ones.

`Sample.append` applies the rules that look at token ids only (EOS, stop token ids,
max_tokens, the model's length limit, a structured output's grammar); text, stop strings and
logprobs belong to the output processor (`minserve/output_processor.py`), which turns the new
tokens into what the caller sees.

A sample asked for structured output owns its grammar matcher (`minserve/structured/`):
`Sample.append` advances it with each token kept, next to the tokens themselves, so the
two never disagree; the worker only reads it through the sampling row.

A request resumed from its journal (`resume_token_ids`: the tokens it generated elsewhere
before that instance died) starts with them as its sample's first output tokens
(`Sample.replay`): the grammar advances over them and the stop rules count them, and since
the sampler reads a sample's output tokens (penalties, min_tokens) and its position (seeded
draws) from here, the tokens that follow are the ones the uninterrupted run would have drawn.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from minserve.errors import PromptTooLongError, ResumeTokensError
from minserve.model.sampler import SamplingRow
from minserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minserve.structured.matcher import GrammarMatcher


@dataclass(frozen=True)
class StopRules:
    """What ends a sequence besides its own SamplingParams."""

    eos_token_ids: tuple[int, ...]
    max_model_len: int


@dataclass
class Sample:
    """One generated sequence's tokens, and why it stopped (once it has)."""

    index: int
    params: SamplingParams
    prompt_token_ids: list[int]
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id that ended it (None: EOS or else)
    constraint: GrammarMatcher | None = None  # structured output: the grammar's state

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the length of this sequence's KV."""
        return len(self.prompt_token_ids) + len(self.token_ids)

    def sampling_row(self, rules: StopRules) -> SamplingRow:
        return SamplingRow(
            params=self.params,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.token_ids,
            generator=self.generator,
            eos_token_ids=() if self.params.ignore_eos else rules.eos_token_ids,
            constraint=self.constraint,
            sample_index=self.index,
        )

    def append(self, token_id: int, rules: StopRules) -> None:
        """Add one sampled token; finish on EOS or a stop token ("stop"), when the grammar
        is complete ("stop", even with ignore_eos: nothing may follow), else at the length
        limit ("length")."""
        if self.constraint is not None and not self.constraint.accept(token_id):
            # the sampler drew it under the grammar's mask: this is a bug, not bad input
            raise RuntimeError(f"token {token_id} breaks sample {self.index}'s grammar")
        self._keep(token_id, rules)

    def replay(self, token_ids: Sequence[int], rules: StopRules) -> None:
        """Take tokens generated elsewhere as this sample's first ones (a request resumed
        from its journal): the grammar and the token stop rules see them exactly as if they
        had been sampled here. ResumeTokensError (a ValueError) for a list that no run
        could have generated: a token the grammar refuses, or tokens after one that
        finished the sample."""
        for position, token_id in enumerate(token_ids):
            if self.finished:
                raise ResumeTokensError(
                    f"resume_token_ids[{position - 1}] already finishes the request "
                    f"({self.finish_reason!r}), so the {len(token_ids) - position} tokens after "
                    "it cannot follow; resume with the tokens up to it"
                )
            if self.constraint is not None and not self.constraint.accept(token_id):
                raise ResumeTokensError(
                    f"resume_token_ids[{position}] (token {token_id}) is not allowed there by "
                    "the structured output's grammar"
                )
            self._keep(token_id, rules)

    def _keep(self, token_id: int, rules: StopRules) -> None:
        """A token the grammar (if any) accepted: keep it, then apply the stop rules."""
        self.token_ids.append(token_id)
        if self.constraint is not None and self.constraint.is_terminated:
            self.finish("stop")
        if self._stops_on_token(token_id, rules):
            self.finish("stop", None if token_id in rules.eos_token_ids else token_id)
        elif self._at_length_limit(rules):
            self.finish("length", None)

    def finish(self, reason: str, stop_reason: int | None = None) -> None:
        if not self.finished:
            self.finish_reason, self.stop_reason = reason, stop_reason

    def _stops_on_token(self, token_id: int, rules: StopRules) -> bool:
        if len(self.token_ids) < self.params.min_tokens:
            return False  # the sampler also masks these tokens until then
        eos = not self.params.ignore_eos and token_id in rules.eos_token_ids
        return eos or token_id in (self.params.stop_token_ids or ())

    def _at_length_limit(self, rules: StopRules) -> bool:
        limit = self.params.max_tokens
        return (limit is not None and len(self.token_ids) >= limit) or (
            self.num_tokens >= rules.max_model_len
        )


@dataclass
class Request:
    """A prompt's token ids and its `n` samples, with its arrival time (for the policy)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Sample]
    arrival_time: float
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (set on start)

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        constraint: GrammarMatcher | None = None,
    ) -> Request:
        """`constraint`: the grammar's matcher, at its start, for a request with
        `structured_outputs` (the engine compiles it); each other sample gets a fork."""
        if params.structured_outputs is not None and constraint is None:
            raise ValueError(
                "structured_outputs needs a grammar matcher, which the paged engine compiles "
                "(LLM(engine='paged')); the reference engine has none"
            )
        samples = [
            Sample(i, params, prompt_token_ids, seeded_generator(params.seed), constraint=c)
            for i, c in enumerate(_forked(constraint, params.n))
        ]
        arrival = time.monotonic() if arrival_time is None else arrival_time
        return cls(request_id, prompt_token_ids, params, samples, arrival)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


def _forked(constraint: GrammarMatcher | None, n: int) -> list[GrammarMatcher | None]:
    """One matcher per sample: the one given, then copies of its state."""
    if constraint is None:
        return [None] * n
    return [constraint, *(constraint.fork() for _ in range(n - 1))]


def seeded_generator(seed: int | None) -> torch.Generator | None:
    """A seeded sample's own CPU generator (None when unseeded): so seeded results do not
    depend on what else is in the batch.

    It holds no stream of its own: the sampler re-seeds it in place before each draw with
    the key of (seed modulo 2**64, sample index, position, purpose)
    (`minserve/model/seeded_draws.py`), so what it draws never depends on its earlier draws.
    """
    return None if seed is None else torch.Generator()


def validate_prompt(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Reject a prompt the engine cannot run, saying why (with the numbers)."""
    if not token_ids:
        raise ValueError("prompt is empty: give at least one token")
    bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    if len(token_ids) >= max_model_len:  # leave room for at least one new token
        raise PromptTooLongError(len(token_ids), max_model_len)


def validate_resume(
    resume_token_ids: Sequence[int], num_prompt_tokens: int, params: SamplingParams,
    vocab_size: int, max_model_len: int,
) -> None:  # fmt: skip
    """Reject a resume list that cannot continue this request, saying why (with the
    numbers): a single sample only, token ids in the vocabulary, prompt and resume tokens
    within max_model_len, no more resume tokens than max_tokens. (What the tokens mean,
    the grammar and the stop rules, is `Sample.replay`'s and the output processor's to
    check.)"""
    if params.n != 1:
        raise ResumeTokensError(
            f"resume_token_ids continues one sample; n must be 1, got {params.n}"
        )
    bad = [t for t in resume_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ResumeTokensError(
            f"resume_token_ids must be integers in [0, {vocab_size}), the model's "
            f"vocabulary; got {bad[:5]}"
        )
    num_resumed = len(resume_token_ids)
    if num_prompt_tokens + num_resumed > max_model_len:
        raise ResumeTokensError(
            f"the prompt ({num_prompt_tokens} tokens) and resume_token_ids ({num_resumed} "
            f"tokens) make {num_prompt_tokens + num_resumed} tokens; max_model_len is "
            f"{max_model_len}"
        )
    if params.max_tokens is not None and num_resumed > params.max_tokens:
        raise ResumeTokensError(
            f"resume_token_ids has {num_resumed} tokens, more than max_tokens "
            f"({params.max_tokens}), which counts them"
        )
    if params.prompt_logprobs is not None:
        raise ResumeTokensError(
            "prompt_logprobs cannot go with resume_token_ids: the request being continued "
            "scored its prompt already"
        )


def validate_params(params: SamplingParams, vocab_size: int) -> None:
    """Reject settings that name token ids the model does not have (SamplingParams checks
    the rest without knowing the model)."""
    bad = [t for t in params.stop_token_ids or () if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"stop_token_ids must be in [0, {vocab_size}), the model's vocabulary; got {bad[:5]}"
        )
    bad = [t for t in params.logit_bias or () if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"logit_bias keys must be in [0, {vocab_size}), the model's vocabulary; got {bad[:5]}"
        )
