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
