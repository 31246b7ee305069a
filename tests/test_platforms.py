"""Platforms (`minserve/platforms/`): each decides once, at load, what the layers compute
with, which kernel each linear runs and which runner runs the step; the CUDA runner's
staged inputs are the plain runner's values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minserve.execution import resolve_execution
from minserve.kernels.linear_kernels import KernelLinear, LinearPlan
from minserve.llm import LLM
from minserve.loader import load_model
from minserve.messages import ScheduledChunk
from minserve.model.ops import MODEL_OPS
from minserve.model.quantized_linear import QuantizedLinear
from minserve.model.runner import ModelRunner
from minserve.platforms.cpu.ops import C_KERNEL_OPS
from minserve.platforms.cpu.platform import panels_win
from minserve.platforms.cpu.runner import CpuModelRunner
from minserve.platforms.cuda.platform import CudaPlatform, set_up_cuda
from minserve.platforms.cuda.runner import CudaModelRunner
from minserve.platforms.cuda.staging import ALIGN, PinnedStaging
from minserve.plugins import CoursePlugins


def test_a_cpu_model_is_set_up_once_and_says_so(tiny_model) -> None:
    llm = LLM(tiny_model("llama"))
    config = llm.get_execution_config()
    assert config.platform == "cpu" and config.ops == "c-kernels"
    assert "platform=cpu" in config.summary() and "ops=c-kernels" in config.summary()
    assert llm.loaded.model.ops is C_KERNEL_OPS
    assert isinstance(llm.engine.worker.runner, CpuModelRunner)


def test_a_students_ops_replace_the_platforms_and_leave_with_the_llm(tiny_model) -> None:
    base = LLM(tiny_model("llama"))
    student = LLM(
        base.loaded, plugins=CoursePlugins(model_ops=MODEL_OPS)
    )  # as chapter 00 plugs its module in
    assert base.loaded.model.ops is MODEL_OPS
    LLM(base.loaded)  # the next LLM on the model without ops: the platform's again
    assert base.loaded.model.ops is C_KERNEL_OPS
    del student


@pytest.mark.parametrize(
    ("cpu_bf16", "panels"), [("AVX512-BF16", True), ("AMX-BF16", False), (None, False)]
)
def test_panels_are_chosen_only_where_they_beat_onednn(cpu_bf16: str | None, panels: bool) -> None:
    assert panels_win(cpu_bf16) is panels


def test_the_cuda_platform_gives_quantized_layers_the_triton_product(smollm_gguf) -> None:
    """Set up on a CPU model (Triton interprets): every row count takes the kernel that
    widens the blocks inside the product, equal to the layer's own torch reference."""
    loaded = load_model(smollm_gguf, quantization="gguf", device="cpu")
    execution = resolve_execution("cpu")
    execution, platform = set_up_cuda(loaded.model, execution)
    assert isinstance(platform, CudaPlatform) and execution.ops == "torch"
    assert loaded.model.ops is MODEL_OPS
    layer = loaded.model.model.layers[0].self_attn.o_proj
    assert isinstance(layer, QuantizedLinear)
    kernel = layer.kernel(3)
    assert kernel is not None and kernel.kind == f"{layer.quant} triton"
    assert layer.kernel(1000) is kernel  # one kernel for every row count
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = layer(x)
        want = F.linear(x, layer.widened(torch.float32))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_linear_plan_picks_by_row_count() -> None:
    few = KernelLinear("rows", torch.zeros(4, 4), 4, 4)
    many = KernelLinear("Q4_1 widen", torch.zeros(4, 20, dtype=torch.uint8), 4, 32)
    plan = LinearPlan(few, 8, many)
    assert plan.kernel(1) is few and plan.kernel(8) is few and plan.kernel(9) is many
    assert LinearPlan(few, 8).kernel(9) is None  # the layer's own torch code
    with pytest.raises(ValueError, match="no linear kernel 'Q5_K rows'"):
        KernelLinear("Q5_K rows", torch.zeros(1), 4, 4)


# --- the CUDA runner's staged step inputs ----------------------------------------------------


def test_staging_hands_out_aligned_regions_that_never_overlap_within_a_step() -> None:
    staging = PinnedStaging(torch.device("cpu"), pinned=False, size=256)
    first = staging.to_device(torch.arange(5, dtype=torch.int64))  # 40 bytes
    second = staging.to_device(torch.arange(3, dtype=torch.int32))
    assert first.tolist() == [0, 1, 2, 3, 4] and second.tolist() == [0, 1, 2]
    assert (second.data_ptr() - staging.arena.data_ptr()) % ALIGN == 0
    assert second.data_ptr() >= first.data_ptr() + 40
    big = staging.to_device(torch.arange(100, dtype=torch.int64))  # outgrows the arena
    assert big.tolist() == list(range(100)) and first.tolist() == [0, 1, 2, 3, 4]
    assert len(staging.retired) == 1  # the old arena lives until the step is over
    staging.reset()
    assert staging.retired == [] and staging.used == 0


def test_the_cuda_runner_prepares_what_the_plain_runner_prepares(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), attention_backend="torch", num_blocks=16)
    worker = llm.engine.worker
    plain = ModelRunner(worker.model, worker.pool, worker.runner.backend)
    staged = CudaModelRunner(worker.model, worker.pool, worker.runner.backend, pinned=False)
    chunks = [
        ScheduledChunk(0, "a", (5, 6, 7), 0, (3,)),
        ScheduledChunk(1, "b", (9,), 20, (1, 2)),
    ]
    for _ in range(2):  # a second step reuses the arena from its start
        want, got = plain.prepare(chunks), staged.prepare(chunks)
        for name in ("input_ids", "positions", "sample_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
            assert getattr(got, name).dtype == getattr(want, name).dtype, name
        for name in ("slot_mapping", "query_start_loc", "context_lens", "block_tables"):
            assert torch.equal(getattr(got.metadata, name), getattr(want.metadata, name)), name
    assert staged.staging.used > 0
