"""Store in Triton: write a step's new keys and values into the paged pool by slot.

Slot s is offset s % block_size of physical block s // block_size (the scheduler chose it
through the sequence's block table). One program copies one token's [Hkv, D] rows of K and
V; a negative slot means "padding, store nothing" (as in vLLM's reshape_and_cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minserve.attention import triton_env  # noqa: F401  (TRITON_INTERPRET on a CPU)


# >>> exercise 2.8: store the step's keys and values by slot
@triton.jit
def paged_store_kernel(
    k_ptr,  # [T, Hkv, D]: the step's new keys
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # the same strides as k_cache
    slot_mapping_ptr,  # [T] int64
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,  # num_kv_heads padded to a power of two
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
):  # fmt: skip
    """Copy token `program_id(0)`'s K and V rows [Hkv, D] to its slot of both caches.

    Read the token's slot from `slot_mapping`; a negative slot is padding: store nothing
    (mask every load and store with it, never branch). Slot s is offset s % block_size of
    block s // block_size; do the slot arithmetic in int64 (a large pool overflows int32).
    Mask the heads and dims past `num_kv_heads` and `head_dim` (BLOCK_H and BLOCK_D are
    padded to powers of two), follow every tensor's own strides (k and v may be views
    into a wider qkv tensor) and convert to the cache's dtype before storing.
    """
    token = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # >>> solution
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    mask = (heads < num_kv_heads) & (dims < head_dim) & (slot >= 0)  # [BLOCK_H, BLOCK_D]
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    dst += heads * stride_ch + dims * stride_cd
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    # <<< solution


# <<< exercise


def paged_store(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    kernel: triton.JITFunction = paged_store_kernel,
) -> None:
    """Write k, v [T, Hkv, D] into the caches [num_blocks, block_size, Hkv, D] at their slots.

    The same contract as `paged_store_reference`, its plain-torch oracle, except that a
    negative slot (padding) stores nothing. `kernel` may be any kernel with
    `paged_store_kernel`'s signature (chapter 02's exercise 2.8).
    """
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"new keys {tuple(k.shape)} and values {tuple(v.shape)} must both be "
            f"[tokens, {k_cache.shape[2]}, {k_cache.shape[3]}] to fit the cache"
        )
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"{k.shape[0]} new tokens but {slot_mapping.shape[0]} slots; need one slot per token"
        )
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(),
        k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
