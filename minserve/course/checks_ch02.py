"""Checks for chapter 02 (paged attention), run against any module that defines
`paged_decode_kernel`: minserve's own, the solutions, or a student's exercise file.

Each check builds a small paged KV pool (blocks of 4 tokens, handed out in shuffled order,
every other slot filled with NaN: a kernel that reads one slot past a context returns NaN),
launches the kernel under test through minserve's launcher `paged_decode(kernel=...)`, and
compares it with the plain-torch reference `paged_attention_reference`. A mismatch names
the sequence, its context length, the query head and the largest error. The tensors live
where the kernel runs: the CPU in Triton's interpreter, the GPU when Triton compiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from triton.runtime.errors import InterpreterError

from minserve.attention.metadata import AttentionMetadata
from minserve.attention.paged_torch import paged_attention_reference
from minserve.attention.triton_decode import paged_decode
from minserve.attention.triton_env import interpreting

BLOCK_SIZE = 4
HEAD_DIM = 16
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
NAN_HINT = (
    ". NaN: the kernel read a slot outside the context (the pool holds NaN there); "
    "mask every load with the tokens' validity"
)


@dataclass(frozen=True)
class DecodeCase:
    """A decode step: one query token per sequence over its paged context."""

    q: torch.Tensor  # [S, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, Hkv, D], NaN outside every context
    v_cache: torch.Tensor
    metadata: AttentionMetadata

    @classmethod
    def random(
        cls, contexts: list[int], heads: int = 2, kv_heads: int = 2, dtype=torch.float32
    ) -> DecodeCase:
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
            query_lens=[1] * len(contexts),
            context_lens=contexts,
            block_tables=tables,
            slot_mapping=[t[(c - 1) // BLOCK_SIZE] * BLOCK_SIZE + (c - 1) % BLOCK_SIZE
                          for t, c in zip(tables, contexts)],
            device=device,
        )  # fmt: skip
        q = torch.randn(len(contexts), heads, HEAD_DIM, generator=gen)
        return cls(*(t.to(device, dtype) for t in (q, k_cache, v_cache)), metadata)

    def expected(self, scale: float | None = None) -> torch.Tensor:
        """The reference, on the same pool with its NaNs zeroed (it reads whole blocks)."""
        k, v = self.k_cache.nan_to_num(0.0), self.v_cache.nan_to_num(0.0)
        return paged_attention_reference(self.q, k, v, self.metadata, scale).float().cpu()


def run_kernel(impl: ModuleType, case: DecodeCase, **options) -> torch.Tensor:
    """Launch the implementation's kernel; an error inside it is re-raised as itself."""
    md = case.metadata
    try:
        out = paged_decode(
            case.q, case.k_cache, case.v_cache, md.block_tables, md.context_lens,
            md.max_context_len, kernel=impl.paged_decode_kernel, **options,
        )  # fmt: skip
    except InterpreterError as error:  # the interpreter wraps what the kernel raised
        raise (error.__cause__ or error) from None
    return out.float().cpu()


def kernel_device() -> torch.device:
    """Where Triton kernels run here: the CPU in the interpreter, else the GPU."""
    return torch.device("cpu") if interpreting() else torch.device("cuda")


def assert_close(case: DecodeCase, got: torch.Tensor, what: str, scale: float | None = None):
    """Compare per (sequence, head) and name the first pair that is off."""
    expected = case.expected(scale)
    tol = TOLERANCE[case.q.dtype]
    contexts = case.metadata.context_lens.tolist()
    for seq, head in torch.cartesian_prod(
        torch.arange(got.shape[0]), torch.arange(got.shape[1])
    ).tolist():
        error = (got[seq, head] - expected[seq, head]).abs().max().item()
        if not error <= tol:  # NaN fails too
            tokens = f"{contexts[seq]} token" + ("s" if contexts[seq] > 1 else "")
            hint = NAN_HINT if got[seq, head].isnan().any() else ""
            raise AssertionError(
                f"{what}: sequence {seq} (context of {tokens}), query head {head}: max "
                f"error {error:.3g} (tolerance {tol:g}); expected "
                f"{_head(expected[seq, head])}, got {_head(got[seq, head])}{hint}"
            )


def _head(row: torch.Tensor) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in row[:4].tolist()) + ", ...]"


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
    assert_close(case, run_kernel(impl, case, block_n=4), "37 tokens in tiles of 4")


def check_large_scores_do_not_overflow(impl: ModuleType) -> None:
    """Scale 20: scores in the hundreds, whose exp overflows unless the max is subtracted."""
    case = DecodeCase.random([5, 13])
    got = run_kernel(impl, case, scale=20.0, block_n=4)
    assert_close(case, got, "softmax scale 20", scale=20.0)


def check_split_k_respects_each_splits_range(impl: ModuleType) -> None:
    """Flash-decoding: 3 splits of 8 tokens (start..end); the short sequence's are empty."""
    case = DecodeCase.random([2, 21])
    got = run_kernel(impl, case, num_splits=3, block_n=4)
    assert_close(case, got, "3 splits of 8 tokens")


def check_bf16_inputs_are_upcast(impl: ModuleType) -> None:
    """bf16 caches: load, convert to fp32, compute (tl.dot and exp2 in fp32)."""
    case = DecodeCase.random([3, 9], heads=4, kv_heads=2, dtype=torch.bfloat16)
    assert_close(case, run_kernel(impl, case), "bf16 inputs")


CHECKS = [
    check_a_context_of_one_token_returns_its_value,
    check_block_edges_and_shuffled_blocks,
    check_grouped_query_heads_share_their_kv_head,
    check_online_softmax_across_many_tiles,
    check_large_scores_do_not_overflow,
    check_split_k_respects_each_splits_range,
    check_bf16_inputs_are_upcast,
]
