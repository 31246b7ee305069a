"""The sampler: one step's logits in, one token per sequence out, with vLLM's semantics.

Each row goes through, in order:
0. structured output: a row with a grammar (`SamplingRow.constraint`) has every token the
   grammar forbids next set to -inf, so everything below (logprobs included, as in vLLM)
   sees the constrained distribution, on every path: greedy, seeded, the filters, penalties;
1. logprobs, taken from the logits as the model gave them (before anything below);
2. logit_bias: OpenAI's per-token additions;
3. penalties: repetition (prompt + output tokens), frequency and presence (output only);
4. min_tokens: EOS and stop tokens forbidden until the row has enough output;
5. a row left with no token to draw (NaN or +inf logits, or every token forbidden) is
   reported in `SampleResult.failed`: its request fails, the other rows go on;
6. greedy rows take the argmax; the others divide by temperature (after shifting the row
   so its largest logit is 0: no probability changes, no division overflows), filter
   (top-k, top-p, min-p) and draw by inverse transform sampling: one uniform number per
   row. A seeded row's number comes from its own generator, re-seeded before the draw with
   a key of (seed, sample index, position, "sample") (`seeded_draws.py`), so its tokens never
   depend on which other rows share its batch, nor on how many draws came before: a request
   continued from its prompt plus the tokens generated so far draws what the original would.
   On a CPU, rows with a temperature and no filter are drawn by a C kernel
   (`kernels/draw_rows.c`): the same draw, two passes over each row instead of eight.

The three filters and the penalties are chapter 00's exercises (the marked regions below),
applying the grammar's bitmask chapter 12's (`token_mask.py`); `Sampler` takes them as
arguments so a student's versions can run inside the real engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol

import torch

from minserve.errors import GRAMMAR_DEAD_END
from minserve.kernels import cpu_ops
from minserve.kernels.build import cpu_kernels
from minserve.model.seeded_draws import Purpose, reseeded
from minserve.model.token_mask import BitmaskFn, apply_token_bitmask, bitmask_words
from minserve.sampling_params import SamplingParams

Filter = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, per-row setting)
Penalties = Callable[[torch.Tensor, "Sequence[SamplingRow]"], torch.Tensor]  # (logits, rows)
FLOAT32_MAX = torch.finfo(torch.float32).max


class TokenConstraint(Protocol):
    """A sample's grammar state (minserve/structured/): the tokens allowed next."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Set bit j of word w of `bitmask[row]` (int32) iff token 32 w + j is allowed."""
        ...

    def after(self, token_ids: Sequence[int]) -> TokenConstraint:
        """The constraint at the position after `token_ids` (speculative drafts)."""
        ...


@dataclass
class SamplingRow:
    """One sequence being sampled this step: its options, its tokens so far, its RNG.

    A row with a seed (`params.seed`) and a generator draws from that generator re-seeded
    for each draw (`row_generator`); a generator without a seed is drawn as it stands (a
    caller's own stream); no generator: the global RNG.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # a CPU generator; None: the global RNG
    eos_token_ids: tuple[int, ...] = ()  # forbidden, with stop_token_ids, until min_tokens
    constraint: TokenConstraint | None = None  # structured output: read here, never advanced
    sample_index: int = 0  # which of its request's n samples: part of a seeded draw's key

    @property
    def position(self) -> int:
        """The position of the token drawn next: how many tokens come before it."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class SampleResult:
    """The step's tokens (one per row) and, per row, {token id: logprob} or None.

    `failed` holds the rows that could not be sampled (row index -> why); their entries in
    `token_ids` are in range but mean nothing.
    """

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    failed: dict[int, str] = field(default_factory=dict)


