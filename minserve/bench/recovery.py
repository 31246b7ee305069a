"""A replica dies mid-stream: the router continues its streams on the other replica, which
reads their KV back from a disk tier the two share.

    replica A ─┐ --kv-disk-path DIR: one directory; every cached block written through
    replica B ─┘                     one step after the step that computed it
    router (this process) ◄─ N streams at once: half greedy, half seeded at temperature 0.8
    every stream has `kill_at` tokens ─► SIGKILL the replica serving most of them (A)
    the router sends A's streams to B with `resume_token_ids` ─► B loads what DIR holds of
    prompt + tokens so far, computes the rest, and the streams go on

Oracle: the same requests on two fresh replicas that nobody kills; every stream must end
with the same text, byte for byte. A stream's stall is the longest gap between its chunks,
as its client saw them, from the kill on (before it, gaps are the prompts' admission: the
oracle shows them too). Recompute: B's prefix-cache counters (vLLM's prefix_cache_queries
and prefix_cache_hits, in tokens) across the resumes, against the blocks of each resumed
stream that DIR held just after the kill (listed then, before B could add any).
"""

from __future__ import annotations

import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from minserve.bench.disagg_goodput import Launched, running, wait_ready
from minserve.bench.stream_reads import StreamRead, stream_all
from minserve.distributed.group import free_port
from minserve.kvcache.block_key import BlockKey, block_keys
from minserve.kvcache.disk_store import SUFFIX
from minserve.router import RouterConfig, build_router
from minserve.server.background import BackgroundServer

# A chunk A sent before it died reaches the client this soon after the kill; B's first chunk
# of a resumed stream needs a step of B's after the router's resume request: far later.
RELAY_GRACE_S = 0.02
QUERIES, HITS = "minserve:prefix_cache_queries_total", "minserve:prefix_cache_hits_total"
DISK_LOADS = "minserve:disk_tier_hit_blocks_total"
STALL_TARGET_S = 1.0
TARGETS = {
    "identical": "every stream ends with the oracle's text, byte for byte",
    "recompute": "a resumed stream recomputes at most one block (16 tokens) beyond its tokens "
    "not yet written through",
    "stall": f"the longest stall a client sees (from the kill on) is under {STALL_TARGET_S:g} s",
}


@dataclass(frozen=True)
class RecoverySpec:
    """The streams, when the kill comes, and the replicas' flags."""

    num_streams: int = 8  # the first half greedy, the rest seeded (distinct seeds)
    prompt_len: int = 600  # tokens of English text, distinct per stream from the first block on
    output_len: int = 200  # ignore_eos: every stream runs to its length
    kill_at: int = 50  # tokens every stream has when the busiest replica is killed
    temperature: float = 0.8  # the seeded streams'
    policy: str = "kv_aware"  # or cache_aware
    directory: str = "/var/tmp"  # the shared disk tier's folder goes here (a real disk)
    num_blocks: int = 1024  # per replica
    startup_timeout_s: float = 180.0
    stream_timeout_s: float = 600.0  # for all the streams of one pass

    def __post_init__(self) -> None:
        if self.num_streams < 2 or not 0 < self.kill_at < self.output_len:
            raise ValueError(f"need 2+ streams and 0 < kill_at < output_len, got {self}")
        if self.policy not in ("kv_aware", "cache_aware"):
            raise ValueError(f"policy must be kv_aware or cache_aware, got {self.policy!r}")


TOPICS = ("a lighthouse keeper", "a river barge", "an old library", "a mountain village",
          "a night train", "a bakery at dawn", "a chess club", "a small observatory")  # fmt: skip


def stream_prompt(stream: int, length: int, tokenizer: Any) -> list[int]:
    """`length` tokens of ordinary English about another topic per stream (what users send:
    a model's next-token distribution over random ids is nearly flat, and a sampled draw
    there turns on the last bits of the logits)."""
    topic = TOPICS[stream % len(TOPICS)]
    sentence = (f"This is a story about {topic}. Every day brought small changes, and the "
                f"people who lived there wrote them down in a notebook. ")  # fmt: skip
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer.encode(sentence)
    return ids[:length]


def request_body(spec: RecoverySpec, stream: int, tokenizer: Any) -> dict[str, Any]:
    """Stream `stream`'s request: greedy for the first half, seeded for the rest."""
    sampling: dict[str, Any] = {"temperature": 0}
    if stream >= spec.num_streams // 2:
        sampling = {"temperature": spec.temperature, "seed": 1000 + stream}
    return {"prompt": stream_prompt(stream, spec.prompt_len, tokenizer),
            "max_tokens": spec.output_len,
            "ignore_eos": True, "stream": True, "return_token_ids": True, **sampling}  # fmt: skip


