"""Warm-up: the step shapes a server meets run once at start, and leave nothing behind.

On a GPU the engine runs it to compile the Triton kernels before the first request; here
the same steps run through the Triton backend in the interpreter.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.attention.triton_decode import decode_variant, split_plan
from minserve.engine import observe_steps
from minserve.worker.warmup import decode_variants, warm_up, warm_up_steps


def test_warm_up_runs_prefill_extend_and_decodes_and_changes_no_output(tiny_model) -> None:
    model = tiny_model("llama")
    options = dict(num_blocks=48, block_size=16, attention_backend="triton")
    plain, warmed = LLM(model, **options), LLM(model, **options)
    prompts = [list(range(100, 140)), list(range(7, 30))]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    free = warmed.engine.kv.allocator.num_free
    with observe_steps(warmed.engine) as records:
        seconds = warm_up(warmed.engine.worker, max_num_batched_tokens=512)
    assert seconds > 0 and records == []  # the worker's own steps: the engine saw none
    assert warmed.engine.kv.allocator.num_free == free  # no block was taken
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in warmed.generate(prompts, greedy, use_tqdm=False)]
    assert got == expected


def test_warm_up_steps_cover_every_kernel_path(tiny_model, monkeypatch) -> None:
    """A prefill with no context, an extend over context, and decodes (one long context)."""
    llm = LLM(tiny_model("llama"), num_blocks=48, block_size=16, attention_backend="triton")
    seen = []
    execute = llm.engine.worker.execute
    monkeypatch.setattr(llm.engine.worker, "execute", lambda out: seen.append(out) or execute(out))
    warm_up(llm.engine.worker, max_num_batched_tokens=512)
    shapes = [[(c.start, c.num_new_tokens) for c in out.chunks] for out in seen]
    # prefill, extend, mixed (decode rows first); on a CPU one decode variant: one pass
    assert shapes == [[(0, 192)], [(192, 96)], [(1, 1), (0, 192)], [(1, 1)]]


def simulated_h100(gpus, monkeypatch) -> torch.device:
    gpus(1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(multi_processor_count=132))  # fmt: skip
    return torch.device("cuda", 0)


@pytest.mark.parametrize("num_kv_heads", [1, 3, 8])
def test_warm_up_plans_every_decode_variant_real_steps_can_choose(
    gpus, monkeypatch, num_kv_heads: int
) -> None:
    """Every step of 1..max_num_batched_tokens decodes, at every context the pool holds,
    picks a variant (split count -> kernels compiled) that the warm-up runs: none is left
    to compile inside a request, and the warm-up runs none that cannot occur."""
    device = simulated_h100(gpus, monkeypatch)
    max_num_batched_tokens, pool_tokens = 48, 9000
    planned = decode_variants(num_kv_heads, pool_tokens, device)
    chosen = {
        decode_variant(split_plan(num_seqs, num_kv_heads, context, device)[0])
        for num_seqs in range(1, max_num_batched_tokens + 1)
        for context in range(1, pool_tokens + 1)
    }
    assert set(planned) == chosen
    for variant, context in planned.items():  # each planned context picks its variant
        assert decode_variant(split_plan(1, num_kv_heads, context, device)[0]) == variant


def test_an_h100_sized_pool_warms_every_split_bucket(gpus, monkeypatch) -> None:
    device = simulated_h100(gpus, monkeypatch)
    planned = decode_variants(num_kv_heads=3, max_context=1 << 20, device=device)  # SmolLM2
    assert planned == {1: 2, 2: 512, 4: 768, 8: 1280, 16: 2304, 32: 4352, 64: 8448}
    steps = warm_up_steps(16, (1 << 20) // 16, 512, planned)
    decodes = [chunks[0].start + 1 for chunks in steps[3:]]
    assert decodes == sorted(planned.values())  # one decode step per variant


def test_the_varying_integers_compile_one_variant() -> None:
    """Triton specialises integers on == 1 and % 16; these change from step to step."""
    from minserve.attention.triton_decode import combine_splits_kernel, paged_decode_kernel
    from minserve.attention.triton_env import compile_for_any
    from minserve.attention.triton_prefill import paged_prefill_kernel

    def unspecialised(kernel) -> set[str]:
        names = kernel.kwargs["do_not_specialize"] if hasattr(kernel, "kwargs") else [
            p.name for p in kernel.params if p.do_not_specialize]  # fmt: skip
        return set(names)

    assert {"stride_bs", "stride_lh"} <= unspecialised(paged_decode_kernel)
    assert {"num_splits", "stride_ph"} <= unspecialised(combine_splits_kernel)
    assert unspecialised(paged_prefill_kernel) == {"stride_bs"}
    with pytest.raises(ValueError, match="paged_prefill_kernel has no argument.*num_seqs"):
        compile_for_any(paged_prefill_kernel, "num_seqs")
