"""The bfloat16 screen of the output head (`platforms/cpu/greedy_head.py`, `kernels/bf16_head.c`):
its logits against torch's, its candidates against a torch rewrite of the rule, and its
tokens against the fp32 argmax, near-ties and exact ties included; then the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minserve.kernels import cpu_ops
from minserve.llm import LLM
from minserve.model.sampler import SamplingRow, is_plain_greedy
from minserve.platforms.cpu.greedy_head import SCREEN_MAX_ROWS, GreedyScreen, screens
from minserve.sampling_params import SamplingParams

GEN = torch.Generator().manual_seed(0)


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=GEN) * scale


@pytest.mark.parametrize("hidden", [576, 37])  # 37: no whole 16-float vector at the end
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 7])  # groups of 4, a pair, a single row
def test_screen_logits_equal_torch_on_the_bf16_weights(batch: int, hidden: int) -> None:
    weight = randn(1000, hidden, scale=0.05).to(torch.bfloat16)
    x = randn(batch, hidden, scale=3.0)
    got = cpu_ops.bf16_logits(weight.view(torch.int16), x)
    want = F.linear(x.double(), weight.double())  # the same products, summed exactly
    assert got.shape == (batch, 1000)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_candidates_follow_the_rule_written_in_torch() -> None:
    logits = randn(3, 5000, scale=0.3)
    slack, x_norm = randn(5000).abs() * 1e-3, torch.tensor([10.0, 50.0, 200.0])
    best, count, is_candidate = cpu_ops.screen_candidates(logits, slack, x_norm)
    margin = slack * x_norm[:, None] + 2**-20 * (logits.abs() + 1)
    upper = logits + margin
    floor = (logits - margin).amax(dim=1, keepdim=True)
    assert is_candidate.equal(upper >= floor)
    assert count.tolist() == (upper >= floor).sum(dim=1).tolist()
    assert best.tolist() == upper.argmax(dim=1).tolist()
    assert count.tolist()[0] < count.tolist()[2]  # wider margins, more candidates


def test_tokens_are_the_fp32_argmax_for_random_rows() -> None:
    weight = randn(4096, 64, scale=0.2)
    screen = GreedyScreen(weight)
    for batch in range(1, 6):
        x = randn(batch, 64, scale=2.0)
        assert screen.tokens(x).tolist() == F.linear(x, weight).argmax(dim=1).tolist()


def test_near_ties_are_settled_in_fp32_and_exact_ties_go_to_the_lowest_id() -> None:
    weight = randn(2000, 64, scale=0.2)
    x = randn(2, 64, scale=2.0)
    top = int(F.linear(x[0], weight).argmax())
    # token 7 a hair above the winner (below bf16's resolution), token 1500 an exact copy
    nudge = x[0] / x[0].norm() ** 2 * 1e-4  # raises token 7's logit by 1e-4
    weight[7] = weight[top] + nudge
    weight[1500] = weight[top]
    screen = GreedyScreen(weight)
    assert screen.weight[7].to(torch.bfloat16).equal(screen.weight[top].to(torch.bfloat16))
    dense = F.linear(x, weight)
    assert dense[0, 7] > dense[0, top] == dense[0, 1500]
    assert screen.tokens(x).tolist() == dense.argmax(dim=1).tolist()  # 7 in row 0
    weight[7] = weight[top]  # now three exact copies: argmax takes the lowest id
    screen = GreedyScreen(weight)
    assert screen.tokens(x[:1]).item() == min(7, top) == F.linear(x[:1], weight).argmax().item()


def test_the_screen_applies_to_few_fp32_rows() -> None:
    assert screens(randn(1, 16)) and screens(randn(SCREEN_MAX_ROWS, 16))
    assert not screens(randn(SCREEN_MAX_ROWS + 1, 16)) and not screens(randn(0, 16))
    assert not screens(randn(1, 16).double())


def row(**params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [1, 2], [3], None, eos_token_ids=(0,))


def test_plain_greedy_rows_are_the_ones_the_sampler_answers_with_argmax() -> None:
    assert is_plain_greedy(row(temperature=0.0))
    assert is_plain_greedy(row(temperature=0.0, min_tokens=1))  # one output already
    assert not is_plain_greedy(row(temperature=0.7))
    assert not is_plain_greedy(row(temperature=0.0, logprobs=2))
    assert not is_plain_greedy(row(temperature=0.0, repetition_penalty=1.2))
    assert not is_plain_greedy(row(temperature=0.0, presence_penalty=0.5))
    assert not is_plain_greedy(row(temperature=0.0, min_tokens=5))  # EOS still forbidden


def test_the_engine_gives_the_same_tokens_with_and_without_the_screen(tiny_model) -> None:
    llm = LLM(tiny_model("llama"))
    runner = llm.engine.worker.runner
    assert isinstance(runner.screen, GreedyScreen)  # the CPU platform's runner has one
    calls = []
    tokens = runner.screen.tokens
    runner.screen.tokens = lambda hidden: calls.append(len(hidden)) or tokens(hidden)
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(SCREEN_MAX_ROWS)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    screened = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert calls and max(calls) <= SCREEN_MAX_ROWS
    runner.screen = None
    dense = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert screened == dense


def test_with_the_c_kernels_off_there_is_no_screen(tiny_model, monkeypatch) -> None:
    prompt = [{"prompt_token_ids": list(range(5, 40))}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    screened = LLM(tiny_model("llama"))
    monkeypatch.setenv("MINSERVE_C_KERNELS", "0")  # torch everywhere: the fp32 head's argmax
    dense = LLM(tiny_model("llama"))
    assert dense.engine.worker.runner.screen is None
    assert "greedy_screen=off" in dense.get_execution_config().summary()
    expected = dense.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert screened.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_rows_that_want_logprobs_still_get_them_from_full_logits(tiny_model) -> None:
    llm = LLM(tiny_model("llama"))
    prompt = {"prompt_token_ids": list(range(10, 30))}
    out = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, logprobs=2),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert len(out.logprobs) == 4
    for token, logprobs in zip(out.token_ids, out.logprobs):
        assert token in logprobs and logprobs[token] == max(logprobs.values())
