"""The state plane, measured: the disk tier's time to first token, the load-or-recompute
rule over throttled disks, the KV-event index against the engines, and spilling to disk
under memory pressure.

    disk tier    a returning session's history (512-2048 tokens), evicted from device and
                 host: time to its first token recomputed, read from disk by a restarted
                 engine on the same directory (the files' pages dropped from the OS cache
                 first), and from the device; greedy tokens compared
    rule         for each history length and disk bandwidth cap (`BandwidthCap` really
                 delays the reads): the time of loading everything and of recomputing
                 everything, each measured, and what `plan_load` chose with the cap's
                 speed: the share of cases where it chose the faster path
    events       a mixed workload on two engines publishing KV events (device, host, disk),
                 then one engine restarted on its directory: a subscriber's index (replays
                 on gaps) against each engine's own block sets, medium by medium
    spill        pools too small for their batches (requests outgrow them while they
                 decode), with prefix caching: output tokens/s recomputing what preemption
                 evicted vs reading it back from the disk tier, at three pressures
    recovery     a replica killed mid-stream, its streams continued on another that shares
                 its disk tier (`recovery.py`)
    migration    live migration at each context length on a 1P2D cluster (`migration.py`):
                 the longest gap the client sees, pre-copy vs stop-and-copy vs the median
                 step; the text against the same request on one engine; the pools after
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from minserve.bench.migration import measure_migration_gaps, synthetic_prompt
from minserve.disagg.proxy_engine import DisaggregatedEngine
from minserve.kvcache.kv_event_socket import KVEventSubscriber
from minserve.kvcache.load_plan import BandwidthCap, LoadPlan, plan_load
from minserve.llm import LLM
from minserve.messages import DiskWrite
from minserve.router.exact_index import ExactIndex
from minserve.sampling_params import SamplingParams

EVENTS = {"enable_kv_cache_events": True}
FIRST = SamplingParams(temperature=0, max_tokens=1)
CHECK = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
MIGRATION_TARGETS = {
    "identical": "the migrated request's tokens are the uninterrupted request's",
    "gap": "pre-copy's longest gap is at most 2x the median decode step, at every length",
    "flat": "pre-copy's longest gaps are within 1.5x of each other across the lengths",
    "pools_free": "every instance's pool is free afterwards",
}


@dataclass(frozen=True)
class Settings:
    lengths: tuple[int, ...] = (512, 1024, 2048)
    migration_lengths: tuple[int, ...] = (256, 1024, 2048)
    caps_mb_s: tuple[float, ...] = (math.inf, 200.0, 50.0, 20.0, 10.0, 5.0, 2.0)
    rule_lengths: tuple[int, ...] = (256, 1024, 2048)
    repeats: int = 3
    directory: str = "/var/tmp"  # on a real disk, not tmpfs: the disk tier's files


def history(n: int) -> list[int]:
    """`n` token ids of a returning session's history (any ids: the length does the work)."""
    return [1000 + (i * 7919) % 40000 for i in range(n)]


def _elapsed(llm: LLM, prompt: list[int], params: SamplingParams = FIRST) -> tuple[float, Any]:
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return time.perf_counter() - start, out


def _engine(base: LLM, directory: Path | None, **options: Any) -> LLM:
    disk = {"kv_disk_path": directory} if directory is not None else {}
    return LLM(base.loaded, **{"num_blocks": 160, **options}, enable_prefix_caching=True, **disk)


def _drop_pages(llm: LLM, directory: Path) -> None:
    store = llm.engine.worker.disk_store
    for path in directory.glob("*/*.kvb"):
        store.drop_page_cache(bytes.fromhex(path.stem))


