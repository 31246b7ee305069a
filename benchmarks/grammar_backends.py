"""Which grammar library minserve's structured output uses: xgrammar against llguidance,
measured on the same JSON schemas, the same vocabulary and the same token walks.

For each of the structured-output benchmark's seeded JSON schemas (`structured_cases.py`),
both libraries compile the schema over SmolLM2's 49,152 tokens (compact JSON, `", "` and
`": "` between items, so both accept the same texts), then walk one seeded path of tokens:
at each step xgrammar's mask picks a random allowed token, both libraries fill that step's
bitmask (timed) and both accept the token. A walk stops at EOS, after `--steps` tokens, or
where llguidance refuses a token xgrammar allowed (counted: the libraries would disagree).
The numbers are what one sample costs per step on one core: the engine fills every
constrained row's mask each step (in a thread beside the forward).

llguidance is not one of minserve's dependencies: install it to run this
(`.venv/bin/python -m pip install llguidance==1.9.1`). Writes grammar_backends.json and .md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch
import xgrammar as xgr
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast

from benchmarks.run_env import RunRecord, measure_recorded, record_parser, write_results
from benchmarks.structured_cases import json_cases
from minserve import LLM
from minserve.structured.compiler import tokenizer_info

SEPARATORS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-schemas", type=int, default=50)
    p.add_argument("--steps", type=int, default=48, help="tokens walked per schema, at most")
    p.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    args = record_parser(__spec__.name, __doc__, add_arguments).parse_args(argv)
    record, results = measure_recorded(__spec__.name, argv, args, measure, 1)
    settings = {k: v for k, v in vars(args).items() if k != "output"}
    report = {"command": record.command, "date": record.date, "machine": record.machine,
              "settings": settings, **results}  # fmt: skip
    write_results(report, args.output, markdown(report, record))
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    llm = LLM(num_blocks=16)
    tokenizer, vocab = llm.get_tokenizer(), llm.engine.vocab_size
    info = tokenizer_info(tokenizer, vocab, llm.loaded.eos_token_ids)
    x_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    ll_tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    compile_ms: dict[str, list[float]] = {"xgrammar": [], "llguidance": []}
    fill_us: dict[str, list[float]] = {"xgrammar": [], "llguidance": []}
    disagreements, steps = 0, 0
    rng = random.Random(args.seed)
    x_mask = xgr.allocate_token_bitmask(1, vocab)
    ll_mask = llguidance.torch.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    for case in tqdm(json_cases(args.num_schemas, args.seed), desc="schemas"):
        schema = json.dumps(case.constraint)
        start = time.perf_counter()
        x_matcher = xgr.GrammarMatcher(x_compiler.compile_json_schema(schema, any_whitespace=False))
        compile_ms["xgrammar"].append(1e3 * (time.perf_counter() - start))
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=SEPARATORS)
        ll_matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        compile_ms["llguidance"].append(1e3 * (time.perf_counter() - start))
        if ll_matcher.is_error():
            disagreements += 1
            continue
        for _ in range(args.steps):
            start = time.perf_counter()
            x_matcher.fill_next_token_bitmask(x_mask, 0)
            fill_us["xgrammar"].append(1e6 * (time.perf_counter() - start))
            start = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(ll_matcher, ll_mask, 0)
            fill_us["llguidance"].append(1e6 * (time.perf_counter() - start))
            allowed = allowed_tokens(x_mask[0], vocab)
            token = rng.choice(allowed)
            steps += 1
            if not x_matcher.accept_token(token) or not ll_matcher.consume_token(token):
                disagreements += 1
                break
            if x_matcher.is_terminated():
                break
    return {
        "schemas": args.num_schemas, "steps": steps, "disagreements": disagreements,
        "compile_ms": {k: summary(v) for k, v in compile_ms.items()},
        "fill_us": {k: summary(v) for k, v in fill_us.items()},
    }  # fmt: skip


def allowed_tokens(words: torch.Tensor, vocab: int) -> list[int]:
    """The token ids whose bit is set in one bitmask row (bit j of word w: token 32 w + j)."""
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 1),
            "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 1),
            "max": round(ordered[-1], 1), "count": len(ordered)}  # fmt: skip


def markdown(report: dict[str, Any], record: RunRecord) -> str:
    lines = [
        *record.header_lines("Grammar libraries: xgrammar and llguidance, the same walks"),
        f"- {report['schemas']} seeded JSON schemas, {report['steps']} steps walked; "
        f"{report['disagreements']} walks where llguidance refused a token xgrammar allowed",
        "",
        "| library | compile ms (median / p90 / max) | mask fill µs a step (median / p90 / max) |",
        "|---|---:|---:|",
    ]
    for name in ("xgrammar", "llguidance"):
        c, f = report["compile_ms"][name], report["fill_us"][name]
        lines.append(f"| {name} | {c['median']} / {c['p90']} / {c['max']} | "
                     f"{f['median']} / {f['p90']} / {f['max']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
