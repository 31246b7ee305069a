"""Exceptions a user can act on. Each message says what was wrong and what is allowed."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A checkpoint could not be read: unsupported, corrupt or incomplete."""


class PromptTooLongError(ValueError):
    """A prompt (plus the tokens asked for) does not fit the model's context."""

    def __init__(self, num_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"prompt has {num_tokens} tokens; max_model_len is {max_model_len}. "
            "Shorten the prompt or raise max_model_len."
        )
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len


class ResumeTokensError(ValueError):
    """`resume_token_ids` that cannot continue their request: out of the vocabulary, too
    long, n > 1, or a token no run could have generated there (the message says which)."""


class StructuredOutputError(ValueError):
    """A structured-output request the engine cannot serve: a schema, regex or grammar that
    does not compile (the message says why), one that takes too long to compile, or a
    schema keyword the grammar library would ignore."""


# Why a constrained row fails when its grammar allows no token at all: what it requires next
# cannot be spelled with the model's vocabulary (SmolLM2's has no byte token for 0xF1, 0xF2
# and six control characters). The request fails alone; the server answers 400, not 500.
GRAMMAR_DEAD_END = "its grammar allows no token of the model's vocabulary here"


class StructuredOutputBusyError(StructuredOutputError):
    """Grammars of earlier requests are still compiling past their time bound: new grammars
    wait until they end (retry later; a 503 on the server)."""


class StepFailedError(RuntimeError):
    """An engine step raised; `request_ids` are the requests it was running (None: it failed
    before it had a batch, so any request may be affected). The cause is chained."""

    def __init__(self, request_ids: list[str] | None, cause: BaseException) -> None:
        super().__init__(f"the engine step failed ({type(cause).__name__}: {cause})")
        self.request_ids = request_ids


class RequestsFailedError(RuntimeError):
    """A step lost some requests (NaN logits, a token that cannot be decoded, a disaggregated
    instance that died); the others go on.

    An engine raises it from `step()` once the lost requests are aborted, with their ids,
    why each failed (`reasons`) and the step's other outputs.
    """

    def __init__(
        self,
        message: str,
        request_ids: list[str],
        outputs: list,
        reasons: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.request_ids, self.outputs = request_ids, outputs
        self.reasons = reasons if reasons is not None else dict.fromkeys(request_ids, message)

    @classmethod
    def from_reasons(cls, reasons: dict[str, str], outputs: list) -> RequestsFailedError:
        """One message naming each failed request and why it failed."""
        message = "; ".join(f"request {rid!r}: {why}" for rid, why in reasons.items())
        return cls(message, list(reasons), outputs, reasons)