@dataclass(frozen=True)
class Kill:
    """The kill: which replica died, which survived, when, the survivor's counters just
    before, and the keys of the blocks the shared directory held just after."""

    victim: str
    survivor: str
    at: float  # time.monotonic()
    before: dict[str, float]
    on_disk: frozenset[BlockKey]


@dataclass
class Pass:
    """One pass of the streams through the router, and what the replicas said."""

    reads: list[StreamRead]
    kill: Kill | None = None
    after: dict[str, float] = field(default_factory=dict)  # the survivor's counters at the end
    resumed_tokens: int = 0  # the router's count: generated tokens carried to the survivor
    router_longest_stall_s: float = 0.0
    root: BlockKey = b""  # the replicas' block-key root (GET /v1/kv_events)
    block_size: int = 16


def keys_on_disk(directory: Path) -> frozenset[BlockKey]:
    """The keys of the block files in a disk tier's directory (`DIR/ab/<key hex>.kvb`)."""
    return frozenset(bytes.fromhex(p.stem) for p in directory.glob(f"*/*{SUFFIX}"))


def counters(url: str) -> dict[str, float]:
    """A server's /metrics samples, by name."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def serve_command(spec: RecoverySpec, directory: Path, port: int) -> list[str]:
    """A replica: the bundled model, prefix caching, the shared disk tier, KV events."""
    return [sys.executable, "-m", "minserve.cli", "serve", "--port", str(port),
            "--num-blocks", str(spec.num_blocks), "--enable-prefix-caching",
            "--kv-disk-path", str(directory),
            "--kv-events-config", json.dumps({"enable_kv_cache_events": True}),
            "--target-ttft-ms", "0", "--target-tpot-ms", "0"]  # fmt: skip


@contextmanager
def replicas(spec: RecoverySpec, directory: Path) -> Iterator[dict[str, Launched]]:
    """Two `minserve serve` processes (one torch thread each) sharing `directory`; URL ->
    process. Both are stopped on exit, whatever happened."""
    with ExitStack() as stack:
        ports = [free_port() for _ in range(2)]
        launched = {f"http://127.0.0.1:{port}": stack.enter_context(running(serve_command(
            spec, directory, port))) for port in ports}  # fmt: skip
        for url in launched:
            wait_ready(url, list(launched.values()), spec.startup_timeout_s)
        yield launched


def kill_busiest(processes: dict[str, Launched], directory: Path, reads: list[StreamRead]) -> Kill:
    """SIGKILL the replica that opened the most streams; list the directory at once."""
    victim = Counter(r.replica for r in reads).most_common(1)[0][0]
    survivor = next(url for url in processes if url != victim)
    before = counters(survivor)
    at = time.monotonic()
    processes[victim].proc.send_signal(signal.SIGKILL)
    return Kill(victim, survivor, at, before, keys_on_disk(directory))


def run_pass(spec: RecoverySpec, bodies: list[dict[str, Any]], killing: bool) -> Pass:
    """Fresh replicas on a fresh directory, the router in front, the streams through it
    (with the kill, or not); the directory is removed at the end."""
    directory = Path(tempfile.mkdtemp(prefix="minserve-recovery-", dir=spec.directory))
    try:
        with replicas(spec, directory) as processes:
            info = httpx.get(next(iter(processes)) + "/v1/kv_events", timeout=10).json()
            router = build_router(RouterConfig(tuple(processes), policy=spec.policy))
            server = BackgroundServer(router)
            try:
                kill = partial(kill_busiest, processes, directory) if killing else None
                reads, killed = stream_all(server.start(), bodies, spec.stream_timeout_s,
                                           spec.kill_at, kill)  # fmt: skip
            finally:
                server.stop()
            done = Pass(reads, killed, root=bytes.fromhex(info["root"]),
                        block_size=info["block_size"])  # fmt: skip
            if killed is not None:
                done.after = counters(killed.survivor)
                survivor = next(r for r in router.replicas if r.url == killed.survivor)
                done.resumed_tokens = survivor.resumed_tokens
                done.router_longest_stall_s = router.stalls.longest
            return done
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def recovery(spec: RecoverySpec) -> dict[str, Any]:
    """The oracle pass, then the pass with the kill; per stream and in sum, and each of
    `TARGETS` met or not."""
    from minserve.router.prompt_reader import load_tokenizer

    tokenizer = load_tokenizer(None)  # the bundled model's
    bodies = [request_body(spec, i, tokenizer) for i in range(spec.num_streams)]
    oracle = run_pass(spec, bodies, killing=False)
    killed = run_pass(spec, bodies, killing=True)
    assert killed.kill is not None
    pairs = zip(bodies, oracle.reads, killed.reads)
    rows = [stream_row(i, body, want, got, killed, spec.kill_at)
            for i, (body, want, got) in enumerate(pairs)]  # fmt: skip
    recompute = recompute_sum(rows, killed, spec.prompt_len)
    excess = max(0, recompute["beyond_not_written"])
    for row in rows:  # the survivor's counters give the sum: each stream's share is bounded
        if row["resumed"]:
            row["recomputed"] = [row["not_written"], row["not_written"] + excess]
    stall = max(r["stall_s"] for r in rows)
    targets = {
        "identical": all(r["identical"] for r in rows),
        "recompute": recompute["beyond_not_written"] <= killed.block_size,
        "stall": stall < STALL_TARGET_S,
    }
    settled = decoding_since(oracle.reads, spec.kill_at)
    return {"spec": asdict(spec), "streams": rows, "recompute": recompute, "stall_s": stall,
            "longest_gap_s": max(r["longest_gap_s"] for r in rows),
            "router_longest_stall_s": killed.router_longest_stall_s,
            "oracle_stall_s": max(r.longest_gap_after(settled) for r in oracle.reads),
            "oracle_median_gap_s": statistics.median(
                b - a for r in oracle.reads for a, b in zip(r.times, r.times[1:])),
            "targets": targets}  # fmt: skip


def decoding_since(reads: list[StreamRead], kill_at: int) -> float:
    """When the last stream got its `kill_at`-th token: the kill's moment, or where it would
    have come in a pass without one. Gaps before it are the prompts' admission, not a stall."""
    return max(r.time_of(kill_at) for r in reads)


