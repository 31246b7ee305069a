"""What a KV hand-off costs: bytes and seconds per request, against the request's prefill.

Each prompt length goes through a real `PrefillDecodePair` (two gloo processes, one torch
thread each) started with `transfer_policy="transfer"`, one request at a time, so the
numbers belong to that request alone:
- KV bytes: what `TorchKVTransfer` sent (whole blocks), beside the formula for the tokens,
  layers x 2 x KV heads x head_dim x dtype bytes x prompt tokens;
- transfer time: the prefill side's time inside `dist.send` for those blocks (the decode
  side is receiving at the same moment), and the rule's estimate from the measured link;
- prefill time: the prefill engine's step that ran the whole prompt (its step record).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import numpy as np

from minserve.disagg.pd_pair import PrefillDecodePair
from minserve.engine import observe_steps
from minserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class TransferRow:
    """One prompt length: median seconds over repeats; bytes are exact."""

    prompt_len: int
    kv_bytes: int  # sent: whole blocks
    kv_bytes_tokens: int  # the prompt's own tokens, by the formula
    transfer_s: float  # measured: time in dist.send
    estimated_transfer_s: float  # the transfer rule's latency + bytes / bandwidth
    prefill_s: float
    recompute_estimate_s: float  # the rule's running estimate (its auto choice compares these)

    @property
    def transfer_over_prefill(self) -> float:
        return self.transfer_s / self.prefill_s


def kv_bytes_for_tokens(pair: PrefillDecodePair, num_tokens: int) -> int:
    """layers x 2 (K and V) x KV heads x head_dim x dtype bytes x tokens."""
    config = pair.llm.loaded.config
    itemsize = pair.llm.engine.worker.pool.kv.element_size()
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize * num_tokens


def measure_one(pair: PrefillDecodePair, prompt_len: int, seed: int) -> tuple[float, float, dict]:
    """Send one prompt of `prompt_len` tokens through the pair: (send s, prefill s, decision)."""
    engine = pair.llm.engine
    vocab = pair.llm.loaded.config.vocab_size
    prompt = [(97 * i + 31 * seed) % (vocab - 100) + 100 for i in range(prompt_len)]
    before = pair.transfer.stats.seconds, pair.transfer.stats.num_transfers
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with observe_steps(engine) as records:
        (output,) = pair.generate([prompt], params)
    if pair.transfer.stats.num_transfers != before[1] + 1:
        raise RuntimeError(f"expected one KV transfer for {output.request_id}, saw none")
    last = records[-1]  # the prefill engine's last step
    if last.scheduler_output.num_batched_tokens != prompt_len:
        raise RuntimeError(
            f"the last prefill step ran {last.scheduler_output.num_batched_tokens} tokens, not "
            f"the {prompt_len}-token prompt: raise max_num_batched_tokens to prefill it in one step"
        )
    decision = asdict(pair.decisions[output.request_id])
    return pair.transfer.stats.seconds - before[0], last.timings.total, decision


def measure_transfers(
    pair: PrefillDecodePair, prompt_lens: tuple[int, ...], repeats: int, progress=None
) -> list[TransferRow]:
    """`repeats` requests per prompt length (after one warm-up request)."""
    if pair.rule.policy != "transfer":
        raise ValueError("measure with transfer_policy='transfer': every request must move KV")
    measure_one(pair, 16, seed=0)  # warm-up: first calls allocate and load lazily
    rows = []
    for prompt_len in prompt_lens:
        runs = [measure_one(pair, prompt_len, seed=r + 1) for r in range(repeats)]
        decision = runs[-1][2]
        rows.append(
            TransferRow(
                prompt_len,
                decision["kv_bytes"],
                kv_bytes_for_tokens(pair, prompt_len),
                statistics.median(r[0] for r in runs),
                decision["transfer_s"],
                statistics.median(r[1] for r in runs),
                decision["recompute_s"],
            )
        )
        if progress is not None:
            progress.update(1)
    return rows


def fit_link(rows: list[TransferRow]) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of `transfer_s = latency + kv_bytes / bandwidth`, by least
    squares over the measured requests: steadier than the pair's one-shot ping-pong."""
    if len({r.kv_bytes for r in rows}) < 2:
        raise ValueError("fitting a link needs transfers of at least 2 different sizes")
    a = np.array([[1.0, r.kv_bytes] for r in rows])  # [rows, 2]
    (latency, per_byte), *_ = np.linalg.lstsq(a, np.array([r.transfer_s for r in rows]), rcond=None)
    if per_byte <= 0:
        raise ValueError(f"transfer time does not grow with bytes: {[asdict(r) for r in rows]}")
    return max(0.0, float(latency)), 1.0 / float(per_byte)


def transfer_report(
    pair: PrefillDecodePair, prompt_lens: tuple[int, ...], repeats: int, progress=None
) -> dict:
    """Rows per prompt length, plus the link the pair measured at start-up."""
    rows = measure_transfers(pair, prompt_lens, repeats, progress)
    try:
        fitted = fit_link(rows)
    except ValueError:  # one size only, or transfers too small to rise above timing noise
        fitted = None
    return {
        "link_pingpong": {
            "latency_s": pair.rule.latency_s,
            "bandwidth_bytes_s": pair.rule.bandwidth_bytes_s,
        },
        "link_fitted": None
        if fitted is None
        else {"latency_s": fitted[0], "bandwidth_bytes_s": fitted[1]},
        "block_size": pair.llm.engine.worker.pool.block_size,
        "repeats": repeats,
        "rows": [{**asdict(r), "transfer_over_prefill": r.transfer_over_prefill} for r in rows],
    }