def disk_tier(base: LLM, settings: Settings) -> list[dict[str, Any]]:
    """Per history length: recompute, device and disk (restarted, cold) first-token times."""
    rows = []
    for n in settings.lengths:
        prompt = history(n)
        times: dict[str, list[float]] = {"recompute": [], "device": [], "disk": []}
        same = True
        for _ in range(settings.repeats):
            directory = Path(tempfile.mkdtemp(prefix="minserve-disk-", dir=settings.directory))
            first = _engine(base, directory)
            times["recompute"].append(_elapsed(first, prompt)[0])
            times["device"].append(_elapsed(first, prompt)[0])
            want = _elapsed(first, prompt, CHECK)[1].outputs[0].token_ids
            first.engine.shutdown()
            restarted = _engine(base, directory)
            _drop_pages(restarted, directory)
            seconds, _ = _elapsed(restarted, prompt)
            times["disk"].append(seconds)
            loaded = restarted.get_metrics()["disk_tier_blocks_loaded"]
            again = _engine(base, directory)  # another restart, checking the tokens
            same &= _elapsed(again, prompt, CHECK)[1].outputs[0].token_ids == want
            restarted.engine.shutdown()
            again.engine.shutdown()
        median = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"history": n, **{f"{k}_s": v for k, v in median.items()},
                     "disk_over_recompute": median["disk"] / median["recompute"],
                     "blocks_loaded": loaded, "same_tokens": same})  # fmt: skip
    return rows


def _all_or_nothing(load: bool):
    def plan(num_blocks, holders, *_: Any) -> LoadPlan:
        return LoadPlan(len(holders) if load else 0, 0.0)

    return plan


def rule(base: LLM, settings: Settings) -> list[dict[str, Any]]:
    """Per history length and disk cap: measured load and recompute times, and the rule's
    choice under the cap's speed."""
    rows = []
    for n in settings.rule_lengths:
        prompt = history(n)
        directory = Path(tempfile.mkdtemp(prefix="minserve-rule-", dir=settings.directory))
        writer = _engine(base, directory)
        _elapsed(writer, prompt)
        writer.engine.shutdown()
        for cap_mb in settings.caps_mb_s:
            measured = {}
            for way in ("load", "recompute"):
                llm = _engine(base, directory)
                tier = llm.engine.kv.prefix.disk
                if math.isfinite(cap_mb):
                    tier.store = BandwidthCap(tier.store, cap_mb * 1e6)
                tier.plan = _all_or_nothing(way == "load")
                _drop_pages(llm, directory)
                measured[way] = _elapsed(llm, prompt)[0]
                if way == "recompute":  # what the rule chooses at the cap's speed, pricing
                    # recompute at the prefill speed this engine just measured
                    tier.speed, tier.plan = tier.speed.throttled(cap_mb * 1e6), plan_load
                    keys = _keys(llm, prompt)
                    chose = tier.num_to_load(keys, len(keys)) > 0
                llm.engine.shutdown()
            faster = "load" if measured["load"] <= measured["recompute"] else "recompute"
            chosen = "load" if chose else "recompute"
            rows.append({"history": n, "cap_mb_s": cap_mb, "load_s": measured["load"],
                         "recompute_s": measured["recompute"], "chose": chosen,
                         "faster": faster, "right": chosen == faster})  # fmt: skip
    return rows


def _keys(llm: LLM, prompt: list[int]) -> list[bytes]:
    """The keys of the blocks a prompt may reuse (all but its last token, whole blocks)."""
    events = llm.engine.kv.prefix.events
    usable = (len(prompt) - 1) // events.block_size * events.block_size
    return events.chain(events.root, prompt[:usable])