# >>> exercise 0.5: top-k filtering
def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k largest logits of each row and set the others to -inf.

    Top-k cuts off the long tail: each of 50k unlikely tokens is rare, but together they
    are drawn often enough to derail a generation. `logits` is [rows, vocab]; `top_k` is
    int64 [rows], one k per row, where k <= 0 turns the filter off for that row and
    k >= vocab keeps every token. Tokens tied with the k-th largest logit are all kept (as
    in Hugging Face and vLLM), so the result depends on the values, never on token ids.
    Returns a new tensor; `logits` is left unchanged.
    """
    # >>> solution
    k = top_k.clamp(min=1, max=logits.shape[-1])  # [rows]
    largest = logits.topk(int(k.max()), dim=-1).values  # [rows, max k], no full sort needed
    kth_largest = largest.gather(-1, (k - 1).unsqueeze(-1))  # [rows, 1]
    kth_largest = kth_largest.masked_fill((top_k <= 0).unsqueeze(-1), float("-inf"))  # off
    return logits.masked_fill(logits < kth_largest, float("-inf"))
    # <<< solution


# <<< exercise


# >>> exercise 0.6: top-p (nucleus) filtering
def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the nucleus: the fewest most-probable tokens whose probabilities sum to >= p.

    Unlike a fixed k, the nucleus follows the model's confidence: one token when it is
    sure, hundreds when it is not (Holtzman et al., 2019). `logits` is [rows, vocab] and
    may already hold -inf (top-k runs first); `top_p` is float [rows] in (0, 1]. The most
    probable token is always kept. Tokens tied with the least probable kept token are kept
    too, so the result depends on the values, never on token ids. p = 1.0 turns the
    filter off: that row comes back unchanged, even tokens whose probability underflows
    to 0 in float32. Tip: in float32, sum the small probabilities first (sort ascending
    and drop the prefix whose cumulative probability is <= 1 - p).
    Returns a new tensor; `logits` is left unchanged.
    """
    # >>> solution
    sorted_asc = logits.sort(dim=-1).values  # [rows, vocab]
    cumulative = sorted_asc.softmax(dim=-1).cumsum(dim=-1)  # [rows, vocab], ends at 1
    dropped = (cumulative <= 1 - top_p.unsqueeze(-1)) & (top_p < 1).unsqueeze(-1)  # a prefix
    num_dropped = dropped.sum(dim=-1).clamp(max=logits.shape[-1] - 1)  # [rows]; keep >= 1
    smallest_kept = sorted_asc.gather(-1, num_dropped.unsqueeze(-1))  # [rows, 1]
    return logits.masked_fill(logits < smallest_kept, float("-inf"))
    # <<< solution


# <<< exercise


