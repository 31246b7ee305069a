"""What a request can never get from this server, refused at once with a 400.

    the longest prompt + max_tokens  <=  max_model_len           (the model's context)
    n                                <=  max_num_seqs            (a request's samples run
                                                                  side by side)
    prompts in one request           <=  max_num_seqs + max_queued  (what the server holds)
    stop_token_ids                   <   vocab_size              (as prompt token ids)

A 503 says "busy, retry later"; it would be a lie for a request that could never fit, so
these are checked before the request is queued, with the numbers in the message.
"""

from __future__ import annotations

from dataclasses import dataclass

from minserve.sampling_params import SamplingParams
from minserve.server.errors import APIError


# >>> exercise 9.6: what a request can never get
@dataclass(frozen=True)
class ServerLimits:
    """The engine's bounds, as the HTTP layer sees them.

    Every refusal is `APIError(400, message, param=..., code=...)` whose message gives the
    numbers: what the request asked for and the bound it breaks.
    """

    max_model_len: int
    max_num_seqs: int
    capacity: int  # requests in flight at most: max_num_seqs + max_queued
    vocab_size: int  # token ids run below it (the engine checks a prompt's)

    def check(
        self, prompt_lengths: list[int], params: SamplingParams, max_tokens_param: str,
        max_tokens_given: bool,
    ) -> None:  # fmt: skip
        """Refuse what cannot fit; `max_tokens_given`: the client chose it (a default stops
        at the end of the context instead).

        In this order: the number of prompts, n, stop_token_ids, then the context: the
        longest prompt plus max_tokens, checked only when the client gave max_tokens
        ("the prompt" for one prompt, "the longest prompt" for several).
        """
        # >>> solution
        self.check_batch(len(prompt_lengths))
        self._check_samples(params.n)
        self._check_stop_token_ids(params.stop_token_ids or [])
        if max_tokens_given and params.max_tokens is not None:
            what = "the prompt" if len(prompt_lengths) == 1 else "the longest prompt"
            self._check_context(what, max(prompt_lengths), params.max_tokens, max_tokens_param)
        # <<< solution

    def check_batch(self, num_prompts: int) -> None:
        """More prompts than `capacity`: param "prompt", code "too_many_prompts"."""
        # >>> solution
        if num_prompts > self.capacity:
            raise APIError(
                400, f"the request has {num_prompts} prompts; this server holds at most "
                f"{self.capacity} requests at once (max_num_seqs + max_queued)",
                param="prompt", code="too_many_prompts",
            )  # fmt: skip
        # <<< solution

    def _check_samples(self, n: int) -> None:
        """n above `max_num_seqs` (samples run side by side): param "n", "too_many_samples"."""
        # >>> solution
        if n > self.max_num_seqs:
            raise APIError(
                400, f"n is {n}, but this server runs at most {self.max_num_seqs} sequences "
                "at once (max_num_seqs), and a request's samples run together",
                param="n", code="too_many_samples",
            )  # fmt: skip
        # <<< solution

    def _check_stop_token_ids(self, token_ids: list[int]) -> None:
        """Ids at or above `vocab_size`: param "stop_token_ids", no code; name a few of them."""
        # >>> solution
        outside = [t for t in token_ids if t >= self.vocab_size]
        if outside:
            raise APIError(
                400, f"stop_token_ids must be below the vocabulary size {self.vocab_size}; "
                f"got {outside[:5]}", param="stop_token_ids",
            )  # fmt: skip
        # <<< solution

    def _check_context(self, what: str, prompt_len: int, max_tokens: int, param: str) -> None:
        """prompt + max_tokens above `max_model_len`: param `param`, "context_length_exceeded",
        the message saying how many tokens can be generated. A prompt that alone fills the
        context is left to the engine, which says so itself."""
        # >>> solution
        if prompt_len >= self.max_model_len:
            return  # the prompt alone is too long: the engine says so (context_length_exceeded)
        if prompt_len + max_tokens > self.max_model_len:
            room = self.max_model_len - prompt_len
            raise APIError(
                400, f"{param} is {max_tokens}, but {what} has {prompt_len} tokens and "
                f"max_model_len is {self.max_model_len}: at most {room} tokens can be "
                f"generated ({prompt_len} + {max_tokens} > {self.max_model_len})",
                param=param, code="context_length_exceeded",
            )  # fmt: skip
        # <<< solution


# <<< exercise


def check_unused_max_tokens(limits: ServerLimits, value: int, param: str) -> None:
    """A chat request that gives both max_completion_tokens and max_tokens runs on the first;
    the other must still keep the bound the server's schema states (max_model_len - 1,
    the most tokens a one-token prompt leaves room for), or the request breaks its schema."""
    bound = limits.max_model_len - 1
    if value > bound:
        message = (
            f"{param} is {value}, above this server's maximum of {bound} (max_model_len "
            f"{limits.max_model_len} less a one-token prompt), though max_completion_tokens "
            "sets the length"
        )
        raise APIError(400, message, param=param, code="context_length_exceeded")
