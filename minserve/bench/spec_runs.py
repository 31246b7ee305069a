"""Running the speculative benchmark's cells: draft models, timed proposers, interleaved units.

A cell's plain and speculative runs use fresh engines over the same loaded target weights.
Requests run in units (one at a time for batch 1, eight together for batch 8); every engine
runs each unit in turn and the order rotates unit by unit, so machine noise spreads evenly.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minserve.bench.checkpoint import hf_model_folder
from minserve.bench.sched_overhead import is_all_decoding, timed_step
from minserve.bench.speculative import Cell, ProposerSpec, RunTotals, make_cell
from minserve.outputs import OutputAccumulator
from minserve.sampling_params import SamplingParams


def truncated_copy(source: Path, num_layers: int, folder: Path) -> Path:
    """A Hugging Face folder holding the first `num_layers` layers of `source` (a folder)
    with its embeddings, final norm and LM head: a draft model that loads from its own path."""
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= num_layers < total:
        raise ValueError(f"a truncated draft needs 1 <= layers < {total}, got {num_layers}")
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Any] = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors |= load_file(shard)
    kept = {name: t for name, t in tensors.items() if _layer_index(name) < num_layers}
    save_file(kept, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}))
    for f in source.iterdir():  # tokenizer files, generation config
        if f.is_file() and f.name != "config.json" and ".safetensors" not in f.name:
            shutil.copy(f, folder / f.name)
    return folder


def _layer_index(name: str) -> int:
    """`model.layers.7.mlp.up_proj.weight` -> 7; embeddings, norm and head -> -1."""
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else -1


def load_drafts(specs: list[ProposerSpec], target: Any, workdir: Path) -> dict[ProposerSpec, Any]:
    """The draft model each draft_model spec needs: the target itself when it names no layer
    count, else a truncated copy written under `workdir` and loaded from there."""
    from minserve.loader import load_model

    drafts: dict[ProposerSpec, Any] = {}
    for spec in specs:
        if spec.method != "draft_model":
            continue
        if spec.layers is None:
            drafts[spec] = target
            continue
        source = hf_model_folder(workdir / "target-hf", str(target.path))
        folder = truncated_copy(source, spec.layers, workdir / f"draft-{spec.layers}-layers")
        drafts[spec] = load_model(folder, "float32")
    return drafts


class TimedProposer:
    """Wraps an engine's proposer and adds up the seconds its `propose` calls take."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    def propose(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.inner.propose(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:  # release_finished and the like
        return getattr(self.inner, name)


def run_unit(
    engine: Any, prompts: list[list[int]], params: SamplingParams, totals: RunTotals, tag: str
) -> None:
    """Run `prompts` together to completion on `engine`, timing every step."""
    request_ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, ids in zip(request_ids, prompts):
        engine.add_request(request_id, None, ids, params)
    whole = OutputAccumulator()
    while engine.has_unfinished_requests():
        seconds, record = timed_step(engine)
        totals.seconds += seconds
        if is_all_decoding(record.scheduler_output, len(prompts)):
            totals.decode_seconds += seconds
            totals.decode_steps += 1
        for delta in record.outputs:
            whole.add(delta)
    totals.outputs += [list(whole.outputs[r].outputs[0].token_ids) for r in request_ids]


def measure_group(
    make_engine: Callable[[dict[str, Any] | None], Any],
    workload: str,
    prompts: list[list[int]],
    batch: int,
    specs: list[ProposerSpec],
    drafts: dict[ProposerSpec, Any],
    params: SamplingParams,
    on_run: Callable[[], None] = lambda: None,
) -> list[Cell]:
    """Plain decoding and every proposer over `prompts` in units of `batch`, interleaved."""
    plain = make_engine(None)
    engines = [plain]
    for spec in specs:
        engine = make_engine(spec.config(drafts.get(spec)))
        speculator = engine.worker.speculator
        speculator.proposer = TimedProposer(speculator.proposer)
        engines.append(engine)
    totals = [RunTotals() for _ in engines]
    units = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    for u, unit in enumerate(units):
        for j in range(len(engines)):
            e = (u + j) % len(engines)  # rotate who goes first
            run_unit(engines[e], unit, params, totals[e], tag=f"{workload}-{batch}-{u}")
            on_run()
    return [
        make_cell(workload, batch, spec.name, totals[0], run, engine)
        for spec, run, engine in zip(specs, totals[1:], engines[1:])
    ]
