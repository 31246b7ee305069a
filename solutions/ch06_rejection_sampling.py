# Generated from minserve/speculative/verify.py, minserve/speculative/ngram.py, minserve/speculative/draft_length.py, minserve/speculative/early_exit.py by `python -m minserve.course.generate`;
# edit the marked regions there, not here.
"""Chapter 06, Sampling and speculative decoding: verifying a draft distribution,
and proposing drafts by prompt lookup and by early exit.

A draft q proposes tokens; the target p keeps each with probability min(1, p/q)
and, at the first rejection, draws from the residual max(0, p - q) normalised, so
every token returned is distributed exactly as p (Leviathan et al., Chen et al.).
The n-gram proposer guesses the tokens that followed the latest earlier match of
the last n tokens; plug it in with `LLM(speculative_config={"method": "ngram",
"num_speculative_tokens": 4, "proposer_cls": NgramProposer})`. The adaptive
draft length picks, per request, the g in [1, k] with the best expected speedup
at its running acceptance rate; plug your `DraftLengths` in with
`speculative_config={..., "draft_length": "adaptive", "draft_lengths_cls":
DraftLengths}`. The early-exit proposer drafts with the target's own first
layers, reading and writing the target's KV pool; plug it in with
`speculative_config={"method": "early_exit", ..., "proposer_cls":
EarlyExitProposer}`.
"""

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from minserve.attention.metadata import AttentionMetadata
from minserve.messages import ScheduledChunk
from minserve.model.runner import ModelInputs, ModelRunner, slot_of
from minserve.model.sampler import Sampler
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.distributions import choose_drafts, row_after
from minserve.speculative.draft import Draft
from minserve.speculative.draft_length import (
    DECAY,
    PRIOR_RATE,
    PRIOR_WEIGHT,
    TOLERANCE,
    expected_speedup,
)


