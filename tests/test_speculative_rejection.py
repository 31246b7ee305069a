"""Sampled drafts verified by rejection sampling inside the engine; adaptive draft length;
the draft cost ratio.

Oracle for the distribution tests: transformers' logits on the target's weights, processed
as the sampler processes them (temperature, top-k, top-p), give the exact conditional
p(. | prompt + prefix) for every prefix of a 16-token vocabulary. A different random model
drafts (q != p, so drafts are both accepted and rejected), and many seeded speculative
samples must match p: the marginal of each position, and each token given its prefix,
split by whether the draft before it was accepted or rejected.

Chi-square bound: Pearson's statistic over the 16 tokens (bins expected fewer than 5 times
pooled) below its p = 0.001 quantile. Seeds are fixed, so the outcome is deterministic; the
bound is loose enough that a correct sampler passes with any seeds 999 times in 1000 and
tight enough that a verifier which forgets q (accepts d with probability p(d)) fails by far
(`test_a_wrong_student_verifier_fails_the_distribution_test`). Budget: about 40 s on one
thread.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest
import torch
from test_engine import assert_all_blocks_free, token_ids
from test_speculative import DRAFT, EARLY_EXIT, NGRAM, repetitive_workload
from tiny_models import COMMON

from minserve import LLM, SamplingParams
from minserve.model.sampler import Sampler, SamplingRow, apply_top_k, apply_top_p
from minserve.model.sampler import draw_from_logits as draw
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.counters import SpecCounters
from minserve.speculative.distributions import processed_logits
from minserve.speculative.draft import Draft
from minserve.speculative.draft_length import best_draft_length, expected_speedup
from minserve.speculative.verify import rejection_sample, residual_distribution
from minserve.step_timings import StepTimings

VOCAB, PROMPT, LENGTH, K = 16, [3, 7, 1, 12, 3, 7], 4, 2
NUM_SAMPLES = 1200
NOISE = 0.04  # the draft: the target's weights plus this much noise (acceptance 0.45 to 0.65)
PARAMS = {
    "temperature_1": SamplingParams(temperature=1.0),
    "top_p": SamplingParams(temperature=1.0, top_p=0.75),
    "top_k": SamplingParams(temperature=0.8, top_k=5),
}


def tiny_vocab_model(folder, tokenizer_dir, noise: float = 0.0):
    """A 2-layer random Llama over VOCAB tokens (SmolLM2's tokenizer beside it, unused);
    noise > 0 perturbs every weight: a draft that agrees with the target only in part."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "vocab_size": VOCAB}))
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(noise * torch.randn_like(weight))
    model.save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


@pytest.fixture(scope="module")
def pair(smollm_tokenizer_dir, tmp_path_factory):
    """(target, draft) folders: a tiny-vocabulary model and a perturbed copy of it."""
    return tuple(
        tiny_vocab_model(tmp_path_factory.mktemp("vocab16"), smollm_tokenizer_dir, noise)
        for noise in (0.0, NOISE)
    )


@pytest.fixture(scope="module")
def target_llm(pair):
    return LLM(pair[0])


@pytest.fixture(scope="module")
def llama(tiny_model):
    return LLM(tiny_model("llama"), engine="reference").loaded


def conditionals(folder, params: SamplingParams) -> dict[tuple[int, ...], torch.Tensor]:
    """p(. | PROMPT + prefix) [VOCAB] for every prefix shorter than LENGTH, from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    table = {}
    for n in range(LENGTH):
        prefixes = list(itertools.product(range(VOCAB), repeat=n))
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(x) for x in prefixes])).logits[:, -1]
        rows = len(prefixes)
        logits = apply_top_k(logits / params.temperature, torch.full((rows,), params.top_k))
        logits = apply_top_p(logits, torch.full((rows,), params.top_p))
        table |= dict(zip(prefixes, logits.softmax(-1)))
    return table


def marginal(table, position: int) -> torch.Tensor:
    """P(token at `position` (0-based)) [VOCAB], summing over every prefix."""
    total = torch.zeros(VOCAB)
    for prefix in itertools.product(range(VOCAB), repeat=position):
        weight = math.prod(float(table[prefix[:i]][t]) for i, t in enumerate(prefix))
        total += weight * table[prefix]
    return total


def pearson(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom; bins expected < 5 times are pooled."""
    big = expected >= 5
    o = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    e = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = e > 1e-9
    return float(((o[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1


def critical(dof: int, z: float = 3.09) -> float:
    """The p = 0.001 quantile of chi-square (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


class Recording:
    """A verifier plugged in through speculative_config that records what it returned,
    keyed by the request's own generator (one per seeded request)."""

    def __init__(self, verifier) -> None:
        self.verifier, self.calls = verifier, {}

    def __call__(self, target_probs, draft_probs, draft_tokens, generator):
        tokens = self.verifier(target_probs, draft_probs, draft_tokens, generator)
        self.calls.setdefault(id(generator), []).append((list(draft_tokens), list(tokens)))
        return tokens


def speculative_samples(pair, params: SamplingParams, verifier, count: int = NUM_SAMPLES):
    """Each seeded request's tokens, and its verifications [(drafts, kept tokens)]."""
    recording = Recording(verifier)
    config = {**DRAFT, "num_speculative_tokens": K, "model": pair[1]}
    llm = LLM(pair[0], speculative_config={**config, "rejection_sampler": recording})
    engine, samples = llm.engine, []
    for seed in range(count):
        sp = replace(params, seed=seed, max_tokens=LENGTH, ignore_eos=True)
        engine.add_request(str(seed), None, PROMPT, sp)
        samples += [seq.sample for seq in engine.scheduler.sequences_of(str(seed))]
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)
    return [s.token_ids for s in samples], [recording.calls.get(id(s.generator)) for s in samples]


def accepted_before(verifications) -> dict[int, bool]:
    """Position (0-based) -> was the draft just before it accepted? For positions that
    follow a verified draft: one accepted in the same verification, or the rejected one."""
    where, position = {}, 1  # the prefill samples position 0 without drafts
    for drafts, kept in verifications or []:
        for j in range(1, len(kept)):
            where[position + j] = True  # follows accepted draft j - 1
        if len(kept) <= len(drafts):  # draft len(kept) - 1 was rejected
            where[position + len(kept)] = False
        position += len(kept)
    return where


@pytest.mark.parametrize("name", PARAMS)
def test_sampled_drafts_keep_the_target_distribution(pair, name) -> None:
    table = conditionals(pair[0], PARAMS[name])
    outputs, verifications = speculative_samples(pair, PARAMS[name], rejection_sample)
    assert all(len(tokens) == LENGTH for tokens in outputs)
    for position in range(1, LENGTH):  # speculative positions; 0 is the prefill's own
        counts = torch.bincount(torch.tensor([t[position] for t in outputs]), minlength=VOCAB)
        statistic, dof = pearson(counts.float(), NUM_SAMPLES * marginal(table, position))
        assert statistic < critical(dof), (name, position, statistic, dof)
    # each token given its prefix, split by the fate of the draft before it
    for accepted in (True, False):
        observed, expected, seen = torch.zeros(VOCAB), torch.zeros(VOCAB), 0
        for tokens, verified in zip(outputs, verifications):
            for position, was in accepted_before(verified).items():
                if was is accepted and position < LENGTH:
                    observed[tokens[position]] += 1
                    expected += table[tuple(tokens[:position])]
                    seen += 1
        assert seen > NUM_SAMPLES / 4  # both branches happen often
        statistic, dof = pearson(observed, expected)
        assert statistic < critical(dof), (name, accepted, statistic, dof)


def test_a_wrong_student_verifier_fails_the_distribution_test(pair, monkeypatch) -> None:
    """The plug-in is really called, and a classic mistake is caught: accepting a draft with
    probability p(d), as if q were one-hot, instead of min(1, p(d) / q(d))."""
    import exercises.ch06_rejection_sampling as student

    def forgets_q(target_probs, draft_probs, draft_tokens, generator):
        tokens = []
        for j, draft in enumerate(draft_tokens):
            if torch.rand((), generator=generator) < target_probs[j, draft]:
                tokens.append(draft)
                continue
            residual = residual_distribution(target_probs[j], draft_probs[j])
            return [*tokens, int(torch.multinomial(residual, 1, generator=generator))]
        bonus = torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator)
        return [*tokens, int(bonus)]

    monkeypatch.setattr(student, "rejection_sample", forgets_q)
    params, count = PARAMS["temperature_1"], 400
    outputs, verifications = speculative_samples(pair, params, student.rejection_sample, count)
    assert all(verifications)  # every request's drafts went through the student's function
    table = conditionals(pair[0], params)
    counts = torch.bincount(torch.tensor([t[1] for t in outputs]), minlength=VOCAB)
    statistic, dof = pearson(counts.float(), count * marginal(table, 1))
    assert statistic > 2 * critical(dof), statistic  # measured: about 3 times


def test_the_verifier_must_return_accepted_drafts_plus_one(pair) -> None:
    config = {**DRAFT, "num_speculative_tokens": K, "model": pair[1]}
    config["rejection_sampler"] = lambda p, q, drafts, generator: [(drafts[0] + 1) % VOCAB, 0]
    llm = LLM(pair[0], speculative_config=config)
    with pytest.raises(ValueError, match="the rejection sampler returned"):
        llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=4), use_tqdm=False)


def test_processed_logits_are_what_the_sampler_draws_from() -> None:
    """Same uniforms, same tokens: the target's p is exactly the sampler's distribution."""
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    options = [
        dict(temperature=0.7, top_k=4),
        dict(temperature=1.0, top_p=0.6, repetition_penalty=1.5),
        dict(temperature=1.3, min_p=0.1, frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=1.0, min_tokens=5, stop_token_ids=[2]),
        dict(temperature=0.5, top_k=6, top_p=0.9),
    ]

    def rows() -> list[SamplingRow]:
        return [
            SamplingRow(
                SamplingParams(**o),
                [1, 2, 3],
                [3, 3, 4],
                torch.Generator().manual_seed(i),
                eos_token_ids=(5,),
            )
            for i, o in enumerate(options)
        ]

    sampler = Sampler()
    for _ in range(20):
        expected = sampler(logits, rows()).token_ids
        fresh = rows()  # the same seeds again
        uniforms = torch.stack([torch.rand(1, generator=r.generator)[0] for r in fresh])
        assert draw(processed_logits(sampler, logits, fresh), uniforms).tolist() == expected
        logits = logits.roll(1, dims=-1)


@pytest.mark.parametrize("method", [NGRAM, EARLY_EXIT, DRAFT], ids=["ngram", "early_exit", "draft"])
def test_greedy_identity_with_adaptive_draft_length(llama, tiny_model, method) -> None:
    prompts, params = repetitive_workload(12, seed=2)
    expected = token_ids(LLM(llama).generate(prompts, params, use_tqdm=False))
    if method is DRAFT:
        method = {**DRAFT, "model": tiny_model("qwen2")}  # a draft that often disagrees
    llm = LLM(
        llama,
        block_size=2,
        num_blocks=60,
        speculative_config={**method, "draft_length": "adaptive"},
    )
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0
    assert_all_blocks_free(llm.engine)
    assert not llm.engine.scheduler.drafts.lengths.estimates  # forgotten when they finished


class Oracle:
    """Proposes the target's known greedy continuation (always right) or that plus one
    (never right), recording each draft length it was allowed."""

    def __init__(self, continuation: list[int], right: bool) -> None:
        self.continuation, self.shift, self.limits = continuation, 0 if right else 1, []

    def propose(self, chunks, limits) -> list[Draft]:
        (chunk,), (limit,) = chunks, limits
        row = chunk.samples[0]
        room = row.params.max_tokens - len(row.output_token_ids) - 1
        if room > limit:  # not capped by max_tokens: the policy's own choice
            self.limits.append(limit)
        done = len(row.output_token_ids)
        guess = self.continuation[done : done + limit]
        return [Draft([(t + self.shift) % VOCAB for t in guess])]


@pytest.mark.parametrize("right", [True, False], ids=["always_right", "never_right"])
def test_adaptive_length_follows_acceptance(target_llm, right) -> None:
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    continuation = target_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    k = 8
    llm = LLM(
        target_llm.loaded,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": k,
            "draft_length": "adaptive",
        },
    )
    oracle = llm.engine.worker.speculator.proposer = Oracle(continuation, right)
    assert token_ids(llm.generate([PROMPT], params, use_tqdm=False)) == [continuation]
    first, last = oracle.limits[0], oracle.limits[-3:]
    if right:
        assert 1 < first < k and last == [k] * 3, oracle.limits  # rises to k
    else:
        assert first > 1 and last == [1] * 3, oracle.limits  # falls to 1
    assert not llm.engine.scheduler.drafts.lengths.estimates