def stream_row(
    index: int, body: dict[str, Any], want: StreamRead, got: StreamRead, run: Pass, kill_at: int
) -> dict[str, Any]:
    """One stream: same text as the oracle, resumed or not, its longest gap (in all, and
    from the kill on: its stall); a resumed one's tokens at the resume and the blocks of
    them the directory held after the kill."""
    assert run.kill is not None
    full = len(got.token_ids) == body["max_tokens"] and got.done and got.error is None
    row = {"stream": index, "seed": body.get("seed"), "temperature": body["temperature"],
           "identical": full and got.text.encode() == want.text.encode()
           and got.token_ids == want.token_ids,
           "resumed": got.replica == run.kill.victim, "longest_gap_s": got.longest_gap_s,
           "stall_s": got.longest_gap_after(decoding_since(run.reads, kill_at)),
           "error": got.error}  # fmt: skip
    if row["resumed"]:
        prompt, size = body["prompt"], run.block_size
        relayed = run.kill.at + RELAY_GRACE_S  # the killed replica's chunks have all come
        at_resume = len(prompt) + got.tokens_by(relayed)
        keys = block_keys(run.root, prompt + got.token_ids, size)
        on_disk = next((i for i, key in enumerate(keys) if key not in run.kill.on_disk), len(keys))
        usable = min(on_disk, (at_resume - 1) // size)  # the last token is always computed
        row.update(tokens_at_resume=at_resume, blocks_on_disk=on_disk, usable_blocks=usable,
                   not_written=at_resume - usable * size,
                   resume_gap_s=got.gap_across(relayed))  # fmt: skip
    return row


def recompute_sum(rows: list[dict[str, Any]], run: Pass, prompt_len: int) -> dict[str, Any]:
    """The survivor's counters across the resumes against what the directory held.

    queries - hits is what the survivor computed of the resumed requests' prompt + tokens;
    the rest it found cached (from the disk: nothing of these streams was on its device).
    Each resumed stream must compute at least its tokens not in a usable block on disk
    (`not_written`); hits can only fall short of the usable blocks, so the blocks on disk
    it computed anyway, summed, bound every stream's own excess."""
    assert run.kill is not None
    delta = {name: run.after.get(name, 0.0) - run.kill.before.get(name, 0.0)
             for name in (QUERIES, HITS, DISK_LOADS)}  # fmt: skip
    resumed = [r for r in rows if r["resumed"]]
    usable_tokens = run.block_size * sum(r["usable_blocks"] for r in resumed)
    queries, hits = int(delta[QUERIES]), int(delta[HITS])
    prompts = sum(r["tokens_at_resume"] for r in resumed)
    return {"resumed_streams": len(resumed), "queries": queries, "hits": hits,
            "disk_blocks_loaded": int(delta[DISK_LOADS]), "recomputed": queries - hits,
            "not_written": queries - usable_tokens, "usable_tokens_on_disk": usable_tokens,
            "beyond_not_written": usable_tokens - hits,
            "client_tokens_at_resume": prompts,
            "router_tokens_at_resume": run.resumed_tokens + prompt_len * len(resumed)}  # fmt: skip
