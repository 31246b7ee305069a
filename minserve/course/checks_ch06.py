"""Checks for chapter 06 (speculative decoding), run against any module that defines
`residual_distribution`, `rejection_sample`, `latest_earlier_match`, `NgramProposer`, the
adaptive `DraftLengths` and `EarlyExitProposer`: minserve's own, the solutions, or a
student's exercise file.

Edge cases are chosen so that the answer is forced (a residual with one token left, a draft
the target never picks); the distribution checks draw thousands of verifications with a
fixed seed and bound the total-variation distance to the target, so they are stable.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from types import ModuleType

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve.attention.contiguous import ContiguousAttention, ContiguousSlice, SequenceKV
from minserve.attention.paged_torch import TorchPagedAttention
from minserve.course.nonfinite import lead_with_nonfinite
from minserve.course.randomized import randomized
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.messages import ScheduledChunk
from minserve.model.llama import CausalLM
from minserve.model.runner import ModelRunner, slot_of
from minserve.model.sampler import Sampler, SamplingRow
from minserve.model_config import ModelConfig
from minserve.sampling_params import SamplingParams
from minserve.speculative import draft_length as reference_lengths
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.distributions import processed_logits, row_after
from minserve.speculative.ngram import NgramProposer, latest_earlier_match

NUM_SAMPLES = 6000
TV_BOUND = 0.03  # TV of 6000 draws over 4 tokens is about 0.01; a wrong rule is off by >0.1
P = torch.tensor([0.5, 0.3, 0.15, 0.05])  # the target
Q = torch.tensor([0.1, 0.6, 0.1, 0.2])  # a draft that over-proposes tokens 1 and 3


def _rounded(values: torch.Tensor) -> list[float]:
    return [round(float(v), 4) for v in values]


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _first_token_frequencies(
    impl: ModuleType, target: torch.Tensor, draft: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Frequencies of the first token returned over NUM_SAMPLES one-draft verifications,
    the draft itself drawn from `draft`, and the fraction of drafts accepted."""
    generator = _generator()
    counts = torch.zeros(len(target))
    accepted = 0
    target_rows = torch.stack([target, target])  # [k + 1 = 2, vocab]
    for _ in range(NUM_SAMPLES):
        proposal = int(torch.multinomial(draft, 1, generator=generator))
        tokens = impl.rejection_sample(target_rows, draft[None], [proposal], generator)
        counts[tokens[0]] += 1
        accepted += len(tokens) == 2
    return counts / NUM_SAMPLES, accepted / NUM_SAMPLES


def check_the_residual_keeps_only_what_the_target_wants_more_of(impl: ModuleType) -> None:
    """max(0, p - q) normalised: p = [0.5, 0.3, 0.15, 0.05], q = [0.1, 0.6, 0.1, 0.2]."""
    got = impl.residual_distribution(P, Q)
    expected = torch.tensor([0.4, 0.0, 0.05, 0.0]) / 0.45
    assert torch.allclose(got, expected, atol=1e-6), lead_with_nonfinite(
        got,
        f"residual_distribution(p={_rounded(P)}, q={_rounded(Q)}): expected "
        f"{_rounded(expected)}, got {_rounded(got)}",
    )


def check_the_residual_of_a_one_hot_draft_is_the_target_without_it(impl: ModuleType) -> None:
    """A deterministic draft (q one-hot at token 1): the residual is p with token 1 removed."""
    one_hot = torch.tensor([0.0, 1.0, 0.0, 0.0])
    got = impl.residual_distribution(P, one_hot)
    expected = torch.tensor([0.5, 0.0, 0.15, 0.05]) / 0.7
    assert torch.allclose(got, expected, atol=1e-6), lead_with_nonfinite(
        got,
        f"residual_distribution(p={_rounded(P)}, q={_rounded(one_hot)}): expected "
        f"{_rounded(expected)}, got {_rounded(got)}",
    )


def check_the_residual_of_equal_distributions_is_the_target(impl: ModuleType) -> None:
    """p == q leaves no excess mass: return p itself (no NaN from 0 / 0), row by row."""
    rows = torch.stack([P, Q])  # [2, vocab]
    got = impl.residual_distribution(rows, rows)
    assert torch.equal(got, rows), lead_with_nonfinite(
        got,
        f"residual_distribution(p, p) for rows {[_rounded(r) for r in rows]}: expected p "
        f"itself, got {[_rounded(r) for r in got]}",
    )


