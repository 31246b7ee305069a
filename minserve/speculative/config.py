"""`SpeculativeConfig`: vLLM's `speculative_config` dict as a frozen, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "early_exit")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which proposer guesses tokens and how many per step (vLLM's option names).

    method: "ngram" (prompt lookup: copy what followed the latest earlier occurrence of
    the sequence's last n tokens, for n from prompt_lookup_max down to prompt_lookup_min).
    "draft_model" (a second model with the target's tokenizer, `model`), or
    "early_exit" (self-speculation: the target's first num_draft_layers layers, default half,
    with its final norm and LM head).
    num_speculative_tokens: k, the most tokens proposed per sequence and step.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: Any = None  # method "draft_model": its path, or a LoadedModel to share
    num_draft_layers: int | None = None  # method "early_exit"; None: half the target's layers

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; choose one of {', '.join(METHODS)}"
            )
        if self.method == "draft_model" and self.model is None:
            raise ValueError("method 'draft_model' needs 'model': the draft model's path")
        for key, method in (("num_draft_layers", "early_exit"), ("model", "draft_model")):
            if getattr(self, key) is not None and self.method != method:
                raise ValueError(f"{key} applies to method {method!r}, not {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> SpeculativeConfig:
        """Build from `LLM(speculative_config={...})`, naming any key we do not know."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys {unknown}; known: {', '.join(sorted(known))}"
            )
        for key in ("method", "num_speculative_tokens"):
            if key not in options:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**options)
