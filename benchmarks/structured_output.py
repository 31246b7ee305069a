"""Structured output: every output follows its constraint, what masking costs, and speculation.

    .venv/bin/python -m benchmarks.structured_output --max-load 1.5   # the record, ~30 min
    .venv/bin/python -m benchmarks.structured_output --quick --output /tmp/structured  # smoke

Requests (`structured_cases.py`, seeded): `--num-schemas` generated JSON schemas (nested
objects, arrays with minItems/maxItems, enums, bounded integers and numbers, required
fields, strings with a pattern or a maxLength), and about 50 regex (dates, phones, emails,
IPv4...) and 50 choice requests. Four parts, on the bundled SmolLM2-135M-Instruct:

1. correctness through `minserve serve` (its own process, a free port), 16 requests in
   flight: JSON by chat with `response_format` json_schema, regex and choice by completions
   with `structured_outputs`; greedy, then seeded at temperature 0.8. An output counts only
   if it finished with "stop" and its judge (`jsonschema`, `re.fullmatch`, membership) takes
   it; "length" is a failure.
2. overhead, offline in this process, batch 16 (`max_num_seqs`): the JSON requests
   constrained (greedy, grammars compiled beforehand) against the same prompts free, each
   free request given exactly the constrained one's output length (`max_tokens` = that,
   EOS ignored), so both runs decode the same tokens in the same batches; the runs alternate
   (A B B A). Output tokens/s, step milliseconds per output token (the `step()` calls
   alone), and the engine's step phases (`get_metrics()`), the mask phases among them where
   the engine reports them. Target: at most 10% slower. Also each grammar's compile time.
3. speculation exactness: every request greedy with n-gram speculation (k = 4) against the
   non-speculative constrained outputs: equal token for token.
4. jump-forward: a schema with long fixed keys, one line of JSON (`disable_any_whitespace`),
   each request alone: output tokens per engine step with and without the "jump_forward"
   speculative method (k = 8), and whether the outputs are equal.

Parts 3 and 4 report "not supported" while the engine refuses them. Writes
benchmarks/structured_output.json and .md (`--output`).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

from tqdm import tqdm

from benchmarks.run_env import measure_recorded, record_parser, write_results
from benchmarks.structured_cases import KINDS, Case, all_cases, long_keys_cases
from benchmarks.structured_report import markdown
from benchmarks.structured_serve import BATCH, serve_correctness
from minserve import LLM, SamplingParams
from minserve.outputs import OutputAccumulator, RequestOutput

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
JUMP_FORWARD = {"method": "jump_forward", "num_speculative_tokens": 8}
BLOCK_SIZE = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-schemas", type=int, default=200)
    p.add_argument("--num-regex", type=int, default=50)
    p.add_argument("--num-choice", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--overhead-requests", type=int, default=48,
                   help="JSON requests timed (at most the grammar cache's size)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=2, help="overhead run pairs (A B, B A, ...)")
    p.add_argument("--jump-forward-requests", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="a few cases of each part: a smoke run")


def main(argv: list[str] | None = None) -> int:
    args = record_parser(__spec__.name, __doc__, add_arguments).parse_args(argv)
    if args.quick:
        args.num_schemas, args.num_regex, args.num_choice = 6, 3, 3
        args.overhead_requests, args.repeats, args.jump_forward_requests = 6, 1, 1
    record, results = measure_recorded(__spec__.name, argv, args, measure, args.threads)
    settings = {k: v for k, v in vars(args).items() if k != "output"} | {"batch": BATCH}
    report = {"command": record.command, "date": record.date, "machine": record.machine,
              "settings": settings, **results}  # fmt: skip
    write_results(report, args.output, markdown(report, record))
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cases = all_cases(args.num_schemas, args.num_regex, args.num_choice, args.seed)
    return {
        "correctness": serve_correctness(cases, args),
        **offline(cases, args),
    }


# ---------------------------------------------------------------- offline: one process


def offline(cases: list[Case], args: argparse.Namespace) -> dict[str, Any]:
    """Compile times, overhead, speculation exactness and jump-forward, on one loaded model."""
    llm = LLM(max_num_seqs=BATCH, num_blocks=kv_blocks(llm_prompt_budget(cases), args))
    prompts = [prompt_text(llm, c) for c in cases]
    compile_ms = compile_times(llm, cases)
    greedy = [constrained(c, args.max_tokens) for c in cases]
    reference, _ = run_batch(llm, prompts, greedy, "constrained, greedy")
    offline_valid = sum(judged(c, out) == "ok" for c, out in zip(cases, reference))
    speculative = speculative_exactness(llm, prompts, greedy, reference)
    speculative["unequal_cases"] = [cases[i].name for i in speculative.get("unequal_indices", [])]
    return {
        "compile_ms": compile_ms,
        "offline_greedy_valid": {"valid": offline_valid, "requests": len(cases)},
        "overhead": overhead(llm, cases, prompts, args),
        "speculative": speculative,
        "jump_forward": jump_forward(llm, args),
    }


def llm_prompt_budget(cases: list[Case]) -> int:
    """An upper bound on a prompt's tokens: its characters (SmolLM2 spends fewer) + a template."""
    return max(len(str(c.messages())) for c in cases) + 64


