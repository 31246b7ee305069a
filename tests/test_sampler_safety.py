"""The sampler cannot produce NaN or an id outside the vocabulary, whatever it is given.

Settings whose effect float32 cannot hold are refused by `SamplingParams`; every accepted
setting, over any logits (float32's extremes included), gives an id in range or reports
the row as failed. Oracles: the exact distribution (one-hot where one logit dwarfs the
others), the raw logits' argmax for plain greedy rows, and which tokens a row may draw.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve.model.sampler import (
    FLOAT32_MAX,
    Sampler,
    SamplingRow,
    apply_penalties,
    row_uniforms,
)
from minserve.model.seeded_draws import draw_key
from minserve.request import seeded_generator
from minserve.sampling_params import GREEDY_TEMPERATURE, SamplingParams

INF = float("inf")


def _row(output: tuple[int, ...] = (), eos: tuple[int, ...] = (), **params: object) -> SamplingRow:
    sampling = SamplingParams(**params)
    generator = seeded_generator(sampling.seed)
    return SamplingRow(sampling, [], list(output), generator, eos)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"repetition_penalty": 1e-40}, r"repetition_penalty must be in \[0.01, 100\], got 1e-40"),
        ({"repetition_penalty": 1e-200}, r"repetition_penalty must be in \[0.01, 100\]"),
        ({"repetition_penalty": INF}, r"repetition_penalty must be in \[0.01, 100\], got inf"),
        ({"repetition_penalty": math.nan}, r"repetition_penalty must be in \[0.01, 100\]"),
        ({"repetition_penalty": 0}, r"repetition_penalty must be in \[0.01, 100\], got 0"),
        ({"temperature": INF}, r"temperature must be in \[0, 100\], got inf"),
        ({"temperature": math.nan}, r"temperature must be in \[0, 100\], got nan"),
        ({"temperature": 1000.0}, r"temperature must be in \[0, 100\], got 1000.0"),
        ({"top_p": math.nan}, r"top_p must be in \(0, 1\], got nan"),
        ({"min_p": INF}, r"min_p must be in \[0, 1\], got inf"),
        ({"presence_penalty": -INF}, r"presence_penalty must be in \[-2, 2\], got -inf"),
        ({"frequency_penalty": math.nan}, r"frequency_penalty must be in \[-2, 2\], got nan"),
    ],
)
def test_settings_float32_cannot_hold_are_refused_naming_the_range(params, message) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        SamplingParams(**params)


def test_the_ends_of_each_range_are_accepted() -> None:
    SamplingParams(temperature=100, repetition_penalty=0.01, presence_penalty=-2, min_p=1)
    SamplingParams(temperature=0, repetition_penalty=100, frequency_penalty=2, top_p=1)


def test_extreme_logits_at_a_low_temperature_draw_the_top_token() -> None:
    # Unshifted, 3e38 / 2e-5 would be +inf and the row NaN; the exact distribution is one-hot.
    logits = torch.tensor([[-3e38, 3e38, 0.0, -INF]] * 4)
    rows = [_row(temperature=2e-5, seed=i) for i in range(4)]
    result = Sampler()(logits, rows)
    assert result.token_ids == [1, 1, 1, 1]
    assert result.failed == {}


def test_a_small_repetition_penalty_raises_a_seen_logit_to_float32s_largest() -> None:
    logits = torch.tensor([[1e38, 0.0, -1.0]])
    row = _row(output=(0, 2), repetition_penalty=0.01, seed=3)
    penalized = apply_penalties(logits, [row])
    assert penalized[0].tolist() == [FLOAT32_MAX, 0.0, pytest.approx(-0.01)]  # not +inf
    assert Sampler()(logits, [row]).token_ids == [0]  # probability 1 - exp(-3.4e38)


def test_a_top_k_beyond_int64_keeps_every_token() -> None:
    logits = 0.1 * torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    huge = [_row(top_k=10**30, seed=i) for i in range(3)]
    off = [_row(top_k=0, seed=i) for i in range(3)]
    assert Sampler()(logits, huge).token_ids == Sampler()(logits, off).token_ids


def test_rows_with_no_token_to_draw_fail_and_the_others_draw_as_alone() -> None:
    good = 0.1 * torch.randn(6, generator=torch.Generator().manual_seed(1))
    with_nan, with_inf = good.clone(), good.clone()
    with_nan[3], with_inf[2] = math.nan, INF
    logits = torch.stack([with_nan, with_inf, torch.full((6,), -INF), good])  # [4, 6]
    rows = [_row(seed=1), _row(temperature=0), _row(seed=2), _row(seed=7)]
    result = Sampler()(logits, rows)
    assert result.failed == {
        0: "its logits hold NaN",
        1: "its logits hold +inf",
        2: "every token is forbidden (all logits are -inf)",
    }
    assert result.token_ids[3] == Sampler()(good[None], [_row(seed=7)]).token_ids[0]


def test_min_tokens_forbidding_every_token_left_fails_the_row() -> None:
    logits = torch.tensor([[2.0, -INF, -INF]])  # only EOS (id 0) is possible
    row = _row(eos=(0,), min_tokens=1, temperature=0)
    assert Sampler()(logits, [row]).failed == {0: "every token is forbidden (all logits are -inf)"}


@pytest.mark.parametrize("seed", [2**63 - 1, 2**64 - 1, -(2**63), -1, 10**30, -(10**30)])
def test_any_integer_seed_draws_the_numbers_of_its_value_modulo_2_64(seed: int) -> None:
    def draws(s: int) -> list[float]:
        """The sampler's uniform at five positions of sample 1 of a request seeded `s`."""
        row = SamplingRow(SamplingParams(seed=s), [1], [], seeded_generator(s), sample_index=1)
        rows = [replace(row, output_token_ids=[2] * i) for i in range(5)]
        return row_uniforms(rows, torch.device("cpu")).tolist()

    assert draws(seed) == draws(seed + 2**64) == draws(seed % 2**64)
    assert draws(seed) != draws(seed + 1)
    keys = [draw_key(s, 1, 4, "sample") for s in (seed, seed + 1, seed + 2**64)]
    assert keys[0] == keys[2] != keys[1]