def test_best_draft_length_maximises_the_expected_speedup() -> None:
    assert best_draft_length(0.0, 0.05, 6) == 1  # never accepted: one draft
    assert best_draft_length(1.0, 0.05, 6) == 6  # always accepted: all of them
    assert best_draft_length(0.9, 2.0, 6) == 1  # drafts dearer than the target: one
    a, c = 0.8, 0.1
    speedups = {g: expected_speedup(a, g, c) for g in range(1, 9)}
    assert speedups[1] == pytest.approx((1 - a**2) / ((1 - a) * (c + 1)))
    best = best_draft_length(a, c, 8)
    assert speedups[best] >= 0.99 * max(speedups.values())
    assert all(speedups[g] < 0.99 * max(speedups.values()) for g in range(1, best))


def test_cost_ratio_is_seconds_per_draft_round_over_seconds_per_forward() -> None:
    counters = SpecCounters()
    counters.record_costs(num_rounds=2, propose_s=0.2, forward_s=1.0)
    counters.record_costs(num_rounds=0, propose_s=9.0, forward_s=9.0)  # nothing drafted
    counters.record_costs(num_rounds=4, propose_s=0.4, forward_s=3.0)
    # (0.6 s / 6 rounds) / (4.0 s / 2 steps) = 0.1 / 2.0
    assert counters.as_metrics()["spec_decode_draft_cost_ratio"] == pytest.approx(0.05)
    assert StepTimings(propose=1.0, forward=1.0).overhead == 0.0  # proposing is model work