def check_drafts_equal_to_the_target_are_all_kept_plus_a_bonus(impl: ModuleType) -> None:
    """q == p at every position: all 3 drafts are kept, then the bonus from row k (one-hot)."""
    target = torch.stack([P, Q, P, torch.tensor([0.0, 0.0, 1.0, 0.0])])  # [k + 1 = 4, vocab]
    got = impl.rejection_sample(target, target[:3], [0, 1, 3], _generator())
    assert got == [0, 1, 3, 2], (
        "3 drafts [0, 1, 3] with q == p at each position and row 3 one-hot at token 2: "
        f"expected [0, 1, 3, 2], got {got}"
    )


def check_a_draft_the_target_never_picks_is_replaced_from_the_residual(impl: ModuleType) -> None:
    """p(d) = 0 rejects d at once; the residual leaves one token, which ends the output."""
    target = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.25] * 4, [0.25] * 4])  # [k + 1 = 3, vocab]
    draft = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25] * 4])  # [k = 2, vocab]
    for seed in range(5):
        got = impl.rejection_sample(target, draft, [1, 0], _generator(seed))
        assert got == [2], (
            f"seed {seed}: the target gives draft 1 probability 0 and all its mass to token 2: "
            f"expected [2] (reject, resample, stop), got {got}"
        )


def check_a_rejection_stops_the_walk(impl: ModuleType) -> None:
    """Draft 0 kept (p = q), draft 1 rejected (p(d) = 0): two tokens, the second resampled."""
    target = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.25] * 4])
    draft = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    got = impl.rejection_sample(target, draft, [0, 1], _generator())
    assert got == [0, 3], (
        "draft 0 where p = q = one-hot, draft 1 where p gives it 0 and token 3 all: "
        f"expected [0, 3], got {got}"
    )


def check_the_first_token_is_distributed_as_the_target(impl: ModuleType) -> None:
    """Drafts drawn from q, verified against p: the first token's frequencies match p."""
    freqs, accepted = _first_token_frequencies(impl, P, Q)
    tv = 0.5 * float((freqs - P).abs().sum())
    assert tv < TV_BOUND, (
        f"{NUM_SAMPLES} verifications of one draft from q={_rounded(Q)}: expected token "
        f"frequencies close to p={_rounded(P)} (total variation < {TV_BOUND}), got "
        f"{_rounded(freqs)} (total variation {tv:.3f})"
    )
    expected = float(torch.minimum(P, Q).sum())  # 1 - TV(p, q)
    assert abs(accepted - expected) < 0.03, (
        f"acceptance rate: expected sum(min(p, q)) = {expected:.3f}, got {accepted:.3f}"
    )


def check_a_one_hot_draft_also_leaves_the_target_unchanged(impl: ModuleType) -> None:
    """Always proposing token 0 (a deterministic draft, q one-hot): still distributed as p."""
    one_hot = torch.tensor([1.0, 0.0, 0.0, 0.0])
    freqs, accepted = _first_token_frequencies(impl, P, one_hot)
    tv = 0.5 * float((freqs - P).abs().sum())
    assert tv < TV_BOUND, (
        f"{NUM_SAMPLES} verifications of the draft token 0 (q one-hot): expected frequencies "
        f"close to p={_rounded(P)} (total variation < {TV_BOUND}), got {_rounded(freqs)}"
    )


def check_each_position_is_verified_against_its_own_row(impl: ModuleType) -> None:
    """Each position has its own p: after a kept first draft, the second follows p's row 1.

    Two drafts from q's rows 0 and 1; the second token's frequencies must match row 1 of p
    (a walk that reuses row 0 fails)."""
    target = torch.stack([P, P.flip(0), P])  # [k + 1 = 3, vocab]: row 1 is p reversed
    draft = torch.stack([Q, Q.flip(0)])  # [k = 2, vocab]
    generator, counts = _generator(), torch.zeros(len(P))
    for _ in range(NUM_SAMPLES):
        drafts = [int(torch.multinomial(row, 1, generator=generator)) for row in draft]
        tokens = impl.rejection_sample(target, draft, drafts, generator)
        if tokens[0] == drafts[0] and len(tokens) >= 2:  # the first draft was kept
            counts[tokens[1]] += 1
    freqs, expected = counts / counts.sum(), target[1]
    tv = 0.5 * float((freqs - expected).abs().sum())
    assert tv < 2 * TV_BOUND, (
        f"second token after a kept first draft: expected frequencies close to row 1 of p, "
        f"{_rounded(expected)} (total variation < {2 * TV_BOUND}), got {_rounded(freqs)}"
    )