# Exercise 6.1: the residual distribution
def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Where to draw from after a rejection: max(0, p - q), normalised.

    `target_probs` p and `draft_probs` q are [..., vocab] and each sums to 1 over the last
    dim. The residual puts mass exactly where the target wants more than the draft gave,
    which is what a rejection must make up for. When p == q there is no such mass (and a
    rejection never happens); return p itself, never NaN. Returns a new tensor.
    """
    excess = (target_probs - draft_probs).clamp(min=0)  # [..., vocab]
    total = excess.sum(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(total > 0, excess / total.clamp(min=1e-30), target_probs)


# Exercise 6.2: accept or reject each draft
def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: list[int],
    generator: torch.Generator,
) -> list[int]:
    """Verify k drafts; return the accepted ones plus one token drawn by the target.

    `target_probs` is [k + 1, vocab]: row j is p at the position of draft j, row k the
    position after the last draft. `draft_probs` is [k, vocab]: the q that proposed each
    draft. Walk the drafts in order; draw u ~ U[0, 1) from `generator` and keep draft d
    when u * q(d) < p(d) (probability min(1, p(d) / q(d)), no division). At the first
    rejection, append one token drawn from `residual_distribution` of that row (with
    `torch.multinomial(..., 1, generator=generator)`) and stop. When all k are kept,
    append a bonus token drawn from row k. Every token returned is then distributed
    exactly as if the target had sampled it alone.
    """
    tokens: list[int] = []
    for j, draft in enumerate(draft_tokens):
        u = torch.rand((), generator=generator)
        if u * draft_probs[j, draft] < target_probs[j, draft]:
            tokens.append(draft)
            continue
        residual = residual_distribution(target_probs[j], draft_probs[j])  # [vocab]
        tokens.append(int(torch.multinomial(residual, 1, generator=generator)))
        return tokens
    bonus = torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator)
    return tokens + [int(bonus)]


# Exercise 6.3: find the latest earlier match of the last n tokens
def latest_earlier_match(token_ids: list[int], n: int) -> int | None:
    """Start of the latest occurrence of the last n tokens that is followed by a token.

    The last n tokens themselves do not count (nothing follows them yet); an earlier
    occurrence may overlap them. None when there is none. [1, 2, 1, 2, 1, 2] with n = 2:
    [1, 2] also starts at 0 and 2; the latest, 2, is followed by a token: return 2.
    """
    pattern = token_ids[-n:]
    last = pattern[-1]
    for end in range(len(token_ids) - 2, n - 2, -1):  # `end`: index of the match's last token
        if token_ids[end] == last and token_ids[end - n + 1 : end + 1] == pattern:
            return end - n + 1
    return None


# Exercise 6.4: the n-gram proposer (prompt lookup)
class NgramProposer:
    """Propose the tokens that followed the latest earlier match of the last n tokens.

    Plug yours into the engine with `LLM(speculative_config={"method": "ngram",
    "num_speculative_tokens": k, "proposer_cls": NgramProposer})`.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, chunks: list[ScheduledChunk], limits: list[int]) -> list[Draft]:
        """One guess per decode, each at most its limit long (may be empty). Deterministic,
        whatever the row: q is one-hot at each guess."""
        return [Draft(self.lookup(c.history(), k)) for c, k in zip(chunks, limits, strict=True)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """At most k tokens: those that followed the latest earlier match of the last n
        tokens (`latest_earlier_match`), for n from max_n down to min_n, the first n that
        matches winning: a longer matching context is a better predictor. n never exceeds
        len(token_ids) - 1 (an earlier match needs room). [] when no n matches."""
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            start = latest_earlier_match(token_ids, n)
            if start is not None:
                return token_ids[start + n : start + n + k]
        return []


# Exercise 6.5: the adaptive draft length
def best_draft_length(a: float, c: float, k: int) -> int:
    """The shortest g in [1, k] whose expected speedup `expected_speedup(a, g, c)` is within
    TOLERANCE of the best one: at least (1 - TOLERANCE) times the largest S(g)."""
    speedups = [expected_speedup(a, g, c) for g in range(1, k + 1)]
    best = max(speedups)
    return next(g for g, s in enumerate(speedups, start=1) if s >= (1 - TOLERANCE) * best)


@dataclass
class AcceptanceEstimate:
    """Discounted counts of one request's drafts: a = accepted / tested."""

    accepted: float = PRIOR_RATE * PRIOR_WEIGHT
    tested: float = PRIOR_WEIGHT

    @property
    def rate(self) -> float:
        return self.accepted / self.tested

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """Drafts are tested in order until the first rejection: the accepted ones, plus the
        rejected one if any (drafts after it were never tested). Both counts decay by DECAY
        before this step's are added, so recent steps weigh most."""
        tested = num_accepted + (num_accepted < num_drafts)
        self.accepted = DECAY * self.accepted + num_accepted
        self.tested = DECAY * self.tested + tested


class DraftLengths:
    """How many drafts each sequence may get this step (before the engine's own limits).

    mode "fixed": always k. "adaptive": each sequence's own `AcceptanceEstimate` (made on
    first use), and the best draft length at its rate. Plug your class into the engine
    with `speculative_config={..., "draft_length": "adaptive", "draft_lengths_cls": ...}`.
    """

    def __init__(self, mode: str, k: int) -> None:
        self.adaptive = mode == "adaptive"
        self.k = k
        self.estimates: dict[Hashable, AcceptanceEstimate] = {}  # adaptive only, by sequence

    def length(self, seq: Hashable, cost_ratio: float) -> int:
        """Drafts for `seq` this step, at draft cost ratio `cost_ratio`."""
        if not self.adaptive:
            return self.k
        estimate = self.estimates.setdefault(seq, AcceptanceEstimate())
        return best_draft_length(estimate.rate, cost_ratio, self.k)

    def observe(self, seq: Hashable, num_drafts: int, num_accepted: int) -> None:
        """`seq` had `num_drafts` drafts verified, `num_accepted` of them kept (adaptive
        mode only, and only when it drafted at all)."""
        if self.adaptive and num_drafts > 0:
            self.estimates.setdefault(seq, AcceptanceEstimate()).observe(num_drafts, num_accepted)

    def forget(self, seq: Hashable) -> None:
        """A finished or aborted sequence: its estimate goes."""
        self.estimates.pop(seq, None)


# Exercise 6.6: the early-exit draft (self-speculation)
class EarlyExitProposer:
    """Drafts from the target's first `num_draft_layers` layers, k forwards of 1 token.

    Plug yours into the engine with `LLM(speculative_config={"method": "early_exit",
    "num_speculative_tokens": k, "num_draft_layers": L, "proposer_cls": EarlyExitProposer})`.
    """

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner) -> None:
        self.runner = runner
        self.sampler = Sampler()  # processes q as the target's sampler processes p
        total = runner.model.config.num_layers
        self.num_layers = config.num_draft_layers or max(1, total // 2)
        if not 1 <= self.num_layers < total:
            raise ValueError(
                f"num_draft_layers must be in [1, {total - 1}] for this {total}-layer model, "
                f"got {self.num_layers}"
            )

    def propose(self, chunks: list[ScheduledChunk], limits: list[int]) -> list[Draft]:
        """Up to `limits[i]` drafts for decode `chunks[i]`, whose block table already has
        slots for them after its token.

        Round j is one batched forward (`_draft_logits`) of every sequence that still wants
        a (j + 1)-th draft. `choose_drafts(self.sampler, logits, rows)` picks each row's
        draft: the argmax for greedy rows, a draw from the early exit's processed q for
        sampling rows, whose row j must see the drafts before it as output (`row_after`).
        A sequence whose row cannot be sampled (its token comes back None: NaN logits)
        stops drafting there; the others go on. Returns `Draft.from_choices(tokens, qs)`
        per sequence, in the order of `chunks`."""
        drafts: list[list[int]] = [[] for _ in chunks]
        probs: list[list[torch.Tensor | None]] = [[] for _ in chunks]
        limits = list(limits)  # lowered for a sequence whose draft row cannot be sampled
        for step in range(max(limits, default=0)):
            active = [i for i, k in enumerate(limits) if k > step]
            if not active:
                break
            logits = self._draft_logits([chunks[i] for i in active], [drafts[i] for i in active])
            step_rows = [row_after(chunks[i].samples[0], drafts[i]) for i in active]
            tokens, qs = choose_drafts(self.sampler, logits, step_rows)
            for i, token, q in zip(active, tokens, qs):
                if token is None:
                    limits[i] = step  # no draft here: this sequence stops drafting
                    continue
                drafts[i].append(token)
                probs[i].append(q)
        return [Draft.from_choices(d, q) for d, q in zip(drafts, probs)]

    def _draft_logits(self, chunks: list[ScheduledChunk], drafts: list[list[int]]) -> torch.Tensor:
        """Each decode's newest token through the first `self.num_layers` layers, then the
        final norm and LM head: logits [B, vocab].

        The newest token of `chunks[i]` is its last draft, or its own token before any: it
        sits at position `start + len(drafts[i])`, attends to every token up to it, and its
        K/V go to that position's pool slot (`slot_of` through the block table). Build
        `AttentionMetadata.build(query_lens=..., context_lens=..., block_tables=...,
        slot_mapping=..., device=...)` and `ModelInputs` (one logits row per sequence), then
        `self.runner.forward(inputs, num_layers=self.num_layers)`."""
        last = [c.start + len(d) for c, d in zip(chunks, drafts)]
        tokens = [(d or c.token_ids)[-1] for c, d in zip(chunks, drafts)]
        one_token_each = AttentionMetadata.build(
            query_lens=[1] * len(chunks),
            context_lens=[p + 1 for p in last],
            block_tables=[list(c.block_table) for c in chunks],
            slot_mapping=[
                slot_of(c.block_table, self.runner.kv.block_size, p) for c, p in zip(chunks, last)
            ],
            device=self.runner.device,
        )
        device = self.runner.device
        inputs = ModelInputs(
            input_ids=torch.tensor(tokens, device=device),
            positions=torch.tensor(last, device=device),
            metadata=one_token_each,
            sample_indices=torch.arange(len(chunks), device=device),
        )
        return self.runner.forward(inputs, num_layers=self.num_layers)  # [B, vocab]
