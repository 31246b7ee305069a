"""Part 1 of the structured-output benchmark: every case through `minserve serve`.

The server runs in its own process on a free port with the bundled SmolLM2; 16 requests
are in flight at once (`--max-num-seqs 16`, overload targets off so that none is refused).
JSON cases go by chat with `response_format` json_schema, regex and choice cases by
completions with vLLM's `structured_outputs`; each at every sampling setting.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
from collections import Counter
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.run_env import REPO_ROOT
from benchmarks.serve import free_port, start, stop
from benchmarks.structured_cases import KINDS, Case

MODEL = "smollm2"
BATCH = 16
SAMPLINGS = {"greedy": {"temperature": 0.0}, "t=0.8": {"temperature": 0.8}}  # seed: the case's


def serve_correctness(cases: list[Case], args: argparse.Namespace) -> dict[str, Any]:
    """Every case at every sampling setting through `minserve serve`, 16 in flight."""
    port = free_port()
    command = [sys.executable, "-m", "minserve.cli", "serve", "--port", str(port),
               "--served-model-name", MODEL, "--max-num-seqs", str(BATCH),
               "--target-tpot-ms", "0", "--target-ttft-ms", "0"]  # fmt: skip
    logs = REPO_ROOT / ".cache"
    logs.mkdir(exist_ok=True)
    process = start(command, {}, port, logs / "serve-structured.log")
    try:
        rows = asyncio.run(send_all(f"http://127.0.0.1:{port}", cases, args))
    finally:
        stop(process)
    return {"summary": tally(rows), "failures": [r for r in rows if r["verdict"] != "ok"]}


async def send_all(url: str, cases: list[Case], args: argparse.Namespace) -> list[dict]:
    slots = asyncio.Semaphore(BATCH)
    jobs = [(case, name, i) for name in SAMPLINGS for i, case in enumerate(cases)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(case: Case, sampling: str, seed: int) -> dict:
            async with slots:
                return await send(client, case, sampling, seed, args.max_tokens)

        tasks = [asyncio.ensure_future(one(*job)) for job in jobs]
        for task in tqdm(asyncio.as_completed(tasks), total=len(tasks), desc="server"):
            await task
    return [task.result() for task in tasks]


async def send(client: httpx.AsyncClient, case: Case, sampling: str, seed: int,
               max_tokens: int) -> dict:  # fmt: skip
    """One request; its verdict: ok, length, http N, or the judge's objection."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "seed": seed,
                            **SAMPLINGS[sampling]}  # fmt: skip
    if case.kind == "json":
        schema = {"name": "answer", "schema": case.constraint}
        body |= {"messages": case.messages(),
                 "response_format": {"type": "json_schema", "json_schema": schema}}  # fmt: skip
        path = "/v1/chat/completions"
    else:
        body |= {"prompt": case.prompt(), "structured_outputs": {case.kind: case.constraint}}
        path = "/v1/completions"
    response = await client.post(path, json=body)
    row = {"case": case.name, "kind": case.kind, "sampling": sampling}
    if response.status_code != 200:
        return row | {"verdict": f"http {response.status_code}", "text": response.text[:300]}
    choice = response.json()["choices"][0]
    text = choice["message"]["content"] if case.kind == "json" else choice["text"]
    if choice["finish_reason"] == "length":
        return row | {"verdict": "length", "text": text}
    return row | {"verdict": case.judge(text) or "ok", "text": text}


def tally(rows: list[dict]) -> list[dict]:
    """Per kind and sampling: requests, valid, cut at max_tokens, invalid, refused."""
    summary = []
    for kind, sampling in itertools.product(KINDS, SAMPLINGS):
        mine = [r for r in rows if r["kind"] == kind and r["sampling"] == sampling]
        if not mine:
            continue
        verdicts = Counter(r["verdict"] for r in mine)
        http = sum(n for v, n in verdicts.items() if v.startswith("http"))
        summary.append({"kind": kind, "sampling": sampling, "requests": len(mine),
                        "valid": verdicts["ok"], "length": verdicts["length"],
                        "invalid": len(mine) - verdicts["ok"] - verdicts["length"] - http,
                        "http_error": http})  # fmt: skip
    return summary
