"""Keyed seeded draws: a seeded request's random numbers as a function of where they are used.

A running generator cannot resume. If a seeded sample drew from one `torch.Generator` step
after step, its k-th token would use the k-th number of that stream, and the stream's state
would be the only record of how far it had got. A request restarted from "prompt + the
tokens generated so far" (a router moving a stream to another instance, a decode instance
continuing another's prefill) starts a fresh generator at its first number, so it draws
different numbers and the text diverges from the one it continues.

So no draw depends on the draws before it. Before each draw the sample's generator is
re-seeded in place with a key made of everything that says *which* draw this is:

    seed      the request's seed, taken modulo 2**64
    index     which of the request's n samples (each sample its own stream)
    position  the number of tokens before the one being drawn (prompt + output so far)
    purpose   what the draw is for: the sampler's token ("sample"), a speculative draft
              ("draft"), or a speculative round's verification ("verify")

The position is the same whether the tokens before it were generated here or arrived as
part of a longer prompt, so a continued request draws exactly the numbers the original
would have (the counter-based idea of Salmon et al., "Parallel random numbers: as easy as
1, 2, 3", 2011, on top of an ordinary generator).

The parts are mixed by chaining SplitMix64's finaliser (Steele, Lea and Flood, 2014):
key = mix(... mix(mix(seed) ^ index) ^ position ...). Each link is a bijection of 64-bit
words, so for the same index, position and purpose two seeds that differ modulo 2**64
give different keys, and a small change in any part changes about half of the key's bits.
torch's CPU generator (mt19937) keeps the low 32 bits of a seed: two different keys give
the same numbers with probability 2**-32, and the mixing spreads every part over those bits.
Re-seeding costs one generator initialisation per seeded row per step, on the CPU, so a seed
gives the same tokens on any device.
"""

from __future__ import annotations

from typing import Literal

import torch

Purpose = Literal["sample", "draft", "verify"]
PURPOSE_CODES: dict[str, int] = {"sample": 1, "draft": 2, "verify": 3}
WORD = 2**64
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2**64 / the golden ratio, odd


def splitmix64(x: int) -> int:
    """SplitMix64's output for state `x` (the reference `splitmix64.c`): a bijection of
    64-bit words whose every output bit depends on every input bit."""
    z = (x + _GOLDEN_GAMMA) % WORD
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % WORD
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % WORD
    return z ^ (z >> 31)


def draw_key(seed: int, index: int, position: int, purpose: Purpose) -> int:
    """The 64-bit key of one seeded draw: (seed mod 2**64, sample index, position, purpose)
    mixed by chained SplitMix64 (module doc). Any integer seed works; index and position
    are counts (>= 0)."""
    if index < 0 or position < 0:
        raise ValueError(f"a draw's sample index and position are counts; got {index}, {position}")
    if purpose not in PURPOSE_CODES:
        raise ValueError(f"unknown draw purpose {purpose!r}; expected one of {list(PURPOSE_CODES)}")
    key = splitmix64(seed % WORD)
    for part in (index, position, PURPOSE_CODES[purpose]):
        key = splitmix64(key ^ (part % WORD))
    return key


def reseeded(
    generator: torch.Generator, seed: int, index: int, position: int, purpose: Purpose
) -> torch.Generator:
    """`generator`, re-seeded in place for the draw (seed, index, position, purpose): what it
    draws next depends on those four values only, never on what it drew before."""
    return generator.manual_seed(draw_key(seed, index, position, purpose))
