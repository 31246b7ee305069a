"""Checks for chapter 02 (paged attention), run against any module that defines the
chapter's six kernels: minserve's own, the solutions, or a student's exercise file.

Each check builds a small paged KV pool (blocks of 4 tokens, handed out in shuffled order,
every other slot filled with NaN: a kernel that reads one slot past a context returns NaN),
launches the kernel under test through minserve's launchers (`gather_kv`, `tile_attention`,
`paged_decode(kernel=..., combine_kernel=...)`, `paged_store(kernel=...)`,
`paged_prefill(kernel=...)`), and compares it with plain torch: an indexing of the pool for
2.4, `paged_attention_reference` for 2.5-2.7 and 2.9, a log-sum-exp merge for 2.7, an
indexed assignment of the pool's slots for 2.8 (between guard rows that must stay as they
were). Each rung is checked alone: the other kernels of a launch are minserve's. A
mismatch names the sequence, its context length, the query head and the largest error. The
tensors live where the kernel runs: the CPU in Triton's interpreter, the GPU when Triton
compiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch
from hypothesis import HealthCheck, Verbosity, given, settings
from hypothesis import strategies as st

from minserve.attention.metadata import AttentionMetadata
from minserve.attention.paged_torch import paged_attention_reference
from minserve.attention.triton_decode import combine_splits, paged_decode
from minserve.attention.triton_env import interpreting
from minserve.attention.triton_prefill import paged_prefill
from minserve.attention.triton_store import paged_store
from minserve.attention.triton_tiles import gather_kv, tile_attention
from minserve.course.checks_ch02_first_steps import FIRST_STEP_CHECKS
from minserve.course.checks_ch02_first_steps import HINTS as FIRST_STEP_HINTS
from minserve.course.nonfinite import (
    LOG_OF_ZERO,
    MASKED_ROW,
    MAX_SUBTRACTION,
    lead_with_nonfinite,
)
from minserve.course.triton_launch import kernel_device, launched

BLOCK_SIZE = 4
HEAD_DIM = 16
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
OUTSIDE_THE_CONTEXT = (
    "a load outside the context: the pool holds NaN in every slot no sequence owns, so mask "
    "every load with the tokens' validity (other=0.0)"
)
COMBINE_NAN_CAUSES = (
    "exp2 of the lse without the largest subtracted first: 2^300 overflows to inf, and "
    "inf / inf is NaN",
    "an empty split (lse -inf) weighed as -inf - (-inf), which is NaN; it weighs 0",
    "splits past num_splits loaded without a mask (other=-inf for lse)",
)
EXP_OVERFLOWS_PAST = 88.0  # exp(88.7) is float32's largest; exp2(s * log2(e)) is the same


@dataclass(frozen=True)
class DecodeCase:
    """A decode step: one query token per sequence over its paged context."""

    q: torch.Tensor  # [S, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, Hkv, D], NaN outside every context
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    contexts: tuple[int, ...]  # each sequence's context length, on the host

    @classmethod
    def random(
        cls, contexts: list[int], heads: int = 2, kv_heads: int = 2, dtype=torch.float32,
        new: list[int] | None = None,
    ) -> DecodeCase:  # fmt: skip
        """`new`: each sequence's query tokens, the last of its context (1 each: a decode)."""
        new = new or [1] * len(contexts)
        gen = torch.Generator().manual_seed(sum(contexts) + heads)
        needed = [-(-c // BLOCK_SIZE) for c in contexts]
        free = torch.randperm(sum(needed) + 2, generator=gen).tolist()
        tables = [[free.pop() for _ in range(n)] for n in needed]
        shape = (sum(needed) + 2, BLOCK_SIZE, kv_heads, HEAD_DIM)
        k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
        for table, context in zip(tables, contexts):
            for pos in range(context):
                block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                k_cache[block, offset] = torch.randn(kv_heads, HEAD_DIM, generator=gen)
                v_cache[block, offset] = torch.randn(kv_heads, HEAD_DIM, generator=gen)
        device = kernel_device()
        metadata = AttentionMetadata.build(
            query_lens=new,
            context_lens=contexts,
            block_tables=tables,
            slot_mapping=[t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                          for t, c, n in zip(tables, contexts, new) for p in range(c - n, c)],
            device=device,
        )  # fmt: skip
        q = torch.randn(sum(new), heads, HEAD_DIM, generator=gen)
        return cls(*(t.to(device, dtype) for t in (q, k_cache, v_cache)), metadata, tuple(contexts))

    def expected(self, scale: float | None = None) -> torch.Tensor:
        """The reference, on the same pool with its NaNs zeroed (it reads whole blocks)."""
        k, v = self.k_cache.nan_to_num(0.0), self.v_cache.nan_to_num(0.0)
        return paged_attention_reference(self.q, k, v, self.metadata, scale).float().cpu()

    def nan_causes(self, scale: float | None = None) -> tuple[str, ...]:
        """What puts NaN or inf into an attention output on this case, likeliest first: with
        scores past exp's range, a missing max subtraction; else a load outside the context."""
        q = self.q.float().cpu().flatten(0, 1)  # [S * Hq, D]
        k = self.k_cache.float().cpu().nan_to_num(0.0).flatten(0, 2)  # [slots * Hkv, D]
        reach = float((q @ k.T).abs().max()) * (scale or HEAD_DIM**-0.5)
        if reach > EXP_OVERFLOWS_PAST:
            overflow = f"{MAX_SUBTRACTION}; the scores here reach {reach:.0f}"
            return overflow, OUTSIDE_THE_CONTEXT, MASKED_ROW, LOG_OF_ZERO
        return OUTSIDE_THE_CONTEXT, MASKED_ROW, MAX_SUBTRACTION, LOG_OF_ZERO


def run_kernel(impl: ModuleType, case: DecodeCase, **options) -> torch.Tensor:
    """Launch the implementation's decode kernel (2.6) with minserve's combine; or, with
    `combine=True`, minserve's decode kernel with the implementation's combine (2.7)."""
    md = case.metadata
    kernels = (
        {"combine_kernel": impl.combine_splits_kernel}
        if options.pop("combine", False)
        else {"kernel": impl.paged_decode_kernel}
    )
    out = launched(
        lambda: paged_decode(
            case.q,
            case.k_cache,
            case.v_cache,
            md.block_tables,
            md.context_lens,
            md.max_context_len,
            **kernels,
            **options,
        )  # fmt: skip
    )
    return out.float().cpu()


# tl.dot tiles: the interpreter takes 4 (short tests), the GPU compiler at least 16
TILE = 4 if interpreting() else 16


def assert_close(case: DecodeCase, got: torch.Tensor, what: str, scale: float | None = None):
    """Compare per (sequence, head) and name the first pair that is off."""
    expected = case.expected(scale)
    tol = TOLERANCE[case.q.dtype]
    contexts = case.contexts
    for seq, head in torch.cartesian_prod(
        torch.arange(got.shape[0]), torch.arange(got.shape[1])
    ).tolist():
        error = (got[seq, head] - expected[seq, head]).abs().max().item()
        if not error <= tol:  # NaN fails too
            tokens = f"{contexts[seq]} token" + ("s" if contexts[seq] > 1 else "")
            message = (
                f"{what}: sequence {seq} (context of {tokens}), query head {head}: max "
                f"error {error:.3g} (tolerance {tol:g}); expected "
                f"{_head(expected[seq, head])}, got {_head(got[seq, head])}"
            )
            raise AssertionError(lead_with_nonfinite(got, message, case.nan_causes(scale)))


def _head(row: torch.Tensor) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in row[:4].tolist()) + ", ...]"


def gathered(case: DecodeCase, seq: int, kv_head: int) -> torch.Tensor:
    """What 2.4 should return: the sequence's K rows of `kv_head` by indexing, [n, D]."""
    n = int(case.metadata.context_lens[seq])
    table = case.metadata.block_tables[seq].cpu().long()
    tokens = torch.arange(n)
    return case.k_cache.cpu()[table[tokens // BLOCK_SIZE], tokens % BLOCK_SIZE, kv_head]


def assert_gather(impl: ModuleType, case: DecodeCase, kv_head: int, block_n: int) -> None:
    """Every sequence gathered alone; rows in the context equal the pool's, the rest 0."""
    md = case.metadata
    for seq, n in enumerate(case.contexts):
        got = launched(
            gather_kv, case.k_cache, md.block_tables[seq], n, kv_head, block_n,
            kernel=impl.gather_kv_kernel,
        ).float().cpu()  # fmt: skip
        expected, table = gathered(case, seq, kv_head).float(), md.block_tables[seq].tolist()
        what = f"sequence {seq} (context of {n} tokens, block table {table[: -(-n // BLOCK_SIZE)]})"
        for t in range(got.shape[0]):
            if t < n and not torch.equal(got[t], expected[t]):
                message = (
                    f"gather, {what}, tiles of {block_n}: token {t} lives in block "
                    f"{table[t // BLOCK_SIZE]} at offset {t % BLOCK_SIZE}, KV head {kv_head}; "
                    f"expected {_head(expected[t])}, got {_head(got[t])}"
                )
                raise AssertionError(lead_with_nonfinite(got, message, [OUTSIDE_THE_CONTEXT]))
            if t >= n and got[t].abs().max() != 0:
                message = (
                    f"gather, {what}, tiles of {block_n}: row {t} is past the context and "
                    f"must stay 0, got {_head(got[t])}; mask the loads and the store with "
                    "t < context_len"
                )
                raise AssertionError(lead_with_nonfinite(got, message, [OUTSIDE_THE_CONTEXT]))


def check_gather_follows_the_block_table(impl: ModuleType) -> None:
    """Gather: contexts of 3, 4, 5 and 14 tokens, tiles of 4, KV head 1, NaN beyond"""
    assert_gather(impl, DecodeCase.random([3, 4, 5, 14]), kv_head=1, block_n=4)


def check_gather_tiles_span_blocks(impl: ModuleType) -> None:
    """Gather: tiles of 8 tokens span two blocks of 4; contexts of 3 and 13, KV head 0"""
    assert_gather(impl, DecodeCase.random([13, 3]), kv_head=0, block_n=8)


def run_tile(impl: ModuleType, case: DecodeCase, scale: float | None = None) -> torch.Tensor:
    """2.5 on every sequence of the case, one at a time: [S, Hq, D] on the CPU."""
    md = case.metadata
    rows = [
        launched(
            tile_attention,
            case.q[seq],
            case.k_cache,
            case.v_cache,
            md.block_tables[seq],
            n,
            scale,
            kernel=impl.tile_attention_kernel,
        )  # fmt: skip
        for seq, n in enumerate(case.contexts)
    ]
    return torch.stack(rows).float().cpu()


def check_one_tile_softmax_attention(impl: ModuleType) -> None:
    """One tile: contexts of 1, 3, 4 and 7 tokens, 4 query heads over 2 KV heads"""
    case = DecodeCase.random([1, 3, 4, 7], heads=4, kv_heads=2)
    assert_close(case, run_tile(impl, case), "one tile")


def check_one_tile_subtracts_the_max(impl: ModuleType) -> None:
    """One tile, scale 20: scores in the hundreds, whose exp overflows unless the max goes first"""
    case = DecodeCase.random([5, 8])
    assert_close(case, run_tile(impl, case, scale=20.0), "one tile, scale 20", scale=20.0)


def check_a_context_of_one_token_returns_its_value(impl: ModuleType) -> None:
    """A context of one token: softmax over one score is 1, so the output is that token's v."""
    case = DecodeCase.random([1])
    assert_close(case, run_kernel(impl, case), "context of 1 token")


def check_block_edges_and_shuffled_blocks(impl: ModuleType) -> None:
    """Contexts of 3, 4, 5 and 14 tokens (block_size 4) in shuffled blocks, NaN beyond."""
    case = DecodeCase.random([3, 4, 5, 14])
    assert_close(case, run_kernel(impl, case), "contexts of 3, 4, 5, 14 tokens")


def check_grouped_query_heads_share_their_kv_head(impl: ModuleType) -> None:
    """GQA: 6 query heads over 2 KV heads; heads 0-2 read KV head 0, heads 3-5 KV head 1."""
    case = DecodeCase.random([2, 9], heads=6, kv_heads=2)
    assert_close(case, run_kernel(impl, case), "6 query heads over 2 KV heads")


def check_online_softmax_across_many_tiles(impl: ModuleType) -> None:
    """A 37-token context read 4 tokens at a time: the running max and sum carry over."""
    case = DecodeCase.random([37, 6])
    assert_close(case, run_kernel(impl, case, block_n=TILE), f"37 tokens in tiles of {TILE}")


def check_large_scores_do_not_overflow(impl: ModuleType) -> None:
    """Scale 20: scores in the hundreds, whose exp overflows unless the max is subtracted."""
    case = DecodeCase.random([5, 13])
    got = run_kernel(impl, case, scale=20.0, block_n=TILE)
    assert_close(case, got, "softmax scale 20", scale=20.0)


def check_split_k_respects_each_splits_range(impl: ModuleType) -> None:
    """Flash-decoding: 3 splits of 8 tokens (start..end); the short sequence's are empty."""
    case = DecodeCase.random([2, 21])
    got = run_kernel(impl, case, num_splits=3, block_n=TILE)
    assert_close(case, got, "3 splits of 8 tokens")


def check_bf16_inputs_are_upcast(impl: ModuleType) -> None:
    """bf16 caches: load, convert to fp32, compute (tl.dot and exp2 in fp32)."""
    case = DecodeCase.random([3, 9], heads=4, kv_heads=2, dtype=torch.bfloat16)
    assert_close(case, run_kernel(impl, case), "bf16 inputs")


def check_combine_weighs_each_split_by_its_lse(impl: ModuleType) -> None:
    """Combine: 3 splits with lse 300, 290 and -inf (empty), and 3 equal ones"""
    gen = torch.Generator().manual_seed(2)
    parts = torch.randn(1, 2, 3, HEAD_DIM, generator=gen)  # [S, Hq, splits, D]
    lse = torch.tensor([[[300.0, 290.0, float("-inf")], [1.5, 1.5, 1.5]]])  # [S, Hq, splits]
    parts[0, 0, 2] = 1000.0  # an empty split (its output is 0 in the engine) weighs nothing
    weights = torch.softmax(lse * math.log(2), dim=-1)  # 2^lse_i / sum_j 2^lse_j
    expected = (weights[..., None] * parts).sum(dim=2)  # [S, Hq, D]
    device = kernel_device()
    out = torch.empty(1, 2, HEAD_DIM, device=device)
    got = launched(
        combine_splits, parts.to(device), lse.to(device), out, impl.combine_splits_kernel
    ).cpu()
    for head, lses in enumerate(lse[0].tolist()):
        error = (got[0, head] - expected[0, head]).abs().max().item()
        if not error <= TOLERANCE[torch.float32]:
            message = (
                f"combine, head {head}, split lse {lses}: max error {error:.3g}; expected "
                f"{_head(expected[0, head])}, got {_head(got[0, head])}"
            )
            raise AssertionError(lead_with_nonfinite(got, message, COMBINE_NAN_CAUSES))


def check_split_k_decode_with_your_combine(impl: ModuleType) -> None:
    """Flash-decoding with your combine: contexts of 2 and 21 tokens in 3 splits of 8"""
    case = DecodeCase.random([2, 21])
    got = run_kernel(impl, case, num_splits=3, block_n=TILE, combine=True)
    assert_close(case, got, "3 splits merged by your combine")


@dataclass(frozen=True)
class StoreCase:
    """A step's new k/v rows, their slots (-1: padding), and a pool between two guard blocks."""

    k: torch.Tensor  # [T, Hkv, D], possibly views into a wider qkv tensor
    v: torch.Tensor
    slots: tuple[int, ...]
    num_blocks: int
    block_size: int

    @classmethod
    def random(
        cls, slots: list[int], num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
        strided: bool = False, dtype: torch.dtype = torch.float32,
    ) -> StoreCase:  # fmt: skip
        gen = torch.Generator().manual_seed(len(slots) * 31 + num_blocks + head_dim)
        qkv = torch.randn(len(slots), 3 * kv_heads, head_dim, generator=gen).to(dtype)
        if strided:  # k and v are views into the projection's output, as in the model
            k, v = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
        else:
            k, v = qkv[:, :kv_heads].contiguous(), qkv[:, kv_heads : 2 * kv_heads].contiguous()
        return cls(k, v, tuple(slots), num_blocks, block_size)

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers [num_blocks + 2, block_size, Hkv, D] of known values; the pool is
        blocks 1..num_blocks, so a write outside it lands in a guard block."""
        shape = (self.num_blocks + 2, self.block_size, *self.k.shape[1:])
        gen = torch.Generator().manual_seed(self.num_blocks)
        k = torch.randn(shape, generator=gen).to(self.k.dtype)
        return k, -k

    def expected(self, buffer: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """The buffer after storing `new` at the valid slots, by plain indexing."""
        out = buffer.clone()
        pool = out[1:-1].flatten(0, 1)  # [num_blocks * block_size, Hkv, D]: row s is slot s
        for token, slot in enumerate(self.slots):
            if slot >= 0:
                pool[slot] = new[token]
        return out

    def describe(self) -> str:
        heads, dim = self.k.shape[1:]
        layout = "views into qkv" if not self.k.is_contiguous() else "contiguous"
        return (
            f"{len(self.slots)} tokens, slots {list(self.slots)}, pool of {self.num_blocks} "
            f"blocks of {self.block_size}, {heads} KV heads of {dim} dims, "
            f"{str(self.k.dtype).removeprefix('torch.')}, k and v {layout}"
        )


def assert_store(impl: ModuleType, case: StoreCase) -> None:
    """Run the kernel on the case and compare both buffers, slot by slot, with indexing."""
    device = kernel_device()
    k_start, v_start = case.buffers()
    expected = {"K": case.expected(k_start, case.k), "V": case.expected(v_start, case.v)}
    k_buffer, v_buffer = k_start.to(device), v_start.to(device)
    launched(
        paged_store, k_buffer[1:-1], v_buffer[1:-1], case.k.to(device), case.v.to(device),
        torch.tensor(case.slots, dtype=torch.int64, device=device),
        kernel=impl.paged_store_kernel,
    )  # fmt: skip
    rows_per_block = case.block_size
    for name, buffer in (("K", k_buffer), ("V", v_buffer)):
        got, want = buffer.cpu().flatten(0, 1), expected[name].flatten(0, 1)
        for row in range(got.shape[0]):
            if torch.equal(got[row], want[row]):
                continue
            slot = row - rows_per_block
            if slot < 0 or slot >= case.num_blocks * rows_per_block:
                where = "a guard row outside the pool (a padding slot of -1 stores nothing)"
            else:
                block, offset = divmod(slot, rows_per_block)
                tokens = [t for t, s in enumerate(case.slots) if s == slot]
                owner = f"token {tokens[0]}'s slot" if tokens else "a slot no token maps to"
                where = f"slot {slot} (block {block}, offset {offset}: {owner})"
            raise AssertionError(
                f"store, {case.describe()}: {name} cache at {where}: expected "
                f"{_rows(want[row])}, got {_rows(got[row])}"
            )


def _rows(rows: torch.Tensor) -> str:
    """A [Hkv, D] slot's first values, head by head."""
    return "[" + "; ".join(_head(head.float()) for head in rows[:2]) + "]"


def check_store_writes_each_token_at_its_slot(impl: ModuleType) -> None:
    """Store: 5 tokens at slots 9, 2, 3, 4 and 15 of 4 blocks of 4 (block = slot // 4)"""
    assert_store(impl, StoreCase.random([9, 2, 3, 4, 15], 4, BLOCK_SIZE, 2, HEAD_DIM))


def check_store_skips_padding_slots(impl: ModuleType) -> None:
    """Store: slots -1 (padding) store nothing; the guard rows around the pool stay as they were"""
    assert_store(impl, StoreCase.random([-1, 6, -1, 0, 11, -1], 3, BLOCK_SIZE, 2, HEAD_DIM))


def check_store_follows_strides_and_masks_heads(impl: ModuleType) -> None:
    """Store: k and v as views into a qkv tensor, 3 KV heads of 12 dims (padded to 4 and 16)"""
    case = StoreCase.random([5, 1, -1, 12], 4, BLOCK_SIZE, 3, 12, strided=True)
    assert_store(impl, case)


def check_store_in_bf16(impl: ModuleType) -> None:
    """Store: bf16 k and v into a bf16 pool, 2 tokens in blocks of 2, copied bit for bit"""
    assert_store(impl, StoreCase.random([3, 6], 4, 2, 2, HEAD_DIM, dtype=torch.bfloat16))


@st.composite
def store_cases(draw: st.DrawFn) -> StoreCase:
    """A random pool shape, 1-6 tokens at distinct slots, some of them padding."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(1, 4))
    num_tokens = draw(st.integers(1, 6))
    free = st.lists(st.integers(0, num_blocks * block_size - 1), unique=True, max_size=num_tokens)
    slots = draw(free)
    slots += [-1] * (num_tokens - len(slots))
    slots = draw(st.permutations(slots))
    kv_heads, head_dim = draw(st.integers(1, 3)), draw(st.sampled_from([2, 4, 6, 16]))
    return StoreCase.random(slots, num_blocks, block_size, kv_heads, head_dim, draw(st.booleans()))


def check_store_on_random_pools(impl: ModuleType) -> None:
    """Store, randomized: pools of 1-4 blocks of 1-8 slots, 1-6 tokens, padding, 1-3 heads"""
    assert_store(impl, StoreCase.random([2, -1], 2, 2, 1, 4))  # a stub raises here at once

    @settings(max_examples=12, deadline=None, database=None, derandomize=True,
              verbosity=Verbosity.quiet, report_multiple_bugs=False,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(store_cases())
    def store_matches_indexing(case: StoreCase) -> None:
        assert_store(impl, case)

    store_matches_indexing()


check_store_on_random_pools.time_limit_factor = 3


@dataclass(frozen=True)
class PrefillCase:
    """A step of prefill chunks: each sequence's new queries after its cached prefix."""

    decode: DecodeCase  # its pool, and metadata with each sequence's query length
    cached: tuple[int, ...]  # tokens each sequence had before this chunk
    new: tuple[int, ...]  # the chunk's query tokens

    @classmethod
    def random(
        cls, cached: list[int], new: list[int], heads: int = 2, kv_heads: int = 2,
        dtype: torch.dtype = torch.float32,
    ) -> PrefillCase:  # fmt: skip
        contexts = [c + n for c, n in zip(cached, new)]
        decode = DecodeCase.random(contexts, heads, kv_heads, dtype, new=new)
        return cls(decode, tuple(cached), tuple(new))

    def rows(self) -> list[tuple[int, int, int]]:
        """(sequence, query index in its chunk, position) of each query row."""
        return [
            (s, i, c + i) for s, (c, n) in enumerate(zip(self.cached, self.new)) for i in range(n)
        ]


def run_prefill(
    impl: ModuleType, case: PrefillCase, scale: float | None = None, block_m: int = TILE,
    block_n: int = TILE,
) -> torch.Tensor:  # fmt: skip
    """Launch the implementation's prefill kernel over every sequence: [T, Hq, D] on the CPU."""
    d, md = case.decode, case.decode.metadata
    out = torch.zeros_like(d.q)
    launched(
        paged_prefill, d.q, d.k_cache, d.v_cache, md.block_tables, md.query_start_loc[:-1],
        md.query_lens, md.context_lens, max(case.new), out, scale, block_m, block_n,
        kernel=impl.paged_prefill_kernel,
    )  # fmt: skip
    return out.float().cpu()


def assert_prefill(impl: ModuleType, case: PrefillCase, what: str, **options) -> None:
    """Compare each query row and head with the reference; name the first one off."""
    got = run_prefill(impl, case, **options)
    expected = case.decode.expected(options.get("scale"))
    tol = TOLERANCE[case.decode.q.dtype]
    for row, (seq, index, position) in enumerate(case.rows()):
        for head in range(got.shape[1]):
            error = (got[row, head] - expected[row, head]).abs().max().item()
            if not error <= tol:  # NaN fails too
                message = (
                    f"{what}: sequence {seq} ({case.cached[seq]} cached + {case.new[seq]} new "
                    f"tokens), query {index} of its chunk (position {position}, sees keys 0 to "
                    f"{position}), head {head}: max error {error:.3g} (tolerance {tol:g}); "
                    f"expected {_head(expected[row, head])}, got {_head(got[row, head])}"
                )
                causes = case.decode.nan_causes(options.get("scale"))
                raise AssertionError(lead_with_nonfinite(got, message, causes))


def check_prefill_of_whole_prompts_is_causal(impl: ModuleType) -> None:
    """Prefill: prompts of 1, 5 and 9 tokens, nothing cached; query i sees keys 0 to i"""
    assert_prefill(impl, PrefillCase.random([0, 0, 0], [1, 5, 9]), "whole prompts")


def check_prefill_chunks_after_a_cached_prefix(impl: ModuleType) -> None:
    """Prefill: chunks of 5, 1 and 4 tokens after 6, 3 and 8 cached; GQA 6 heads over 2"""
    case = PrefillCase.random([6, 3, 8], [5, 1, 4], heads=6, kv_heads=2)
    assert_prefill(impl, case, "chunks after a cached prefix")


def check_prefill_with_large_scores_and_bf16(impl: ModuleType) -> None:
    """Prefill: scale 20 (scores in the hundreds), then bf16 caches; tiles of 4 queries"""
    case = PrefillCase.random([2, 0], [7, 3])
    assert_prefill(impl, case, "softmax scale 20", scale=20.0)
    bf16 = PrefillCase.random([5, 1], [3, 6], heads=4, kv_heads=2, dtype=torch.bfloat16)
    assert_prefill(impl, bf16, "bf16 inputs")


CHECKS = [
    *FIRST_STEP_CHECKS,
    check_gather_follows_the_block_table,
    check_gather_tiles_span_blocks,
    check_one_tile_softmax_attention,
    check_one_tile_subtracts_the_max,
    check_a_context_of_one_token_returns_its_value,
    check_block_edges_and_shuffled_blocks,
    check_grouped_query_heads_share_their_kv_head,
    check_online_softmax_across_many_tiles,
    check_large_scores_do_not_overflow,
    check_split_k_respects_each_splits_range,
    check_bf16_inputs_are_upcast,
    check_combine_weighs_each_split_by_its_lse,
    check_split_k_decode_with_your_combine,
    check_store_writes_each_token_at_its_slot,
    check_store_skips_padding_slots,
    check_store_follows_strides_and_masks_heads,
    check_store_in_bf16,
    check_store_on_random_pools,
    check_prefill_of_whole_prompts_is_causal,
    check_prefill_chunks_after_a_cached_prefix,
    check_prefill_with_large_scores_and_bf16,
]

PROGRESS: dict[str, str] = {
    "2.9": "each pass of the key loop must move `first` on by BLOCK_N, from 0 up to the "
    "tile's last visible key, never past the chunk's end",
}

HINTS: dict[str, tuple[str, str, str]] = {
    **FIRST_STEP_HINTS,
    "2.4": (
        "A sequence's token t is not at row t of the pool: its block table says which "
        "physical block holds logical block t // block_size, and the token sits at offset "
        "t % block_size inside it. Tokens at or past context_len must not be read at all.",
        "Three steps for the tile's BLOCK_N tokens: a validity mask (t < context_len); a "
        "masked load of each token's physical block from the table; then one masked 2-D "
        "load of [BLOCK_N, BLOCK_D] (rows: block * stride_cb + offset * stride_cs; columns: "
        "kv_head * stride_ch + dims * stride_cd) and a masked 2-D store to row t of out.",
        "valid compares tokens with context_len; blocks is a tl.load at block_table_ptr "
        "plus each token's logical block, masked by valid (other=0); the row offset is the "
        "block (cast to tl.int64) times stride_cb plus the offset inside it times stride_cs; "
        "add rows[:, None] and the column offsets to cache_ptr for one 2-D tl.load, then "
        "tl.store it at out_ptr + tokens[:, None] * stride_ot + dims[None, :], both masked by "
        "valid[:, None] & (dims < head_dim)[None, :].",
    ),
    "2.5": (
        "Attention for one query is softmax(scale * K q) V. The whole context fits one tile, "
        "so gather K and V exactly as in 2.4 and take an ordinary softmax, with two guards: "
        "slots past the context get score -inf (weight 0), and the max is subtracted before "
        "exp so large scores do not overflow.",
        "Gather K and V [BLOCK_N, BLOCK_D] with other=0.0 and convert them to fp32; scores "
        "[BLOCK_N] = the sum over dims of q[None, :] * k, times scale; tl.where(valid, "
        "scores, -inf); p = exp(scores - max); out [BLOCK_D] = sum over tokens of p[:, None] "
        "* v, divided by the sum of p.",
        "scores: tl.sum over axis 1 of the broadcast product of q and k, times scale; then "
        "tl.where(valid, scores, -inf); p: tl.exp of the scores minus their tl.max over "
        "axis 0; out: tl.sum over axis 0 of p[:, None] times v, divided by p's total.",
    ),
    "2.6": (
        "The context no longer fits one tile: walk it BLOCK_N tokens at a time and keep an "
        "online softmax per query head, the running max m, the running sum l of exp2(score "
        "- m) and the running weighted sum of values acc. When a tile raises the max, what "
        "was summed under the old max is rescaled by exp2(m_old - m_new).",
        "Start m at -inf, l and acc at 0. For first in range(start, end, BLOCK_N): gather "
        "the tile's K and V as in 2.4 (valid = tokens < end); scores [BLOCK_G, BLOCK_N] = "
        "tl.dot(q, tl.trans(k)) with input_precision=PRECISION, -inf where not valid; "
        "m_new = max(m, row max); alpha = exp2(m - m_new); p = exp2(scores - m_new[:, None]); "
        "update l and acc with alpha, then m = m_new.",
        "l: the old l times alpha, plus p's row sums (tl.sum over axis 1); acc: the old acc "
        "times alpha[:, None], plus tl.dot of p with the fp32 v (input_precision=PRECISION). "
        "q is already multiplied by scale * log2(e), so use tl.exp2, never tl.exp; convert "
        "k and v to fp32 right after loading.",
    ),
    "2.7": (
        "Each split wrote its own normalised output and lse = log2 of its softmax "
        "denominator. The whole softmax's denominator is the sum of 2^lse_i, so the merged "
        "output is the average of the parts weighted by 2^lse_i. An empty split has lse = "
        "-inf and weight 0.",
        "Load lse [BLOCK_SPLITS] masked by splits < num_splits with other=-inf; weights = "
        "exp2(lse - the largest lse) (no overflow, and the empty splits give exp2(-inf) = "
        "0); load the parts [BLOCK_SPLITS, BLOCK_D] masked (other=0.0); out = sum of "
        "weights[:, None] * parts over the splits, divided by the sum of the weights.",
        "weights: tl.exp2 of lse minus tl.max(lse, axis=0); a part's address adds, to "
        "part_ptr, the sequence's and the head's offsets (their strides), the split index "
        "(a column, times the split stride) and the dims (a row); load with the 2-D mask "
        "and other=0.0; out: tl.sum over axis 0 of the weighted parts, over tl.sum of the "
        "weights.",
    ),
    "2.8": (
        "Slot s of the pool is offset s % block_size inside physical block s // block_size; "
        "the scheduler already chose each token's slot through its block table. Each "
        "program copies one token's [Hkv, D] rows of K and of V there, and a padding "
        "token (slot < 0) must store nothing at all.",
        "Load this token's slot (as int64); build one [BLOCK_H, BLOCK_D] mask from the "
        "heads, the dims and the slot's sign; compute the destination offset from the "
        "block, the offset inside it, the heads and the dims with the cache's four "
        "strides; load the token's K and V rows with their own strides, masked; store both, "
        "converted to the cache's element type, under the same mask.",
        "the mask combines heads < num_kv_heads, dims < head_dim and slot >= 0; the "
        "destination adds (slot // block_size) times stride_cb, (slot % block_size) times "
        "stride_cs, heads times stride_ch and dims times stride_cd; the source adds token "
        "times stride_kt, heads times stride_kh and dims times stride_kd (the same for v "
        "with its strides); .to(k_cache_ptr.dtype.element_ty) before tl.store.",
    ),
    "2.9": (
        "A prefill chunk is many queries at once, at positions prefix, prefix + 1, ...: the "
        "same online softmax as 2.6, one running max, sum and weighted values per query row, "
        "plus the causal rule: a row sees the keys up to its own position, never the ones "
        "after it.",
        "Load the queries like 2.6 does, one row per query token of the tile (row "
        "query_start + rows of q), then scale them. The keys to walk end at the tile's last "
        "valid query position plus one (prefix plus "
        "the smaller of the tile's end and query_len), or at 0 for a tile wholly past the "
        "chunk. The KV head is head // GROUP. In the loop: the keys' validity, their blocks "
        "from the table, masked K and V loads, the tl.dot scores, then -inf where the key is "
        "invalid or past the row's position, then the update of 2.6 with exp2.",
        "visible is key_valid[None, :] combined with keys[None, :] <= positions[:, None]; "
        "the K and V offsets add, to the block (as tl.int64) times stride_cb and the offset "
        "in the block times stride_cs, the KV head times stride_ch and the dims times "
        "stride_cd; start m at -inf and l, acc at 0 with shapes [BLOCK_M] and [BLOCK_M, "
        "BLOCK_D].",
    ),
}