# >>> exercise 0.7: min-p filtering
def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep the tokens at least `min_p` times as probable as the most probable one.

    min-p (Nguyen et al., 2024) scales the cut-off with the model's confidence: a peaked
    distribution keeps few tokens, a flat one keeps many. `logits` is [rows, vocab];
    `min_p` is float [rows] in [0, 1], where 0 turns the filter off for that row. No
    softmax is needed: the normaliser cancels in p_i / p_max = exp(logit_i - logit_max),
    so a token is kept exactly when logit_i >= logit_max + log(min_p).
    Returns a new tensor; `logits` is left unchanged.
    """
    # >>> solution
    max_logit = logits.max(dim=-1, keepdim=True).values  # [rows, 1]
    threshold = max_logit + min_p.log().unsqueeze(-1)  # [rows, 1]; log(0) = -inf keeps all
    return logits.masked_fill(logits < threshold, float("-inf"))
    # <<< solution


# <<< exercise


# >>> exercise 0.8: repetition, frequency and presence penalties
def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition (HF / vLLM), frequency and presence (OpenAI) penalties, on a copy.

    The repetition penalty r touches every token seen in the prompt or the output, once
    however often it was seen: positive logits are divided by r and negative ones
    multiplied, so r > 1 always makes a seen token less likely. Frequency and presence look
    at output tokens only: logit -= frequency * count + presence * (count > 0). `logits`
    is [rows, vocab]; row i's settings are `rows[i].params`. A row without penalties
    (`has_penalties`) is left as it is; with none in the batch, `logits` itself may be
    returned. Only seen tokens change, so work on those (hundreds) rather than on the whole
    vocabulary (tens of thousands): `flat_token_ids` gives their positions in the flat
    logits, `per_row` a setting per row. A -inf logit (a forbidden token) stays -inf; a
    penalty below 1 raises positive logits, and one past float32's range is kept at its
    largest value (FLOAT32_MAX) rather than +inf, which would leave nothing to draw from.
    """
    # >>> solution
    penalized = [i for i, row in enumerate(rows) if has_penalties(row.params)]
    if not penalized:
        return logits
    vocab, device = logits.shape[-1], logits.device
    out = logits.clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)  # token t of row i lives at i * vocab + t
    seen = flat_token_ids(rows, penalized, vocab, with_prompt=True).unique()
    produced, counts = flat_token_ids(rows, penalized, vocab, with_prompt=False).unique(
        return_counts=True
    )
    seen, produced, counts = seen.to(device), produced.to(device), counts.to(device)
    repetition = per_row(rows, "repetition_penalty", device)[seen // vocab]  # [num_seen]
    values = flat[seen]
    repeated = torch.where(values > 0, values / repetition, values * repetition)
    flat[seen] = torch.where(values.isfinite(), repeated.clamp(max=FLOAT32_MAX), values)
    frequency = per_row(rows, "frequency_penalty", device)[produced // vocab]  # [num_produced]
    presence = per_row(rows, "presence_penalty", device)[produced // vocab]
    flat[produced] -= frequency * counts + presence
    return out
    # <<< solution


# <<< exercise


def apply_token_bitmasks(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    bitmask_fn: BitmaskFn = apply_token_bitmask,
) -> torch.Tensor:
    """Structured output: each constrained row's forbidden tokens -> -inf (a copy; `logits`
    itself when no row has a grammar).

    Each grammar writes its allowed tokens as bits into one int32 row of a step's bitmask
    (`token_mask.py`); `bitmask_fn` (chapter 12's exercise 12.1) applies them on the logits'
    device (on a CPU with the C kernels the default one runs as `token_mask.c`: the same
    result, each word read once). Ids past the grammar's vocabulary (a model's padding ids)
    have no bit and are forbidden.
    """
    constrained = [i for i, row in enumerate(rows) if row.constraint is not None]
    if not constrained:
        return logits
    bitmask = torch.zeros((len(constrained), bitmask_words(logits.shape[-1])), dtype=torch.int32)
    for j, i in enumerate(constrained):
        rows[i].constraint.fill_bitmask(bitmask, j)  # type: ignore[union-attr]
    if bitmask_fn is apply_token_bitmask and _c_mask_applies(logits):  # the same, in C
        masked = cpu_ops.mask_rows(logits[constrained], bitmask)  # a copy's rows, in place
    else:
        masked = bitmask_fn(logits[constrained], bitmask)  # [constrained, vocab]
    if len(constrained) == len(rows):
        return masked
    out = logits.clone()
    out[constrained] = masked
    return out


def _c_mask_applies(logits: torch.Tensor) -> bool:
    """Whether `token_mask.c` can apply the mask: fp32 logits on a CPU with the C kernels."""
    return logits.is_cpu and logits.dtype == torch.float32 and cpu_kernels() is not None


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """OpenAI's `logit_bias`: add each row's {token id: bias} to its logits (a copy;
    `logits` itself when no row has one). A bias of -100 all but bans a token, +100 all but
    forces it; a token the grammar forbids stays -inf."""
    row_index: list[int] = []
    token_index: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            row_index.append(i)
            token_index.append(token_id)
            biases.append(bias)
    if not row_index:
        return logits
    out = logits.clone()
    out[row_index, token_index] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    return out


def suppress_stop_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """min_tokens: forbid EOS and `stop_token_ids` while a row has fewer outputs (a copy)."""
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            stops = sorted({*row.eos_token_ids, *(row.params.stop_token_ids or ())})
            row_index += [i] * len(stops)
            token_index += stops
    if not row_index:
        return logits
    out = logits.clone()
    out[row_index, token_index] = float("-inf")
    return out


class Sampler:
    """Turns a step's logits [num_rows, vocab] into one token per row (see module doc)."""

    def __init__(
        self,
        top_k_fn: Filter = apply_top_k,
        top_p_fn: Filter = apply_top_p,
        min_p_fn: Filter = apply_min_p,
        penalties_fn: Penalties = apply_penalties,
        bitmask_fn: BitmaskFn = apply_token_bitmask,
    ) -> None:
        self.top_k_fn = top_k_fn
        self.top_p_fn = top_p_fn
        self.min_p_fn = min_p_fn
        self.penalties_fn = penalties_fn
        self.bitmask_fn = bitmask_fn  # chapter 12's exercise 12.1

    @classmethod
    def from_module(cls, module: ModuleType) -> Sampler:
        """A sampler using `module`'s apply_top_k / apply_top_p / apply_min_p and
        apply_penalties (chapter 00)."""
        names = ("apply_top_k", "apply_top_p", "apply_min_p", "apply_penalties")
        missing = [name for name in names if not hasattr(module, name)]
        if missing:
            raise AttributeError(f"module {module.__name__} does not define {', '.join(missing)}")
        return cls(*(getattr(module, name) for name in names))

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        if logits.ndim != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows={len(rows)}, vocab], got shape {tuple(logits.shape)}"
            )
        logits = apply_token_bitmasks(logits.float(), rows, self.bitmask_fn)
        raw_logprobs = logits.log_softmax(dim=-1) if _wants_logprobs(rows) else None
        logits = self.processed(logits, rows)
        failed = unsampleable_rows(logits, rows)
        drawn = [i for i, row in enumerate(rows) if not row.params.greedy and i not in failed]
        if len(drawn) < len(rows):
            token_ids = logits.argmax(dim=-1)  # [rows]; right for greedy rows
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if drawn:
            token_ids[drawn] = self._sample_rows(logits, drawn, [rows[i] for i in drawn])
        logprobs = logprob_dicts(raw_logprobs, token_ids, rows)
        return SampleResult(token_ids.tolist(), logprobs, failed)

    def processed(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Masked float32 logits [rows, vocab] -> with logit bias, penalties and min_tokens
        applied (steps 2-4 of the module doc): what the argmax, or temperature and the
        filters, start from."""
        logits = apply_logit_bias(logits, rows)
        return suppress_stop_tokens(self.penalties_fn(logits, rows), rows)

    def _sample_rows(
        self, logits: torch.Tensor, drawn: list[int], rows: list[SamplingRow]
    ) -> torch.Tensor:
        """Rows `drawn` of logits [all rows, vocab], whose SamplingRows are `rows`: [drawn].
        Rows with temperature only (no filter) are drawn in C on a CPU (`draw_rows.c`: the
        same draw in two passes per row instead of eight); the rest by `_sample`."""
        if logits.is_cpu and logits.dtype == torch.float32 and not any(map(filters, rows)):
            if cpu_kernels() is not None:
                temperatures = per_row(rows, "temperature", logits.device)  # [drawn]
                return cpu_ops.draw_rows(logits, drawn, temperatures, row_uniforms(rows, "cpu"))
        return self._sample(logits[drawn], rows)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, the filters a row asked for, then an inverse-CDF draw: [rows]."""
        return draw_from_logits(self.filtered(logits, rows), row_uniforms(rows, logits.device))

    def filtered(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Logits [rows, vocab] divided by each row's temperature, then top-k, top-p and
        min-p where a row asked for them (filtered tokens -inf): what `_sample` draws from.

        Each row is first shifted so its largest logit is 0. Softmax and the filters do not
        change under a shift, and the division cannot overflow: a logit of 1e36 over a
        temperature of 1e-3 would be +inf in float32, a shifted logit only goes to -inf."""
        device, vocab = logits.device, logits.shape[-1]
        shifted = logits - logits.amax(dim=-1, keepdim=True)  # [rows, vocab], each max 0
        logits = shifted / per_row(rows, "temperature", device).unsqueeze(-1)  # [rows, vocab]
        if any(row.params.top_k > 0 for row in rows):
            top_k = [min(row.params.top_k, vocab) for row in rows]  # capped: fits int64
            logits = self.top_k_fn(logits, torch.tensor(top_k, device=device))
        if any(row.params.top_p < 1 for row in rows):
            logits = self.top_p_fn(logits, per_row(rows, "top_p", device))
        if any(row.params.min_p > 0 for row in rows):
            logits = self.min_p_fn(logits, per_row(rows, "min_p", device))
        return logits


def filters(row: SamplingRow) -> bool:
    """Whether a drawn row asked for top-k, top-p or min-p (beyond its temperature)."""
    params = row.params
    return params.top_k > 0 or params.top_p < 1 or params.min_p > 0


def draw_from_logits(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse transform sampling: logits [rows, vocab], u [rows] in [0, 1) -> tokens [rows].

    The token drawn is the first whose cumulative probability exceeds u. A token filtered
    to -inf has probability 0, so the CDF does not rise there and it is never the first to
    exceed u. One uniform per row (not one random number per vocabulary entry, as the
    exponential race or Gumbel-max would need) keeps the draw cheap on a CPU. An fp32 CDF
    is enough: each step of it is one token's probability rounded to the CDF's precision,
    so no token's probability moves by more than about 1e-7.
    """
    probs = logits.softmax(dim=-1)  # [rows, vocab]
    cdf = probs.cumsum(dim=-1)  # [rows, vocab]
    total = cdf[:, -1:]  # [rows, 1]
    below_total = torch.nextafter(total, torch.zeros_like(total))  # u * total may round up
    target = torch.minimum(uniforms.unsqueeze(-1) * total, below_total)  # [rows, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [rows]


def unsampleable_rows(
    logits: torch.Tensor, rows: Sequence[SamplingRow] | None = None
) -> dict[int, str]:
    """The rows of `logits` [rows, vocab] no token can be drawn from, and why.

    One reduction tells: a row's max is NaN if any logit is NaN (torch's max propagates it),
    +inf if any is +inf, and -inf only if every token is forbidden (for a row with a
    grammar: it allows nothing the vocabulary can spell, or min_tokens outlasts it).
    """
    top = logits.amax(dim=-1)  # [rows]
    bad = (~top.isfinite()).nonzero().flatten().tolist()
    constrained = {i for i, row in enumerate(rows or ()) if row.constraint is not None}
    return {i: _unsampleable_reason(top[i].item(), i in constrained) for i in bad}


def _unsampleable_reason(top: float, constrained: bool) -> str:
    if math.isnan(top):
        return "its logits hold NaN"
    if top > 0:
        return "its logits hold +inf"
    if constrained:
        return f"{GRAMMAR_DEAD_END} (or min_tokens outlasts the grammar)"
    return "every token is forbidden (all logits are -inf)"


def is_plain_greedy(row: SamplingRow) -> bool:
    """Whether the sampler would answer this row with the plain argmax of its logits: greedy,
    no logprobs, no logit bias, no penalties, no grammar (its mask comes first), and no stop
    tokens to forbid yet (min_tokens)."""
    params = row.params
    return (
        params.greedy
        and row.constraint is None
        and not params.logit_bias
        and params.logprobs is None
        and not has_penalties(params)
        and not (
            len(row.output_token_ids) < params.min_tokens
            and (row.eos_token_ids or params.stop_token_ids)
        )
    )


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1
        or params.frequency_penalty != 0
        or params.presence_penalty != 0
    )


def flat_token_ids(
    rows: Sequence[SamplingRow], indices: list[int], vocab: int, with_prompt: bool
) -> torch.Tensor:
    """The output (and prompt) tokens of rows `indices`, as positions in flat [rows * vocab]."""
    parts = [torch.empty(0, dtype=torch.long)]
    for i in indices:
        prompt = [*rows[i].prompt_token_ids] if with_prompt else []
        ids = torch.tensor(prompt + [*rows[i].output_token_ids], dtype=torch.long)
        if ids.numel() and not (ids.min() >= 0 and ids.max() < vocab):
            raise ValueError(f"row {i} holds token ids outside [0, {vocab}), the logits' vocab")
        parts.append(ids + i * vocab)
    return torch.cat(parts)  # [total tokens], with repeats


def per_row(
    rows: Sequence[SamplingRow],
    name: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One SamplingParams field across the rows: [rows]."""
    return torch.tensor([getattr(row.params, name) for row in rows], dtype=dtype, device=device)


def row_generator(row: SamplingRow, purpose: Purpose = "sample") -> torch.Generator | None:
    """The generator `row`'s next draw for `purpose` comes from: a seeded row's own, re-seeded
    in place for (seed, sample index, position, purpose) (`seeded_draws.py`); a generator
    given without a seed, as it stands; None for the global RNG."""
    if row.generator is None or row.params.seed is None:
        return row.generator
    return reseeded(row.generator, row.params.seed, row.sample_index, row.position, purpose)


def row_uniforms(
    rows: Sequence[SamplingRow], device: torch.device, purpose: Purpose = "sample"
) -> torch.Tensor:
    """One U[0, 1) draw per row: [rows]. Rows with a generator draw from `row_generator`, a
    CPU one (so a seed gives the same tokens on any device), and the draws move to `device`."""
    u = torch.rand(len(rows), device=device)  # the global RNG, for unseeded rows
    seeded = [i for i, row in enumerate(rows) if row.generator is not None]
    if seeded:
        draws = [torch.rand(1, generator=row_generator(rows[i], purpose))[0] for i in seeded]
        u[seeded] = torch.stack(draws).to(device)
    return u


def _wants_logprobs(rows: Sequence[SamplingRow]) -> bool:
    return any(row.params.logprobs is not None for row in rows)


def logprob_dicts(
    raw_logprobs: torch.Tensor | None, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
) -> list[dict[int, float] | None]:
    """Per row: the sampled token's logprob, then the top `params.logprobs` ones (vLLM's order)."""
    if raw_logprobs is None:
        return [None] * len(rows)
    top_n = min(max(row.params.logprobs or 0 for row in rows), raw_logprobs.shape[-1])
    top_values, top_ids = raw_logprobs.topk(top_n, dim=-1)  # [rows, top_n] each
    sampled = raw_logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # [rows]
    top_values, top_ids, sampled = top_values.tolist(), top_ids.tolist(), sampled.tolist()
    sampled_ids = token_ids.tolist()
    dicts: list[dict[int, float] | None] = []
    for i, row in enumerate(rows):
        n = row.params.logprobs
        if n is None:
            dicts.append(None)
            continue
        entries = {sampled_ids[i]: sampled[i]}
        entries.update(zip(top_ids[i][:n], top_values[i][:n], strict=True))
        dicts.append(entries)
    return dicts
