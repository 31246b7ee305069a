"""Two engines compared along one greedy path, teacher-forced, within bfloat16's rounding.

Two bfloat16 paths (panel kernel against torch, C attention against torch's) sum the same
products in another order, so their logits differ by rounding; where two candidates are
nearly tied, greedy decoding may pick either, and after that the texts go their own ways
(bfloat16 near-ties legitimately differ between kernels: DESIGN.md section 2). Comparing
tokens therefore fails on some CPUs and not others. Instead, engine `a` decodes a greedy
path; both engines then score that same path (its tokens fed as a prompt, with
`prompt_logprobs`), and at every step each token's log-probability must agree within
`BF16_LOGPROB_TOLERANCE`, as must `a`'s decode steps themselves. `a`'s pick must be the
reference's best token or within the tolerance of it (a near tie).

The tolerance: each path rounds every layer's output to bfloat16 (8 significant bits, a
relative step of 2**-8) at its own points, so after 30 layers the final hidden states
differ by a step or two per element, and a logit, a sum of 576 such products, moves by a
few bfloat16 steps at its own size: for SmolLM2's top logits, between 16 and 32, a step is
1/8. A log-probability (the logit less the log-sum-exp) is allowed five steps: 0.625.
Measured on SmolLM2 over 4 prompts x 24 tokens on an AVX-512 Xeon: the C kernels against
torch differ by at most 0.22, bfloat16 against float32 by at most 0.14; on a Xeon without
a native bfloat16 product (the linears' products widened to fp32), C attention against
torch's by up to 0.504 over 2 prompts x 16 tokens (0.395 with oneDNN's emulated bfloat16
products), one logit four steps apart; a kernel that swaps the input pairs of one layer's
down_proj moves them by 1 to 4.7, of every layer's by more than 20.
"""

from __future__ import annotations

from minserve import LLM, SamplingParams

BF16_LOGPROB_TOLERANCE = 0.625  # five bfloat16 steps of a logit between 16 and 32 (1/8 each)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a"]
TOP = 5  # alternatives scored at each step besides the path's own token

Logprobs = dict[int, float]  # token id -> log-probability


def greedy_paths(
    llm: LLM, prompts: list[str], max_tokens: int
) -> list[tuple[list[int], list[Logprobs]]]:
    """Each prompt's token ids followed by its greedy continuation, and the decode's
    log-probabilities at each generated token (its top `TOP` and the token itself)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.prompt_token_ids + o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def forced_logprobs(llm: LLM, paths: list[list[int]]) -> list[list[Logprobs]]:
    """Each path scored as a prompt: entry p holds the log-probabilities position p - 1
    gives token p (its top `TOP` and token p itself); entry 0 is empty."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP)
    outputs = llm.generate([{"prompt_token_ids": p} for p in paths], params, use_tqdm=False)
    return [
        [
            {} if entry is None else {t: lp.logprob for t, lp in entry.items()}
            for entry in o.prompt_logprobs
        ]
        for o in outputs
    ]


def assert_step_agrees(got: Logprobs, want: Logprobs, picked: int, where: str) -> None:
    """The tokens both score agree within the tolerance, and `picked` is `want`'s best
    token or within the tolerance of it."""
    shared = got.keys() & want.keys()
    assert picked in shared, where
    for token in shared:
        assert abs(got[token] - want[token]) <= BF16_LOGPROB_TOLERANCE, (where, token)
    assert max(want.values()) - want[picked] <= BF16_LOGPROB_TOLERANCE, (where, "not a near tie")


def assert_paths_agree(
    a: LLM, reference: LLM, max_tokens: int, prompts: list[str] = PROMPTS
) -> None:
    """`a`'s greedy paths, decoded by `a` and scored by both engines, agree step by step."""
    paths = greedy_paths(a, prompts, max_tokens)
    ids = [p for p, _ in paths]
    scored, want = forced_logprobs(a, ids), forced_logprobs(reference, ids)
    for (path, decoded), a_scored, ref in zip(paths, scored, want, strict=True):
        start = len(path) - max_tokens  # the first generated position
        assert len(decoded) == max_tokens
        for step, position in enumerate(range(start, len(path))):
            token = path[position]
            assert_step_agrees(decoded[step], ref[position], token, f"decode step {step}")
            assert_step_agrees(
                a_scored[position], ref[position], token, f"prefill position {position}"
            )