# Exercises 6.3 and 6.4: prompt lookup, on hand-made and random histories.
def check_the_latest_earlier_match_wins(impl: ModuleType) -> None:
    """[1, 2, 1, 2, 1, 2]: [1, 2] last occurred earlier at 2 (0 is older; 4 is the pattern)."""
    cases = [
        ([1, 2, 1, 2, 1, 2], 2, 2),
        ([1, 2, 1, 2, 1, 2], 1, 3),
        ([5, 6, 7, 5, 6], 2, 0),
        ([5, 6, 7, 5, 6], 3, None),
        ([1, 1, 1], 2, 0),  # overlaps the pattern, still followed by a token
        ([4, 3, 2, 1], 1, None),
    ]
    for history, n, expected in cases:
        got = impl.latest_earlier_match(history, n)
        assert got == expected, (
            f"latest_earlier_match({history}, n={n}): expected {expected}, got {got}"
        )


def _proposer(impl: ModuleType, max_n: int, min_n: int = 1):
    config = SpeculativeConfig("ngram", 4, prompt_lookup_max=max_n, prompt_lookup_min=min_n)
    return impl.NgramProposer(config)


def check_lookup_prefers_the_longest_matching_context(impl: ModuleType) -> None:
    """[1, 2, 9, 1, 2, 7, 8, 1, 2], max_n=2: the 2-gram [1, 2] at 3 gives [7, 8, 1]."""
    cases = [
        (2, 1, [1, 2, 9, 1, 2, 7, 8, 1, 2], 3, [7, 8, 1]),
        (3, 1, [1, 2, 3, 9, 2, 3, 5, 1, 2, 3], 2, [9, 2]),  # the 3-gram beats the later 2-gram
        (2, 1, [5, 6, 7, 5], 2, [6, 7]),  # no 2-gram match: n = 1
        (2, 2, [5, 6, 7, 5], 2, []),  # min_n = 2: no match at all
        (4, 1, [1, 2, 3], 4, []),
        (2, 1, [3, 4, 5, 3], 9, [4, 5, 3]),  # fewer than k tokens follow
    ]
    for max_n, min_n, history, k, expected in cases:
        got = _proposer(impl, max_n, min_n).lookup(history, k)
        assert got == expected, (
            f"lookup({history}, k={k}) with prompt_lookup_max={max_n}, prompt_lookup_min="
            f"{min_n}: expected {expected}, got {got}"
        )


_SETTINGS = settings(
    max_examples=150, deadline=None, database=None, derandomize=True, report_multiple_bugs=False
)
_histories = st.lists(st.integers(0, 3), min_size=1, max_size=14)


def check_random_histories_match_minserves_lookup(impl: ModuleType) -> None:
    """Random histories over 4 tokens, random k and n range: the same drafts as minserve's."""

    @_SETTINGS
    @given(_histories, st.integers(1, 5), st.integers(1, 4), st.integers(0, 3))
    def run(history: list[int], k: int, max_n: int, extra: int) -> None:
        min_n = max(1, max_n - extra)
        for n in range(1, len(history)):
            got, expected = impl.latest_earlier_match(history, n), latest_earlier_match(history, n)
            assert got == expected, (
                f"latest_earlier_match({history}, n={n}): expected {expected}, got {got}"
            )
        ours = NgramProposer(SpeculativeConfig("ngram", k, max_n, min_n))
        got, expected = _proposer(impl, max_n, min_n).lookup(history, k), ours.lookup(history, k)
        assert got == expected, (
            f"lookup({history}, k={k}) with prompt_lookup_max={max_n}, prompt_lookup_min="
            f"{min_n}: expected {expected}, got {got}"
        )

    run()


