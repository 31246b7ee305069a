"""Chapter 11's pictures: where a block comes from, and what it costs to get it there."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes

TIER_STYLE = {"recompute": "o-", "device": "s-", "host": "^-", "disk": "v-"}


def plot_first_token_by_tier(
    lengths: Sequence[int], seconds: Mapping[str, Sequence[float]], ax: Axes | None = None
) -> Axes:
    """Time to first token (ms) against history length, one line per tier it came from."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    for tier, values in seconds.items():
        ax.plot(lengths, [s * 1e3 for s in values], TIER_STYLE.get(tier, ".-"), label=tier)
    ax.set_xlabel("history length (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(lengths), [str(n) for n in lengths])
    ax.set_title("a returning session's first token, by the tier its KV comes from")
    ax.legend()
    return ax


def cut_seconds(
    holders: Sequence[str],
    latency_s: Mapping[str, float],
    bytes_per_s: Mapping[str, float],
    block_nbytes: int,
    recompute_block_s: float,
) -> list[float]:
    """The predicted time of every cut k = 0..len(holders): load blocks [0, k) from the tiers
    named in `holders` (each tier's latency once), recompute the rest. The curve the
    load-or-recompute rule takes the minimum of; computed cut by cut, for pictures."""
    times = []
    for k in range(len(holders) + 1):
        loaded = holders[:k]
        fixed = sum(latency_s[tier] for tier in set(loaded))
        moved = sum(block_nbytes / bytes_per_s[tier] for tier in loaded)
        times.append(fixed + moved + (len(holders) - k) * recompute_block_s)
    return times