def kv_blocks(prompt_tokens: int, args: argparse.Namespace) -> int:
    """Room for a full batch of the longest prompt and output, drafts included."""
    per_sequence = -(-(prompt_tokens + args.max_tokens + 16) // BLOCK_SIZE)
    return BATCH * per_sequence + 16


def prompt_text(llm: LLM, case: Case) -> str:
    """What the server would run: the chat template around a JSON case, a regex or choice
    case's prompt as it is."""
    if case.kind != "json":
        return case.prompt()
    return llm.get_tokenizer().apply_chat_template(case.messages(), add_generation_prompt=True)


def constrained(case: Case, max_tokens: int, **options: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens,
                          structured_outputs=case.params(**options))  # fmt: skip


def judged(case: Case, out: RequestOutput) -> str:
    completion = out.outputs[0]
    if completion.finish_reason == "length":
        return "length"
    return case.judge(completion.text) or "ok"


def compile_times(llm: LLM, cases: list[Case]) -> dict[str, dict[str, float]]:
    """Per kind: median, p90 and max ms to compile a grammar (each distinct one, first time)."""
    seen, times = set(), {kind: [] for kind in KINDS}
    for case in tqdm(cases, desc="compile"):
        key = (case.kind, repr(case.constraint))
        if key in seen:
            continue
        seen.add(key)
        start_s = time.perf_counter()
        llm.engine.check_params(constrained(case, 1))
        times[case.kind].append(1e3 * (time.perf_counter() - start_s))
    return {kind: summary_ms(ms) for kind, ms in times.items() if ms}


def summary_ms(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {"grammars": len(ms), "median": round(statistics.median(ms), 1),
            "p90": round(p90, 1), "max": round(ordered[-1], 1)}  # fmt: skip


_ids = itertools.count()


def run_batch(
    llm: LLM, prompts: list[str], params: list[SamplingParams], desc: str
) -> tuple[list[RequestOutput], dict[str, float]]:
    """Run the requests to the end through `llm.engine`, up to 16 at a time; their whole
    outputs and the run's costs: wall seconds, seconds inside `step()`, steps, output
    tokens and the engine's step phases (seconds, from `get_metrics()`)."""
    engine = llm.engine
    before = engine.get_metrics()
    ids = [f"so-{next(_ids)}" for _ in prompts]
    tokenizer = llm.get_tokenizer()
    start_s = time.perf_counter()
    try:
        for request_id, prompt, sp in zip(ids, prompts, params):
            engine.add_request(request_id, prompt, tokenizer.encode(prompt), sp)
        whole, in_step, steps = OutputAccumulator(), 0.0, 0
        with tqdm(total=len(ids), desc=desc, leave=False) as bar:
            while engine.has_unfinished_requests():
                step_start = time.perf_counter()
                deltas = engine.step()
                in_step, steps = in_step + time.perf_counter() - step_start, steps + 1
                bar.update(sum(whole.add(d).finished for d in deltas))
    finally:
        for request_id in ids:
            engine.abort_request(request_id)  # nothing of a failed run stays queued
    wall = time.perf_counter() - start_s
    after = engine.get_metrics()
    phases = {k.removeprefix("step_seconds_"): after[k] - before.get(k, 0.0)
              for k in after if k.startswith("step_seconds_")}  # fmt: skip
    tokens = after["generation_tokens"] - before["generation_tokens"]
    costs = {"wall_s": wall, "step_s": in_step, "steps": steps, "tokens": tokens,
             "phases": phases}  # fmt: skip
    return [whole.outputs[i] for i in ids], costs


# ---------------------------------------------------------------- 2. overhead


def overhead(llm: LLM, cases: list[Case], prompts: list[str], args) -> dict[str, Any]:
    """Constrained vs free on the JSON requests, same output lengths, A B B A."""
    cache_size = getattr(llm.engine.grammars(), "cache_size", 64)
    chosen = [i for i, c in enumerate(cases) if c.kind == "json"][: min(args.overhead_requests,
                                                                       cache_size)]  # fmt: skip
    texts = [prompts[i] for i in chosen]
    masked = [constrained(cases[i], args.max_tokens) for i in chosen]
    outputs, _ = run_batch(llm, texts, masked, "overhead: lengths")  # compiles, warms up
    lengths = [len(out.outputs[0].token_ids) for out in outputs]
    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    runs: dict[str, list[dict]] = {"constrained": [], "free": []}
    for repeat in range(args.repeats):
        order = ("constrained", "free") if repeat % 2 == 0 else ("free", "constrained")
        for name in order:
            params = masked if name == "constrained" else free
            runs[name].append(run_batch(llm, texts, params, f"overhead: {name}")[1])
    sides = {name: side_summary(r) for name, r in runs.items()}
    c, f = sides["constrained"], sides["free"]
    return {
        "requests": len(chosen), "output_tokens": sum(lengths), "runs": runs, **sides,
        "throughput_overhead": f["tokens_per_s"] / c["tokens_per_s"] - 1,
        "step_time_overhead": c["step_ms_per_token"] / f["step_ms_per_token"] - 1,
    }  # fmt: skip


def side_summary(runs: list[dict]) -> dict[str, Any]:
    """Medians over one side's runs: tokens/s, step ms per output token, phases per step."""
    tokens = runs[0]["tokens"]
    phases = {name: statistics.median(r["phases"][name] / r["steps"] * 1e3 for r in runs)
              for name in runs[0]["phases"]}  # fmt: skip
    return {
        "tokens_per_s": statistics.median(r["tokens"] / r["wall_s"] for r in runs),
        "step_ms_per_token": statistics.median(1e3 * r["step_s"] / tokens for r in runs),
        "steps": statistics.median(r["steps"] for r in runs),
        "phase_ms_per_step": phases,
    }


# ---------------------------------------------------------------- 3. and 4. speculation


def speculative_llm(llm: LLM, config: dict) -> LLM:
    """An engine with `config`'s speculation on `llm`'s weights."""
    num_blocks = llm.engine.kv.allocator.num_blocks
    return LLM(llm.loaded, max_num_seqs=BATCH, num_blocks=num_blocks, speculative_config=config)


def refusal(error: Exception) -> dict[str, Any]:
    """How a part the engine cannot run yet is reported: refused (a ValueError when the
    config or request is added), or failed while running."""
    refused = isinstance(error, ValueError | NotImplementedError)
    word = "not supported" if refused else f"failed ({type(error).__name__})"
    return {"supported": False, "error": f"{word}: {' '.join(str(error).split())}"}


def spec_metrics(spec: LLM) -> dict[str, float]:
    return {k: v for k, v in spec.get_metrics().items() if k.startswith("spec_")}


def speculative_exactness(llm: LLM, prompts: list[str], params: list[SamplingParams],
                          reference: list[RequestOutput]) -> dict[str, Any]:  # fmt: skip
    """Greedy constrained outputs with n-gram speculation equal the plain ones?"""
    try:
        spec = speculative_llm(llm, NGRAM)
        outputs, _ = run_batch(spec, prompts, params, "ngram speculation")
    except Exception as error:  # the record keeps the other parts' results
        return {"config": NGRAM, **refusal(error)}
    unequal = [i for i, (a, b) in enumerate(zip(outputs, reference))
               if a.outputs[0].token_ids != b.outputs[0].token_ids]  # fmt: skip
    return {"config": NGRAM, "supported": True, "equal": len(outputs) - len(unequal),
            "total": len(outputs), "unequal_indices": unequal,
            "spec": spec_metrics(spec)}  # fmt: skip


def jump_forward(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    """Long fixed keys, one line: tokens per engine step, each request alone, with and
    without jump-forward drafts."""
    cases = long_keys_cases(args.jump_forward_requests)
    prompts = [prompt_text(llm, c) for c in cases]
    params = [constrained(c, args.max_tokens, disable_any_whitespace=True) for c in cases]
    alone = list(zip(prompts, params))
    plain = [run_batch(llm, [p], [sp], "jump-forward: off") for p, sp in alone]
    valid = sum(judged(c, outs[0]) == "ok" for c, (outs, _) in zip(cases, plain))
    report: dict[str, Any] = {"config": JUMP_FORWARD, "requests": len(cases), "valid_off": valid,
                              "off": per_step(plain)}  # fmt: skip
    try:
        spec = speculative_llm(llm, JUMP_FORWARD)
        jumped = [run_batch(spec, [p], [sp], "jump-forward: on") for p, sp in alone]
    except Exception as error:
        return report | refusal(error)
    equal = sum(a[0][0].outputs[0].token_ids == b[0][0].outputs[0].token_ids
                for a, b in zip(plain, jumped))  # fmt: skip
    return report | {"supported": True, "on": per_step(jumped), "equal": equal,
                     "spec": spec_metrics(spec)}  # fmt: skip


def per_step(runs: list[tuple[list[RequestOutput], dict]]) -> dict[str, float]:
    """Output tokens per engine step (the prefill's step included) and tokens/s."""
    tokens = sum(costs["tokens"] for _, costs in runs)
    return {"tokens": tokens, "steps": sum(costs["steps"] for _, costs in runs),
            "tokens_per_step": tokens / sum(costs["steps"] for _, costs in runs),
            "tokens_per_s": tokens / sum(costs["wall_s"] for _, costs in runs)}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