# --- exercise 6.5: the adaptive draft length, against minserve's -------------------------


def check_the_best_draft_length_follows_the_acceptance_rate(impl: ModuleType) -> None:
    """Useless drafts (a = 0) get 1, free perfect ones (a = 1, c = 0) get k; else minserve's g"""
    for a, c, k, expected in [(0.0, 0.1, 5, 1), (1.0, 0.0, 5, 5), (0.9, 0.05, 8, None)]:
        expected = expected or reference_lengths.best_draft_length(a, c, k)
        got = impl.best_draft_length(a, c, k)
        assert got == expected, (
            f"best_draft_length(a={a}, c={c}, k={k}): expected {expected}, got {got}"
        )

    @randomized(300)
    @given(st.floats(0, 1), st.floats(0, 1.5), st.integers(1, 10))
    def agree(a: float, c: float, k: int) -> None:
        expected = reference_lengths.best_draft_length(a, c, k)
        got = impl.best_draft_length(a, c, k)
        assert got == expected, (
            f"best_draft_length(a={a}, c={c}, k={k}): expected {expected} (the shortest g "
            f"within {reference_lengths.TOLERANCE:.0%} of the best speedup), got {got}"
        )

    agree()


def check_the_acceptance_estimate_counts_tested_drafts(impl: ModuleType) -> None:
    """3 drafts, 1 accepted: 2 were tested (the rejected one too); counts decay by DECAY"""
    estimate = impl.AcceptanceEstimate()
    estimate.observe(3, 1)
    ref = reference_lengths.AcceptanceEstimate()
    ref.observe(3, 1)
    got, expected = (estimate.accepted, estimate.tested), (ref.accepted, ref.tested)
    assert got == expected, (
        "a fresh estimate (prior 1 accepted of 2 tested) after 3 drafts, 1 accepted: expected "
        f"(accepted, tested) == {expected}, got {got}"
    )

    @randomized(200)
    @given(
        st.lists(
            st.integers(1, 6).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))),
            max_size=12,
        )
    )
    def agree(steps: list[tuple[int, int]]) -> None:
        yours, ours = impl.AcceptanceEstimate(), reference_lengths.AcceptanceEstimate()
        for drafts, accepted in steps:
            yours.observe(drafts, accepted)
            ours.observe(drafts, accepted)
        got, expected = (yours.accepted, yours.tested), (ours.accepted, ours.tested)
        assert abs(got[0] - expected[0]) < 1e-9 and abs(got[1] - expected[1]) < 1e-9, (
            f"after observing (drafts, accepted) {steps}: expected (accepted, tested) == "
            f"{expected}, got {got}"
        )

    agree()


def check_draft_lengths_per_sequence_match_minserves(impl: ModuleType) -> None:
    """Fixed mode always gives k; adaptive gives each sequence minserve's length as it learns"""
    fixed = impl.DraftLengths("fixed", 4)
    fixed.observe("a", 4, 0)
    got = (fixed.length("a", 0.1), len(fixed.estimates))
    assert got == (4, 0), (
        "mode 'fixed', k=4, after a step with every draft rejected: expected length 4 and no "
        f"estimates kept, got length {got[0]} and {got[1]} estimates"
    )
    step = st.tuples(st.sampled_from("abc"), st.integers(0, 5), st.integers(0, 5), st.floats(0, 1))

    def play(steps: list[tuple[str, int, int, float]]) -> None:
        yours = impl.DraftLengths("adaptive", 5)
        ours = reference_lengths.DraftLengths("adaptive", 5)
        for i, (seq, drafts, accepted, cost) in enumerate(steps):
            accepted = min(accepted, drafts)
            expected, got = ours.length(seq, cost), yours.length(seq, cost)
            assert got == expected, (
                f"adaptive, k=5, steps (sequence, drafts, accepted, cost ratio) {steps}: at "
                f"step {i}, length({seq!r}, {cost}): expected {expected}, got {got}"
            )
            ours.observe(seq, drafts, accepted)
            yours.observe(seq, drafts, accepted)

    play([("a", 5, 0, 0.1), ("a", 5, 0, 0.1), ("b", 0, 0, 0.1), ("a", 2, 2, 0.1)])

    @randomized(150)
    @given(st.lists(step, max_size=15))
    def agree(steps: list[tuple[str, int, int, float]]) -> None:
        play(steps)

    agree()


