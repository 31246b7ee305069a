"""Speculative decoding measured: plain vs speculative wall time on the same requests, next to
Leviathan et al.'s formulas (`minserve bench speculative`, docs/speculative.md).

With per-token acceptance rate a, g drafts per step and a draft step costing c target steps,
one target forward yields (1 - a^(g+1)) / (1 - a) tokens on average, and the expected
speedup is that over (g c + 1). Here a, g and c are measured, and so is what they predict.

For one workload and batch size, a fresh plain engine and one engine per proposer share the
target's weights; the requests run in units (one request at a time for batch 1, 8 together
for batch 8), and within each unit every engine runs it in turn, the order rotating from
unit to unit, so machine noise falls on all of them alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ENGINE_C_KEY = "spec_decode_draft_cost_ratio"  # the engine's own c, preferred when it exists


def tokens_per_forward(a: float, g: float) -> float:
    """(1 - a^(g+1)) / (1 - a): expected tokens per target forward (g + 1 when a = 1)."""
    if not 0 <= a <= 1 or g < 0:
        raise ValueError(f"need 0 <= a <= 1 and g >= 0, got a={a}, g={g}")
    return g + 1 if a == 1 else (1 - a ** (g + 1)) / (1 - a)


def expected_speedup(a: float, g: float, c: float) -> float:
    """(1 - a^(g+1)) / ((1 - a)(g c + 1)): tokens per forward over the cost of one step."""
    if c < 0:
        raise ValueError(f"the draft cost ratio c must be >= 0, got {c}")
    return tokens_per_forward(a, g) / (g * c + 1)


@dataclass(frozen=True)
class ProposerSpec:
    """One speculative configuration: `ngram:k=4`, `early_exit:layers=20:k=3`,
    `draft_model:layers=10` (a layer-truncated copy of the target), `draft_model` (the
    target itself as its own draft); `:adaptive` picks each request's draft length."""

    method: str
    k: int = 4
    layers: int | None = None
    adaptive: bool = False

    @classmethod
    def parse(cls, text: str) -> ProposerSpec:
        method, *options = text.split(":")
        if method not in ("ngram", "early_exit", "draft_model"):
            raise ValueError(f"unknown proposer {method!r}; use ngram, early_exit or draft_model")
        values: dict[str, Any] = {"adaptive": "adaptive" in options}
        for option in (o for o in options if o != "adaptive"):
            key, _, value = option.partition("=")
            if key not in ("k", "layers") or not value.isdigit():
                raise ValueError(
                    f"bad proposer option {option!r} in {text!r}; use k=N, layers=N or adaptive"
                )
            values[key] = int(value)
        if method == "ngram" and "layers" in values:
            raise ValueError("layers= applies to early_exit and draft_model, not ngram")
        return cls(method, **values)

    @property
    def name(self) -> str:
        layers = "" if self.layers is None else f", {self.layers} layers"
        if self.method == "draft_model" and self.layers is None:
            layers = ", the target itself"
        return f"{self.method} (k={self.k}{layers}{', adaptive' if self.adaptive else ''})"

    def config(self, draft: Any = None) -> dict[str, Any]:
        """vLLM's speculative_config dict; `draft` is the loaded draft model."""
        options: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.k}
        if self.method == "early_exit" and self.layers is not None:
            options["num_draft_layers"] = self.layers
        if self.method == "draft_model":
            options["model"] = draft
        if self.adaptive:
            options["draft_length"] = "adaptive"
        return options


@dataclass
class RunTotals:
    """What one engine did over a cell's units: wall time, full-batch decode steps, tokens."""

    seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    outputs: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class Cell:
    """One proposer on one workload at one batch size, against plain decoding."""

    workload: str
    batch: int
    proposer: str
    num_requests: int
    output_tokens: int
    plain_s: float
    spec_s: float
    acceptance_rate: float  # a: accepted / proposed drafts
    mean_draft_len: float  # g: drafts proposed per verification that had any
    mean_accepted_len: float  # 1 + accepted drafts per verification
    tokens_per_forward: float  # tokens emitted per sequence per target forward
    c: float  # draft cost ratio used in the formula
    c_source: str  # "engine" or "benchmark"
    c_benchmark: float  # proposer seconds per drafted token / plain decode seconds per token
    identical: bool  # greedy tokens equal plain decoding's, every request

    @property
    def speedup(self) -> float:
        return self.plain_s / self.spec_s

    @property
    def formula_tokens_per_forward(self) -> float:
        return tokens_per_forward(self.acceptance_rate, self.mean_draft_len)

    @property
    def formula_speedup(self) -> float:
        return expected_speedup(self.acceptance_rate, self.mean_draft_len, self.c)

    def to_dict(self) -> dict[str, Any]:
        derived = ("speedup", "formula_tokens_per_forward", "formula_speedup")
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


def make_cell(
    workload: str, batch: int, spec: str, plain: RunTotals, run: RunTotals, engine: Any
) -> Cell:
    """Read a, g, tokens per forward (and c, if the engine has it) from the engine's metrics."""
    m = engine.get_metrics()
    proposed, drafts = m["spec_decode_num_draft_tokens"], m["spec_decode_num_drafts"]
    plain_per_token = plain.decode_seconds / max(plain.decode_steps, 1) / batch
    propose_s = engine.worker.speculator.proposer.seconds
    c_bench = propose_s / proposed / plain_per_token if proposed and plain_per_token else 0.0
    c_engine = m.get(ENGINE_C_KEY)
    return Cell(
        workload=workload,
        batch=batch,
        proposer=spec,
        num_requests=len(run.outputs),
        output_tokens=sum(map(len, run.outputs)),
        plain_s=plain.seconds,
        spec_s=run.seconds,
        acceptance_rate=m["spec_decode_acceptance_rate"],
        mean_draft_len=proposed / drafts if drafts else 0.0,
        mean_accepted_len=m["spec_decode_mean_acceptance_length"],
        tokens_per_forward=m["spec_decode_tokens_per_forward"],
        c=c_bench if c_engine is None else float(c_engine),
        c_source="benchmark" if c_engine is None else "engine",
        c_benchmark=c_bench,
        identical=run.outputs == plain.outputs,
    )
