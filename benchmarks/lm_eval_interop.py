"""A second client we did not write: lm-eval's `local-completions` against minserve and vLLM.

    bash benchmarks/install_lm_eval.sh          # lm-eval 0.4.13 in .venv-lmeval (CPU torch)
    .venv/bin/python -m benchmarks.lm_eval_interop

lm-eval (EleutherAI's evaluation harness) runs a generate_until task from a local file
(`benchmarks/lm_eval/capitals.yaml`: 30 capitals, greedy, exact match; nothing downloads)
three ways: through `minserve serve` and through vLLM's server with its `local-completions`
OpenAI client, and on Hugging Face transformers directly (`--model hf`), the oracle. The
same model folder (SmolLM2-135M-Instruct, fp32) everywhere. Compared: the score, and every
sample's generated answer against transformers'. Writes lm_eval_interop.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.run_env import command_line
from benchmarks.serve import HERE, NAME, start_peer, stop
from minserve.bench.checkpoint import hf_model_folder

LM_EVAL = HERE.parent / ".venv-lmeval" / "bin" / "lm_eval"
TASKS = HERE / "lm_eval"
TASK = "minserve_capitals"


def model_args(peer: str, folder: Path, base_url: str | None) -> tuple[str, str]:
    """lm-eval's --model and --model_args for one way of running the task."""
    if peer == "transformers":
        return "hf", f"pretrained={folder},dtype=float32"  # on the CPU: --device cpu
    return "local-completions", (
        f"model={NAME},base_url={base_url}/v1/completions,tokenizer={folder},"
        "num_concurrent=4,max_retries=1,tokenized_requests=False"
    )


def run_lm_eval(peer: str, folder: Path, base_url: str | None) -> dict:
    """Run the task once; the score and each sample's (question, answer, filtered response)."""
    model, options = model_args(peer, folder, base_url)
    with tempfile.TemporaryDirectory() as out:
        command = [str(LM_EVAL), "--model", model, "--model_args", options, "--tasks", TASK,
                   "--include_path", str(TASKS), "--output_path", out, "--log_samples",
                   "--batch_size", "1", "--device", "cpu"]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        done = subprocess.run(command, cwd=TASKS, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"lm_eval ({peer}) failed:\n{done.stderr[-3000:]}")
        results = json.loads(next(Path(out).rglob("results_*.json")).read_text())
        lines = next(Path(out).rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()
    samples = sorted((json.loads(line) for line in lines), key=lambda s: s["doc_id"])
    score = results["results"][TASK]
    return {
        "peer": peer,
        "command": shlex.join(command),
        "exact_match": next(v for k, v in score.items() if k.startswith("exact_match,")),
        "samples": [(s["doc"]["question"], s["target"], s["filtered_resps"][0]) for s in samples],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", default="minserve,vllm")
    args = p.parse_args()
    if not LM_EVAL.exists():
        sys.exit("needs lm-eval in .venv-lmeval: bash benchmarks/install_lm_eval.sh")
    folder = hf_model_folder().resolve()  # lm-eval runs in benchmarks/lm_eval
    runs = [run_lm_eval("transformers", folder, None)]
    serve_args = argparse.Namespace(input_len=64, output_len=16)  # max_model_len for the server
    for peer in args.peers.split(","):
        process, endpoint = start_peer(peer, folder, serve_args)
        try:
            runs.append(run_lm_eval(peer, folder, endpoint.base_url))
        finally:
            stop(process)
    write(runs)


def write(runs: list[dict]) -> None:
    oracle = runs[0]["samples"]
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    command = command_line(__spec__.name)
    for run in runs:
        run["same_answers_as_transformers"] = sum(
            mine[2] == theirs[2] for mine, theirs in zip(run["samples"], oracle)
        )
    record = {"command": command, "date": stamp, "task": TASK, "runs": runs}
    (HERE / "lm_eval_interop.json").write_text(json.dumps(record, indent=2, ensure_ascii=False))
    lines = [
        "# A second client we did not write: lm-eval's `local-completions`",
        "",
        f"- command: `{command}`",
        f"- date: {stamp}",
        "- lm-eval 0.4.13 (`.venv-lmeval`, `bash benchmarks/install_lm_eval.sh`); task "
        f"`{TASK}` (`benchmarks/lm_eval/capitals.yaml`): {len(oracle)} questions, greedy, "
        "stop at a newline or a period, exact match ignoring case and punctuation",
        "- model: SmolLM2-135M-Instruct as a Hugging Face folder, fp32, for every row; servers "
        "driven by lm-eval's OpenAI completions client (`--model local-completions`, 4 "
        "concurrent requests), transformers by `--model hf`",
        "",
        "| run | exact match | answers equal to transformers' |",
        "|---|---:|---:|",
        *[
            f"| {r['peer']} | {r['exact_match']:.3f} | {r['same_answers_as_transformers']} / "
            f"{len(oracle)} |"
            for r in runs
        ],  # fmt: skip
        "",
        "Every answer (transformers'; a server's only where it differs):",
        "",
        "| question | target | transformers | " + " | ".join(r["peer"] for r in runs[1:]) + " |",
        "|" + "---|" * (3 + len(runs) - 1),
    ]
    for i, (question, target, answer) in enumerate(oracle):
        others = [r["samples"][i][2] for r in runs[1:]]
        cells = ["=" if other == answer else repr(other) for other in others]
        lines.append(f"| {question} | {target} | {answer!r} | " + " | ".join(cells) + " |")
    (HERE / "lm_eval_interop.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[9 : 11 + len(runs)]))


if __name__ == "__main__":
    main()
