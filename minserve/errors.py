"""Exceptions a user can act on. Each message says what was wrong and what is allowed."""


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


class StepFailedError(RuntimeError):
    """An engine step raised; `request_ids` are the requests it was running (None: it failed
    before it had a batch, so any request may be affected). The cause is chained."""

    def __init__(self, request_ids: list[str] | None, cause: BaseException) -> None:
        super().__init__(f"the engine step failed ({type(cause).__name__}: {cause})")
        self.request_ids = request_ids


class RequestsFailedError(RuntimeError):
    """A step lost some requests (a disaggregated instance died, say); the others go on.

    An engine raises it from `step()` with the lost ids and the step's other outputs.
    """

    def __init__(self, message: str, request_ids: list[str], outputs: list) -> None:
        super().__init__(message)
        self.request_ids, self.outputs = request_ids, outputs
