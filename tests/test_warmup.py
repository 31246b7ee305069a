"""Warm-up: the step shapes a server meets run once at start, and leave nothing behind.

On a GPU the engine runs it to compile the Triton kernels before the first request; here
the same steps run through the Triton backend in the interpreter.
"""

from __future__ import annotations

from minserve import LLM, SamplingParams
from minserve.engine import observe_steps
from minserve.worker.warmup import warm_up


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
    assert shapes == [[(0, 192)], [(192, 96)], [(1, 1), (383, 1)]]