def test_engine_reports_the_cost_ratio(target_llm, pair) -> None:
    """n-gram lookup costs about nothing next to a target forward; a draft model as large as
    the target costs about one forward per round (loose bounds: this is not a benchmark)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ratios = {}
    for name, config in (("ngram", NGRAM), ("draft", {**DRAFT, "model": pair[0]})):
        llm = LLM(target_llm.loaded, speculative_config=config)
        llm.generate([PROMPT * 3] * 4, params, use_tqdm=False)
        metrics = llm.get_metrics()
        assert metrics["step_seconds_propose"] > 0
        ratios[name] = metrics["spec_decode_draft_cost_ratio"]
    assert ratios["ngram"] < 0.2 < ratios["draft"], ratios


@pytest.mark.parametrize("method", [DRAFT, EARLY_EXIT], ids=["draft", "early_exit"])
def test_sampled_drafts_with_aborts_leave_every_block_free(pair, method) -> None:
    if method is DRAFT:
        method = {**DRAFT, "model": pair[1]}
    recording = Recording(rejection_sample)
    llm = LLM(
        pair[0],
        block_size=2,
        num_blocks=120,
        speculative_config={**method, "draft_length": "adaptive", "rejection_sampler": recording},
    )
    engine, rng = llm.engine, random.Random(0)
    for i in range(24):
        params = SamplingParams(
            temperature=rng.choice([0, 0.8, 1.0]),
            top_p=rng.choice([1, 0.8]),
            n=rng.choice([1, 1, 2]),
            max_tokens=rng.randint(1, 30),
            ignore_eos=True,
            seed=i,
        )
        engine.add_request(str(i), None, [rng.randrange(VOCAB) for _ in range(8)], params)
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step % 4 == 0:
            engine.abort_request(str(rng.randrange(24)))
    llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=6), use_tqdm=False)
    metrics = llm.get_metrics()
    assert metrics["num_requests_aborted"] > 0 and metrics["spec_decode_num_accepted_tokens"] > 0
    assert sum(map(len, recording.calls.values())) > 20  # sampled drafts were verified
    assert_all_blocks_free(engine)
    assert not engine.scheduler.drafts.lengths.estimates
    draft = engine.worker.speculator.proposer
    if hasattr(draft, "allocator"):  # freed when a step names the sequences finished
        assert engine.step() == []  # an idle step: the last ones' draft KV goes
        assert draft.allocator.num_free == draft.allocator.num_blocks and not draft.states


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({**NGRAM, "draft_length": "dynamic"}, "unknown draft_length"),
        ({**NGRAM, "rejection_sampler": "mine"}, "rejection_sampler must be a function"),
    ],
)
def test_bad_options_are_rejected(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(options)