# --- exercise 6.6: the early-exit draft, against the first layers run over the whole history -
#
# A tiny random 3-layer Llama in float32 serves as the target. Each decode's earlier tokens are
# prefilled into a paged pool by the target (every layer), exactly as the engine leaves them;
# the oracle runs the first L layers over the whole history (contiguous attention, no paged KV
# at all) and takes the argmax, or the processed q, at the last position, one draft at a time.

EXIT_CONFIG = ModelConfig(
    architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=3,
    num_heads=2, num_kv_heads=1, head_dim=32, rms_norm_eps=1e-6, rope_theta=10_000.0,
    max_position_embeddings=128, tie_word_embeddings=False,
)  # fmt: skip
EXIT_BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0)
# frequency and presence penalties count output tokens: the q of draft j differs when the
# drafts before it are not counted as output (`row_after`)
SAMPLING = SamplingParams(temperature=0.8, top_k=24, frequency_penalty=1.5, presence_penalty=0.5)


@functools.cache
def _exit_model() -> CausalLM:
    torch.manual_seed(6)
    model = CausalLM(EXIT_CONFIG).eval()
    with torch.no_grad():  # small embeddings: attention over the context, not the token, leads
        model.model.embed_tokens.weight.mul_(0.05)
    return model


@dataclass
class _Decodes:
    """A target runner whose pool holds each history's earlier tokens, and its decode chunks."""

    runner: ModelRunner
    chunks: list[ScheduledChunk]