# --- property: random valid settings x random logits ---

EXTREMES = [FLOAT32_MAX, -FLOAT32_MAX, 1e38, -1e38, 1e30, -1e30, 1e-45, 0.0, -INF]
LOGIT = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False), st.sampled_from(EXTREMES)
)
SAFE = 1e30  # a token whose logit is within this stays finite under every accepted penalty


@st.composite
def sampling_rows(draw: st.DrawFn, vocab: int) -> SamplingRow:
    token = st.integers(0, vocab - 1)
    params = SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), st.floats(GREEDY_TEMPERATURE, 100))),
        top_p=draw(st.floats(0, 1, exclude_min=True)),
        top_k=draw(st.one_of(st.integers(-1, vocab + 2), st.just(10**30))),
        min_p=draw(st.floats(0, 1)),
        presence_penalty=draw(st.floats(-2, 2)),
        frequency_penalty=draw(st.floats(-2, 2)),
        repetition_penalty=draw(st.floats(0.01, 100)),
        seed=draw(st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1))),
        min_tokens=draw(st.integers(0, 3)),
        stop_token_ids=draw(st.lists(token, max_size=3)),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 5))),
    )
    prompt, output = draw(st.lists(token, max_size=6)), draw(st.lists(token, max_size=6))
    eos = tuple(draw(st.lists(token, max_size=2)))
    return SamplingRow(params, prompt, output, seeded_generator(params.seed), eos)


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[SamplingRow]]:
    vocab, num_rows = draw(st.integers(2, 40)), draw(st.integers(1, 5))
    rows = [draw(sampling_rows(vocab)) for _ in range(num_rows)]
    values = draw(st.lists(st.lists(LOGIT, min_size=vocab, max_size=vocab), min_size=num_rows,
                           max_size=num_rows))  # fmt: skip
    return torch.tensor(values, dtype=torch.float32), rows


def _forbidden(row: SamplingRow) -> set[int]:
    """Stop tokens min_tokens still forbids."""
    if len(row.output_token_ids) >= row.params.min_tokens:
        return set()
    return {*row.eos_token_ids, *(row.params.stop_token_ids or ())}


@settings(max_examples=300, deadline=None)
@given(batches())
def test_every_sampled_id_is_in_range_and_drawable(batch) -> None:
    logits, rows = batch
    vocab = logits.shape[-1]
    result = Sampler()(logits, rows)
    assert len(result.token_ids) == len(rows)
    for i, (row, token) in enumerate(zip(rows, result.token_ids, strict=True)):
        assert 0 <= token < vocab
        allowed = [t for t in range(vocab) if t not in _forbidden(row)]
        finite = [t for t in allowed if math.isfinite(logits[i, t])]
        if i in result.failed:
            assert not [t for t in finite if abs(logits[i, t]) <= SAFE], result.failed[i]
            continue
        assert finite, "a row with nothing to draw must be reported failed"
        assert token in finite  # never a forbidden token, never one of probability 0
        plain = row.params.greedy and not _forbidden(row)
        no_penalties = row.params.repetition_penalty == 1 and not (
            row.params.presence_penalty or row.params.frequency_penalty
        )
        if plain and no_penalties:
            assert token == int(logits[i].argmax())
        if result.logprobs[i] is not None:
            assert not any(math.isnan(v) for v in result.logprobs[i].values())