def events(base: LLM, settings: Settings) -> dict[str, Any]:
    """Two engines with all three tiers publish; a mixed workload; one restarts. The index
    kept from their events against their own block sets."""
    dirs = [Path(tempfile.mkdtemp(prefix="minserve-ev-", dir=settings.directory)) for _ in "ab"]
    options = {"num_blocks": 40, "max_num_seqs": 2, "kv_offloading_size": 0.005,
               "kv_events_config": EVENTS}  # fmt: skip
    engines = [_engine(base, d, **options) for d in dirs]
    feeds = [_Follow(e) for e in engines]
    prompts = [history(64 + 48 * i)[i * 3 :] for i in range(8)]
    for i, prompt in enumerate(prompts * 2):
        engines[i % 2].generate([prompt], CHECK, use_tqdm=False)
    before = [feed.compare(engine) for feed, engine in zip(feeds, engines)]
    engines[0].engine.shutdown()
    feeds[0].close()
    engines[0] = _engine(base, dirs[0], **options)  # restarted on its directory
    feeds[0] = _Follow(engines[0])
    for prompt in prompts[:4]:
        engines[0].generate([prompt], CHECK, use_tqdm=False)
    after = [feed.compare(engine) for feed, engine in zip(feeds, engines)]
    for feed, engine in zip(feeds, engines):
        feed.close()
        engine.engine.shutdown()
    return {"before_restart": before, "after_restart": after,
            "exact": all(c["exact"] for c in before + after)}  # fmt: skip


class _Follow:
    """A subscriber and an index of one engine's events, replaying gaps."""

    def __init__(self, llm: LLM) -> None:
        info = llm.engine.kv_events_info()
        self.instance = info["instance"]
        self.subscriber = KVEventSubscriber(info["host"], info["port"], info["replay_port"])
        self.index = ExactIndex([self.instance])
        self.replays = 0

    def compare(self, llm: LLM) -> dict[str, Any]:
        while (batch := self.subscriber.receive(timeout_ms=300)) is not None:
            self._apply(batch)
        tail = self.subscriber.replay(self.index.replicas[self.instance].next_seq)[1]
        self.index.replay(self.instance, tail)
        prefix = llm.engine.kv.prefix
        engine = {"device": prefix.events.held("device"), "host": prefix.events.held("host"),
                  "disk": set(llm.engine.worker.disk_store.keys())}  # fmt: skip
        # the disk writes a step decided are carried out first thing in the next step
        engine["disk"] |= {op.key for op in llm.engine.kv._ops if isinstance(op, DiskWrite)}
        held = {m: self.index.blocks(self.instance, m) for m in engine}
        return {"blocks": {m: len(k) for m, k in engine.items()}, "replays": self.replays,
                "exact": held == engine}  # fmt: skip

    def _apply(self, batch: Any) -> None:
        if not self.index.apply(batch):
            self.replays += 1
            kind, batches = self.subscriber.replay(self.index.replicas[self.instance].behind)
            if kind == "snapshot":
                self.index.resync(batches[0])
            else:
                self.index.replay(self.instance, batches)

    def close(self) -> None:
        self.subscriber.close()


@dataclass(frozen=True)
class Pressure:
    """A spill workload: distinct prompts decoding long enough to outgrow a small pool."""

    num_requests: int
    prompt_len: int
    output_len: int
    num_blocks: int


PRESSURES = (Pressure(8, 64, 300, 64), Pressure(8, 128, 256, 96), Pressure(8, 256, 200, 160))


def spill(base: LLM, settings: Settings) -> dict[str, Any]:
    """Pools too small for their batches: requests admitted together outgrow the pool while
    they decode, so the scheduler preempts; the preempted come back by recomputing what was
    evicted or by reading it from the disk tier (prefix caching on in both)."""
    rows = [_spill_row(base, p, settings) for p in PRESSURES]
    return {"rows": rows, "met": all(r["disk_over_recompute"] >= 1 for r in rows)}


