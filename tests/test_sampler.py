"""The sampler: filters, greedy, seeded sampling, penalties, min_tokens, logprobs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import minserve.model.sampler as sampler_module
from minserve.course.checks_ch00 import FILTER_CHECKS
from minserve.kernels import cpu_ops
from minserve.model.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    draw_from_logits,
    suppress_stop_tokens,
)
from minserve.sampling_params import SamplingParams


def _row(
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    eos: tuple[int, ...] = (),
    **params: object,
) -> SamplingRow:
    """A row whose generator is seeded from `seed` when given, as the engine does."""
    sampling = SamplingParams(**params)
    generator = None if sampling.seed is None else torch.Generator().manual_seed(sampling.seed)
    return SamplingRow(sampling, list(prompt), list(output), generator, eos)


def _flat_logits(rows: int, vocab: int = 1000, seed: int = 0) -> torch.Tensor:
    """Nearly flat logits, so every draw is a real choice among many tokens."""
    return 0.1 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def _frequencies(token_ids: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab).float() / len(token_ids)


@pytest.mark.parametrize("check", FILTER_CHECKS, ids=lambda check: check.__name__)
def test_filter_check(check) -> None:
    check(sampler_module)


def test_greedy_rows_take_the_argmax_whatever_the_filters() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    rows = [_row(temperature=0), _row(temperature=0, top_k=3, top_p=0.1, seed=5)] * 2
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_temperature_below_1e5_is_greedy() -> None:
    logits = _flat_logits(8)
    rows = [_row(temperature=1e-6, seed=i) for i in range(8)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def _step(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """One decode step: each row's token, appended to its output (a seeded draw is keyed by
    the row's position, which moves on with it)."""
    tokens = Sampler()(logits, rows).token_ids
    for row, token in zip(rows, tokens, strict=True):
        row.output_token_ids.append(token)  # type: ignore[attr-defined]
    return tokens


def _draw(seed: int, steps: int = 10) -> list[int]:
    """`steps` tokens of one seeded row sampled alone."""
    row = _row(seed=seed)
    return [_step(_flat_logits(1, seed=step), [row])[0] for step in range(steps)]


def test_seeded_sampling_is_reproducible() -> None:
    first, second = _draw(seed=123), _draw(seed=123)
    assert first == second
    assert len(set(first)) > 5  # a real draw, not a constant


def test_different_seeds_give_different_tokens() -> None:
    assert _draw(seed=1) != _draw(seed=2)


def test_seeded_row_ignores_batch_mates_and_row_order() -> None:
    alone = _draw(seed=7)
    for order in ([0, 1, 2, 3], [3, 2, 1, 0]):
        mates = [_row(seed=7), _row(), _row(temperature=0), _row(seed=8, top_k=5)]
        batch = [mates[i] for i in order]
        position = order.index(0)
        tokens = []
        for step in range(len(alone)):
            logits = _flat_logits(len(batch), seed=100 + step)
            logits[position] = _flat_logits(1, seed=step)[0]
            tokens.append(_step(logits, batch)[position])
        assert tokens == alone, f"row order {order}"


@pytest.mark.parametrize("seeded", [True, False], ids=["per-row-generators", "global-rng"])
def test_sampling_frequencies_match_softmax_over_temperature(seeded: bool) -> None:
    draws, temperature = 20_000, 0.7
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    torch.manual_seed(0)
    rows = [_row(temperature=temperature, seed=i if seeded else None) for i in range(draws)]
    tokens = Sampler()(logits.expand(draws, -1).clone(), rows).token_ids
    expected = (logits / temperature).softmax(dim=-1)
    total_variation = 0.5 * (_frequencies(tokens, 5) - expected).abs().sum().item()
    assert total_variation < 0.02, f"frequencies {_frequencies(tokens, 5)}, expected {expected}"


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        ({"top_k": 2}, [0, 1]),
        ({"top_p": 0.7}, [0, 1]),  # probs 0.52, 0.19, 0.12, ...: 0.52 + 0.19 reaches 0.7
        ({"min_p": 0.3}, [0, 1]),  # 0.19 / 0.52 > 0.3 > 0.12 / 0.52
    ],
)
def test_filtered_sampling_follows_the_renormalised_distribution(params, kept) -> None:
    draws = 20_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    rows = [_row(seed=i, **params) for i in range(draws)]
    frequencies = _frequencies(Sampler()(logits.expand(draws, -1).clone(), rows).token_ids, 5)
    expected = torch.zeros(5)
    expected[kept] = logits[kept].softmax(dim=-1)
    total_variation = 0.5 * (frequencies - expected).abs().sum().item()
    assert total_variation < 0.02, f"frequencies {frequencies}, expected {expected}"