def _decodes(histories: list[list[int]], limits: list[int], params: SamplingParams) -> _Decodes:
    """Each history's tokens but the last prefilled by the target; decode chunks of the last
    token, with slots for `limits[i]` drafts after it (as the scheduler reserves them)."""
    model = _exit_model()
    pool = PagedKVPool(EXIT_CONFIG, 48, EXIT_BLOCK_SIZE, torch.float32, "cpu")
    runner = ModelRunner(model, pool, TorchPagedAttention)
    # scattered blocks, as a pool in use hands them out; room for a few slots past the limit,
    # so that drafting too far shows up as a wrong slot, not a crash
    free = iter(torch.randperm(pool.num_blocks - 1, generator=_generator(6)).add(1).tolist())
    chunks = []
    for i, (history, limit) in enumerate(zip(histories, limits, strict=True)):
        blocks = tuple(next(free) for _ in range(-(-(len(history) + 4) // EXIT_BLOCK_SIZE)))
        runner.run([ScheduledChunk(i, str(i), tuple(history[:-1]), 0, blocks)])
        row = SamplingRow(params, history[:-1], history[-1:], torch.Generator().manual_seed(i))
        decode = ScheduledChunk(i, str(i), (history[-1],), len(history) - 1, blocks, (row,))
        chunks.append(replace(decode, num_draft_slots=limit, num_prompt_tokens=len(history) - 1))
    return _Decodes(runner, chunks)


@torch.inference_mode()
def _exit_logits(tokens: list[int], num_layers: int) -> torch.Tensor:
    """The oracle: logits [vocab] after `tokens`, from the first `num_layers` layers run over
    the whole sequence with contiguous attention (no paged pool involved)."""
    model, n = _exit_model(), len(tokens)
    kv = SequenceKV(EXIT_CONFIG, n, torch.float32, torch.device("cpu"))
    attention = ContiguousAttention([ContiguousSlice(kv, 0, n)])
    hidden = model(torch.tensor(tokens), torch.arange(n), attention, num_layers)  # [n, hidden]
    return model.compute_logits(hidden[-1:])[0]


def _greedy_exit(history: list[int], k: int, num_layers: int) -> list[int]:
    """The oracle's k greedy drafts: argmax of the early exit, one token at a time."""
    drafts: list[int] = []
    for _ in range(k):
        drafts.append(int(_exit_logits(history + drafts, num_layers).argmax()))
    return drafts


def _propose(impl: ModuleType, decodes: _Decodes, limits: list[int], num_layers: int) -> list:
    config = SpeculativeConfig("early_exit", max(max(limits), 1), num_draft_layers=num_layers)
    proposer = impl.EarlyExitProposer(config, decodes.runner)
    drafts = proposer.propose(decodes.chunks, list(limits))
    assert len(drafts) == len(decodes.chunks), (
        f"propose for {len(decodes.chunks)} decodes: expected one Draft each, got {len(drafts)}"
    )
    return drafts


def check_early_exit_drafts_what_the_first_layers_predict(impl: ModuleType) -> None:
    """One greedy decode, 4 drafts: the argmax of the first L layers after each, L = 1 and 2"""
    history = [5, 17, 3, 40, 22, 9, 31]
    for num_layers in (1, 2):
        decodes = _decodes([history], [4], GREEDY)
        (draft,) = _propose(impl, decodes, [4], num_layers)
        expected = _greedy_exit(history, 4, num_layers)
        assert list(draft.token_ids) == expected, (
            f"early exit after {num_layers} of 3 layers, greedy, history {history} (its last "
            f"token is the decode's, at position {len(history) - 1}), limit 4: expected drafts "
            f"{expected} (the argmax of the first {num_layers} layers run over the whole "
            f"history and the drafts before), got {list(draft.token_ids)}"
        )


def check_each_decode_in_a_batch_drafts_up_to_its_own_limit(impl: ModuleType) -> None:
    """Three decodes of different lengths, limits [3, 0, 1]: each its own drafts, no more"""
    histories = [[5, 17, 3, 40, 22], [8, 8, 2], [61, 7, 30, 30, 12, 4, 19, 50, 2]]
    limits = [3, 0, 1]
    decodes = _decodes(histories, limits, GREEDY)
    got = [list(d.token_ids) for d in _propose(impl, decodes, limits, 2)]
    expected = [_greedy_exit(h, k, 2) for h, k in zip(histories, limits)]
    assert got == expected, (
        f"a batch of 3 greedy decodes (histories {histories}, limits {limits}, early exit "
        f"after 2 of 3 layers): expected drafts {expected} (each at most its own limit, each "
        f"from its own positions and blocks), got {got}"
    )


def check_drafting_writes_only_the_reserved_slots_of_the_first_layers(impl: ModuleType) -> None:
    """Round j writes the newest token's K/V at position start + j, layers < L, nowhere else"""
    histories, limits, num_layers = [[5, 17, 3, 40, 22], [61, 7, 30, 30, 12, 4]], [3, 2], 2
    decodes = _decodes(histories, limits, GREEDY)
    pool = decodes.runner.kv.kv  # [num_layers, 2, num_blocks, block_size, Hkv, D]
    before = pool.clone()
    _propose(impl, decodes, limits, num_layers)
    changed = (pool != before).flatten(2, 3).flatten(3).any(dim=-1)  # [layers, 2, slots]
    expected = torch.zeros_like(changed)
    for chunk, limit in zip(decodes.chunks, limits):
        for position in range(chunk.start, chunk.start + limit):
            expected[:num_layers, :, slot_of(chunk.block_table, EXIT_BLOCK_SIZE, position)] = True
    if not torch.equal(changed, expected):
        wrong = sorted({int(s) for s in (changed & ~expected).nonzero()[:, 2]})
        missed = sorted({int(s) for s in (expected & ~changed).nonzero()[:, 2]})
        deep = bool(changed[num_layers:].any())
        raise AssertionError(
            f"2 decodes (starts {[c.start for c in decodes.chunks]}, block tables "
            f"{[list(c.block_table) for c in decodes.chunks]}, block size {EXIT_BLOCK_SIZE}), "
            f"limits {limits}, early exit after {num_layers} of 3 layers: round j should write "
            f"K/V only at the slot of position start + j of each sequence, in layers below "
            f"{num_layers}. Slots written that should not be: {wrong}; slots expected but not "
            f"written: {missed}" + ("; layers past the exit were written too" if deep else "")
        )


def check_sampling_drafts_come_with_the_early_exits_processed_q(impl: ModuleType) -> None:
    """A sampling row: q's row j is the processed early exit after the drafts before j"""
    history, k, num_layers = [5, 17, 3, 40, 22, 9, 31], 4, 2
    decodes = _decodes([history], [k], SAMPLING)
    (draft,) = _propose(impl, decodes, [k], num_layers)
    tokens = list(draft.token_ids)
    assert len(tokens) == k and draft.probs is not None, (
        f"a sampling decode (temperature 0.8, top_k 24), limit {k}: expected {k} drafts with "
        f"their q rows [{k}, vocab] in Draft.probs, got {len(tokens)} drafts and probs "
        f"{None if draft.probs is None else list(draft.probs.shape)}"
    )
    row, sampler = decodes.chunks[0].samples[0], Sampler()
    for j in range(k):
        logits = _exit_logits(history + tokens[:j], num_layers)[None]  # [1, vocab]
        expected = processed_logits(sampler, logits, [row_after(row, tokens[:j])]).softmax(-1)[0]
        got = draft.probs[j].float()
        assert torch.allclose(got, expected, atol=1e-5), lead_with_nonfinite(
            got,
            f"a sampling decode (temperature 0.8, top_k 24, frequency and presence penalties), "
            f"history {history}, drafts {tokens}: q's row {j} should be the early exit's "
            f"processed distribution after drafts {tokens[:j]}, counted as output; off by up "
            f"to {float((got - expected).abs().max()):.3g}",
        )
        assert expected[tokens[j]] > 0, (
            f"draft {j} ({tokens[j]}) has probability 0 under its own q: it was not drawn from it"
        )


def check_a_row_that_cannot_be_sampled_stops_only_its_sequence(impl: ModuleType) -> None:
    """NaN K/V in one decode's blocks: it drafts nothing; the other still drafts its 3"""
    histories, limits = [[5, 17, 3, 40, 22], [61, 7, 30, 30, 12, 4]], [3, 3]
    decodes = _decodes(histories, limits, GREEDY)
    poisoned = list(decodes.chunks[0].block_table)
    decodes.runner.kv.kv[:, :, poisoned] = float("nan")  # sequence 0's logits will be NaN
    got = [list(d.token_ids) for d in _propose(impl, decodes, limits, 2)]
    expected = [[], _greedy_exit(histories[1], 3, 2)]
    assert got == expected, (
        f"2 greedy decodes, limits {limits}, the first one's K/V all NaN (its early-exit logits "
        f"are NaN, so choose_drafts gives None): expected drafts {expected} (the first stops, "
        f"the second goes on), got {got}"
    )


CHECKS = [
    check_the_residual_keeps_only_what_the_target_wants_more_of,
    check_the_residual_of_a_one_hot_draft_is_the_target_without_it,
    check_the_residual_of_equal_distributions_is_the_target,
    check_drafts_equal_to_the_target_are_all_kept_plus_a_bonus,
    check_a_draft_the_target_never_picks_is_replaced_from_the_residual,
    check_a_rejection_stops_the_walk,
    check_the_first_token_is_distributed_as_the_target,
    check_a_one_hot_draft_also_leaves_the_target_unchanged,
    check_each_position_is_verified_against_its_own_row,
    check_the_latest_earlier_match_wins,
    check_lookup_prefers_the_longest_matching_context,
    check_random_histories_match_minserves_lookup,
    check_the_best_draft_length_follows_the_acceptance_rate,
    check_the_acceptance_estimate_counts_tested_drafts,
    check_draft_lengths_per_sequence_match_minserves,
    check_early_exit_drafts_what_the_first_layers_predict,
    check_each_decode_in_a_batch_drafts_up_to_its_own_limit,
    check_drafting_writes_only_the_reserved_slots_of_the_first_layers,
    check_sampling_drafts_come_with_the_early_exits_processed_q,
    check_a_row_that_cannot_be_sampled_stops_only_its_sequence,
]

HINTS: dict[str, tuple[str, str, str]] = {
    "6.1": (
        "After a rejection, the output must make up for what the draft under-proposed: the "
        "tokens where the target p has more mass than the draft q.",
        "Take the positive part of p - q and divide by its sum. When p == q the sum is 0: "
        "there is nothing to make up, so return p itself rather than dividing 0 by 0.",
        "`excess = (p - q).clamp(min=0)`, `total = excess.sum(-1, keepdim=True)`, then "
        "`torch.where(total > 0, excess / total.clamp(min=tiny), p)`.",
    ),
    "6.2": (
        "Keep draft d with probability min(1, p(d) / q(d)); at the first rejection, draw "
        "the replacement from the residual and stop; if every draft is kept, the target's "
        "last row gives one bonus token.",
        "Loop over positions i: draw u uniform with the generator, keep d while "
        "u * q_i(d) < p_i(d), else append a draw from residual_distribution(p_i, q_i) and "
        "return. After the loop, append a draw from target_probs[k].",
        "u is a 0-d torch.rand drawn with the generator; keep d when u times "
        "draft_probs[i, d] is below target_probs[i, d]; otherwise torch.multinomial on the "
        "residual (one sample, the same generator) gives the replacement.",
    ),
    "6.3": (
        "Prompt lookup guesses that what followed an earlier occurrence of the context "
        "follows it again. Search for the last n tokens earlier in the history, newest first.",
        "Walk candidate end positions from the second-to-last token down to n - 1; the first "
        "window of n tokens equal to the pattern wins. Its start is end - n + 1. The pattern "
        "itself (ending at the last token) is not a match: nothing follows it.",
        "`pattern = token_ids[-n:]`; `for end in range(len(token_ids) - 2, n - 2, -1):` and "
        "compare `token_ids[end - n + 1 : end + 1]` with the pattern (checking the last "
        "token first is a cheap filter).",
    ),
    "6.4": (
        "A longer matching context predicts better, so try the longest n first and fall "
        "back to shorter ones; propose at most k of the tokens that followed the match.",
        "For n from min(max_n, len - 1) down to min_n: find the latest earlier match; on "
        "the first hit, return the slice after it, at most k long. No hit at any n: [].",
        "Ask latest_earlier_match for the start of the match at this n; when there is one, "
        "the draft is the slice of token_ids that begins n tokens after it, cut to k.",
    ),
}

HINTS["6.5"] = (
    "Speculation pays only while drafts are accepted: g drafts cost g c + 1 target forwards "
    "and yield 1 + a + ... + a^g tokens. Each sequence keeps discounted counts of its drafts "
    "tested and accepted, so its rate a follows what its text does now, and gets the g "
    "with the best expected speedup at that rate, preferring a shorter g when it is nearly "
    "as good.",
    "best_draft_length: the speedups for g = 1..k, their maximum, then the first g that "
    "reaches (1 - TOLERANCE) of it. AcceptanceEstimate.observe: work out how many drafts "
    "were tested, then decay both counts and add this step's. DraftLengths.length: k in "
    "fixed mode; else the sequence's estimate (made on first use) gives the rate for "
    "best_draft_length. DraftLengths.observe: only in adaptive mode, and only when the "
    "sequence drafted.",
    "expected_speedup(a, g, c) gives S(g); enumerate the list from 1 to pair each S with "
    "its g. A rejection tests one more draft than were accepted, which happened exactly "
    "when fewer were accepted than drafted (a bool adds as 0 or 1). dict.setdefault with "
    "a fresh AcceptanceEstimate() makes the estimate on first use.",
)
HINTS["6.6"] = (
    "The draft is the target cut short: its first L layers, then the final norm and LM head. "
    "Those layers' K/V of every earlier token are already in the target's pool (same weights, "
    "same tokens), so a draft round is a decode of one token per sequence through L layers, "
    "each round reading the K/V the round before wrote.",
    "_draft_logits: sequence i's newest token is its last draft (its chunk's own token at "
    "first) at position start + len(drafts[i]); one query token each, a context up to and "
    "including that position, its slot through the block table, one logits row per "
    "sequence; then runner.forward with num_layers (propose, given, calls it once a round).",
    "positions = [c.start + len(d) ...]; tokens = the last draft, else c.token_ids[-1]; "
    "AttentionMetadata.build with query_lens of 1, context_lens = position + 1, the chunks' "
    "block tables and slot_of(c.block_table, block size, position) for the slots; "
    "ModelInputs with those ids and positions and sample_indices = torch.arange(B); "
    "self.runner.forward(inputs, num_layers=self.num_layers).",
)
PROGRESS = {"6.5": "best_draft_length must visit each g from 1 to k once"}
