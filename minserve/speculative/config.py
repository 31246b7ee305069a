"""`SpeculativeConfig`: vLLM's `speculative_config` dict as a frozen, validated dataclass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "early_exit", "jump_forward")
DRAFT_LENGTHS = ("fixed", "adaptive")
PLUGGABLE_PROPOSERS = ("ngram", "early_exit")  # methods whose class `proposer_cls` replaces


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which proposer guesses tokens and how many per step (vLLM's option names).

    method: "ngram" (prompt lookup: copy what followed the latest earlier occurrence of
    the sequence's last n tokens, for n from prompt_lookup_max down to prompt_lookup_min).
    "draft_model" (a second model with the target's tokenizer, `model`), or
    "early_exit" (self-speculation: the target's first num_draft_layers layers, default half,
    with its final norm and LM head), or "jump_forward" (structured output: the tokens the
    request's grammar forces next; requests without a grammar draft nothing).
    num_speculative_tokens: k, the most tokens proposed per sequence and step.
    draft_length: "fixed" (always k) or "adaptive" (per request, the g in [1, k] that
    maximises the expected speedup at its running acceptance rate; draft_length.py).
    rejection_sampler: verifies a sampling request's drafts, with the signature of
    `minserve.speculative.verify.rejection_sample` (the default); chapter 06 plugs the
    student's in.
    proposer_cls: the class of the proposer, for method "ngram" built as `cls(config)`
    (default `minserve.speculative.ngram.NgramProposer`), for "early_exit" as
    `cls(config, runner)` (default `minserve.speculative.early_exit.EarlyExitProposer`);
    chapter 06 plugs the student's in.
    draft_lengths_cls: the class that gives each sequence its draft length, built as
    `cls(draft_length, num_speculative_tokens)` (default
    `minserve.speculative.draft_length.DraftLengths`); chapter 06 plugs the student's in.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: Any = None  # method "draft_model": its path, or a LoadedModel to share
    num_draft_layers: int | None = None  # method "early_exit"; None: half the target's layers
    draft_length: str = "fixed"
    rejection_sampler: Callable[..., list[int]] | None = None  # None: verify.rejection_sample
    # methods "ngram" and "early_exit": the proposer class (None: minserve's own)
    proposer_cls: Callable[..., Any] | None = None
    # the draft lengths per sequence, built as cls(draft_length, k) (None: DraftLengths)
    draft_lengths_cls: Callable[[str, int], Any] | None = None

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
        if self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(
                f"unknown draft_length {self.draft_length!r}; choose one of "
                f"{', '.join(DRAFT_LENGTHS)}"
            )
        if self.rejection_sampler is not None and not callable(self.rejection_sampler):
            raise ValueError(
                "rejection_sampler must be a function like "
                "minserve.speculative.verify.rejection_sample, got "
                f"{type(self.rejection_sampler).__name__}"
            )
        if self.proposer_cls is not None and self.method not in PLUGGABLE_PROPOSERS:
            raise ValueError(
                f"proposer_cls applies to methods 'ngram' and 'early_exit', not {self.method!r}"
            )
        if self.proposer_cls is not None and not callable(self.proposer_cls):
            raise ValueError(
                "proposer_cls must be a class like minserve.speculative.ngram.NgramProposer "
                "or minserve.speculative.early_exit.EarlyExitProposer, "
                f"got {type(self.proposer_cls).__name__}"
            )
        if self.draft_lengths_cls is not None and not callable(self.draft_lengths_cls):
            raise ValueError(
                "draft_lengths_cls must be a class like "
                "minserve.speculative.draft_length.DraftLengths, "
                f"got {type(self.draft_lengths_cls).__name__}"
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