def _reference_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The penalties written out token by token (HF repetition, OpenAI frequency/presence)."""
    out = logits.clone()
    params, output = row.params, list(row.output_token_ids)
    for token in set(row.prompt_token_ids) | set(output):
        r = params.repetition_penalty
        out[token] = out[token] / r if out[token] > 0 else out[token] * r
    for token in set(output):
        count = output.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


def test_penalties_match_the_reference_formula() -> None:
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(3))
    rows = [
        _row(prompt=(1, 2, 2), output=(2, 5, 5, 5), repetition_penalty=1.3),
        _row(prompt=(0, 3), output=(3, 3, 7), frequency_penalty=0.5, presence_penalty=-0.4),
        _row(prompt=(4,), output=(4, 9, 9), repetition_penalty=0.8, frequency_penalty=-1.0),
        _row(prompt=(1,), output=(1, 1)),  # no penalties: untouched
    ]
    expected = torch.stack([_reference_penalties(logits[i], row) for i, row in enumerate(rows)])
    torch.testing.assert_close(apply_penalties(logits, rows), expected)


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]])
    row = _row(output=(1,), temperature=0, repetition_penalty=2.0)
    assert Sampler()(logits, [row]).token_ids == [2]  # 3.0 / 2 falls below 2.5


def test_min_tokens_suppresses_eos_and_stop_token_ids() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])  # eos 0, then stop token 1, then token 2
    row = _row(output=(3, 3), eos=(0,), temperature=0, min_tokens=3, stop_token_ids=[1])
    assert suppress_stop_tokens(logits, [row])[0].tolist() == [float("-inf")] * 2 + [3.0, 0.0]
    assert Sampler()(logits, [row]).token_ids == [2]


def test_min_tokens_releases_eos_once_reached() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    row = _row(output=(3, 3, 3), eos=(0,), temperature=0, min_tokens=3, stop_token_ids=[1])
    assert Sampler()(logits, [row]).token_ids == [0]


def test_logprobs_hold_top_n_and_sampled_token_from_raw_logits() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0, 2.0]])
    # Presence penalty pushes tokens 0 and 1 under token 4, which greedy then picks; the
    # logprobs still describe the raw model output.
    row = _row(output=(0, 1), temperature=0, presence_penalty=2.0, logprobs=2)
    result = Sampler()(logits, [row])
    raw = logits[0].log_softmax(dim=-1)
    assert result.token_ids == [4]
    assert result.logprobs == [{token: pytest.approx(raw[token].item()) for token in (4, 0, 1)}]


def test_logprobs_zero_gives_the_sampled_token_and_none_gives_none() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5]] * 2)
    result = Sampler()(logits, [_row(temperature=0, logprobs=0), _row(temperature=0)])
    assert result.logprobs == [{1: pytest.approx(logits[0].log_softmax(dim=-1)[1].item())}, None]


def test_sampler_leaves_logits_unchanged() -> None:
    logits = _flat_logits(2)
    before = logits.clone()
    rows = [_row(output=(1, 1), repetition_penalty=1.5, min_tokens=3, eos=(0,), top_k=3)] * 2
    Sampler()(logits, rows)
    assert torch.equal(logits, before)


def test_logits_must_have_one_row_per_sampling_row() -> None:
    with pytest.raises(ValueError, match=r"num_rows=2, vocab\], got shape \(3, 10\)"):
        Sampler()(torch.zeros(3, 10), [_row(), _row()])


def test_from_module_samples_with_the_modules_filters() -> None:
    def keep_only_token_3(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(logits, float("-inf"))
        out[:, 3] = logits[:, 3]
        return out

    def unused(logits: torch.Tensor, setting: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("not asked for by any row")

    module = SimpleNamespace(
        __name__="student",
        apply_top_k=keep_only_token_3,
        apply_top_p=unused,
        apply_min_p=unused,
        apply_penalties=apply_penalties,
    )
    sampler = Sampler.from_module(module)  # type: ignore[arg-type]
    assert sampler(_flat_logits(2), [_row(top_k=2, seed=0), _row(top_k=5)]).token_ids == [3, 3]


def test_from_module_names_missing_filters() -> None:
    module = SimpleNamespace(__name__="student", apply_top_k=None)
    missing = "apply_top_p, apply_min_p, apply_penalties"
    with pytest.raises(AttributeError, match=f"student does not define {missing}"):
        Sampler.from_module(module)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("params", "name"),
    [
        ({"top_p": 0}, "top_p"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_parameter(params, name) -> None:
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        SamplingParams(**params)


def test_inverse_cdf_draw_never_lands_on_a_filtered_token_at_the_edges() -> None:
    inf = float("-inf")
    logits = torch.tensor([[inf, 0.0, 1.0, inf], [inf, 0.0, 1.0, inf], [3.0, inf, inf, inf]])
    almost_one = 1 - 2**-24  # the largest float32 below 1
    uniforms = torch.tensor([0.0, almost_one, almost_one])
    assert draw_from_logits(logits, uniforms).tolist() == [1, 2, 0]


def test_inverse_cdf_draw_splits_the_unit_interval_by_probability() -> None:
    logits = torch.tensor([0.0, 0.0, 0.0, 0.0]).log_softmax(-1).expand(4, -1)  # 1/4 each
    uniforms = torch.tensor([0.1, 0.3, 0.6, 0.9])
    assert draw_from_logits(logits, uniforms).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("vocab", [49152, 1000, 17, 3])  # whole chunks of 16, and tails
def test_the_c_draw_picks_the_torch_draws_token(vocab: int) -> None:
    """Temperature-only rows on a CPU are drawn in C (`draw_rows.c`); each draw must be the
    torch path's (shift, divide, softmax, cumsum, searchsorted) for the same uniform."""
    gen = torch.Generator().manual_seed(vocab)
    num_rows = 64
    logits = 4 * torch.randn(num_rows, vocab, generator=gen)  # [rows, vocab]
    logits[::5, : vocab // 2] = float("-inf")  # forbidden tokens in some rows
    temperatures = [0.3, 0.6, 1.0, 1.7] * (num_rows // 4)
    rows = [_row(temperature=t) for t in temperatures]
    uniforms = torch.rand(num_rows, generator=gen)
    uniforms[:3] = torch.tensor([0.0, 1e-9, 1 - 2**-24])  # the interval's edges
    want = draw_from_logits(Sampler().filtered(logits, rows), uniforms)
    got = cpu_ops.draw_rows(logits, list(range(num_rows)), torch.tensor(temperatures), uniforms)
    # u just below 1 lands among the last tokens of nonzero probability, which one resting
    # on how each side rounds its running sum (its mass ~1e-7): the rest are the same token
    assert got[:2].tolist() == want[:2].tolist() and got[3:].tolist() == want[3:].tolist()
    assert logits.gather(1, got[:, None]).isfinite().all()  # never a forbidden token


def test_temperature_rows_go_to_the_c_draw_and_filtered_rows_do_not(monkeypatch) -> None:
    called: list[list[int]] = []
    real = cpu_ops.draw_rows
    monkeypatch.setattr(cpu_ops, "draw_rows", lambda x, r, *a: called.append(r) or real(x, r, *a))
    plain = [_row(temperature=0.7, seed=i) for i in range(3)]
    Sampler()(_flat_logits(3), plain)
    Sampler()(_flat_logits(3), [*plain[:2], _row(temperature=0.7, top_p=0.9, seed=2)])
    assert called == [[0, 1, 2]]  # the batch with a top-p row took the torch path