def _spill_row(base: LLM, pressure: Pressure, settings: Settings) -> dict[str, Any]:
    """Median output tokens/s of each mode over `settings.repeats` runs, order alternating."""
    n, size = pressure.num_requests, pressure.prompt_len
    prompts = [history(size + n)[i : i + size] for i in range(n)]  # no two share a block
    params = SamplingParams(temperature=0, max_tokens=pressure.output_len, ignore_eos=True)
    runs: dict[str, list[dict[str, Any]]] = {"recompute": [], "disk": []}
    for repeat in range(settings.repeats):
        for label in ("recompute", "disk") if repeat % 2 == 0 else ("disk", "recompute"):
            runs[label].append(_spill_run(base, pressure, prompts, params, label, settings))
    row: dict[str, Any] = {**asdict(pressure)}
    for label, done in runs.items():
        row[label] = {
            "output_tok_s": statistics.median(r["output_tok_s"] for r in done),
            "preemptions": statistics.median(r["preemptions"] for r in done),
            "disk_blocks_loaded": statistics.median(r["disk_blocks_loaded"] for r in done),
        }
    tokens = [r["tokens"] for done in runs.values() for r in done]
    row["same_tokens"] = all(t == tokens[0] for t in tokens)
    row["disk_over_recompute"] = row["disk"]["output_tok_s"] / row["recompute"]["output_tok_s"]
    return row


def _spill_run(base: LLM, pressure: Pressure, prompts: list[list[int]], params: SamplingParams,
               label: str, settings: Settings) -> dict[str, Any]:  # fmt: skip
    disk = {}
    if label == "disk":
        disk["kv_disk_path"] = tempfile.mkdtemp(prefix="minserve-spill-", dir=settings.directory)
    llm = LLM(base.loaded, num_blocks=pressure.num_blocks, max_num_seqs=pressure.num_requests,
              enable_prefix_caching=True, **disk)  # fmt: skip
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    metrics = llm.get_metrics()
    llm.engine.shutdown()
    return {"output_tok_s": pressure.output_len * pressure.num_requests / seconds,
            "preemptions": metrics.get("num_preemptions", 0),
            "disk_blocks_loaded": metrics["disk_tier_blocks_loaded"],
            "tokens": [o.outputs[0].token_ids for o in outs]}  # fmt: skip


def migration(base: LLM, settings: Settings) -> dict[str, Any]:
    """Per context length, a request migrated twice on a 1P2D cluster (pre-copy, then
    stop-and-copy back): the gaps its client saw, its tokens against the same request run
    uninterrupted on one engine, and whether every instance's pool is free afterwards
    (the instances' free block counts, reported each round)."""
    oracle = LLM(base.loaded, num_blocks=max(settings.migration_lengths) // 16 + 32)
    rows = []
    with DisaggregatedEngine(None, "1P2D", "transfer") as cluster:
        measure_migration_gaps(cluster, 64)  # untimed: the links' first transfers set up
        for n in settings.migration_lengths:
            row = measure_migration_gaps(cluster, n)
            pools = {rank: (s["num_free_blocks"], s["num_blocks"])
                     for rank, s in cluster.instance_stats.items()}  # fmt: skip
            params = replace(CHECK, max_tokens=len(row.token_ids))
            prompt = synthetic_prompt(n, cluster.vocab_size)
            want = oracle.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            same = list(row.token_ids) == want.token_ids  # the same ids: the same text
            measured = {k: v for k, v in asdict(row).items() if k != "token_ids"}
            free = all(f == total for f, total in pools.values())
            rows.append({**measured, "tokens": len(row.token_ids), "identical": same,
                         "pools": {str(rank): list(p) for rank, p in pools.items()},
                         "pools_free": free})  # fmt: skip
    oracle.engine.shutdown()
    gaps = [r["pre_copy"]["max_gap_s"] for r in rows]
    targets = {"identical": all(r["identical"] for r in rows),
               "gap": all(r["pre_copy"]["max_gap_s"] <= 2 * r["median_step_s"] for r in rows),
               "flat": max(gaps) <= 1.5 * min(gaps),
               "pools_free": all(r["pools_free"] for r in rows)}  # fmt: skip
    return {"rows": rows, "spread": max(gaps) / min(gaps), "targets": targets}
