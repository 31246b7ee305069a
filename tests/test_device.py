"""Which device runs the engine, and why; one GPU per process, never a wrapped-around one.

The machine's CUDA state is simulated (torch's build, driver and device count), so the
choices a GPU machine makes are checked on a CPU.
"""

from __future__ import annotations

import pytest
import torch

from minserve.device import choose_device, rank_device, use_device
from minserve.execution import resolve_execution


def test_auto_takes_the_gpu_and_says_which(gpus) -> None:
    gpus(2)
    choice = choose_device("auto")
    assert choice.device == torch.device("cuda", 0)
    assert choice.why == "auto: GPU 0 of 2 (Test GPU 0)"
    assert choose_device("cuda:1").why == "as asked: GPU 1 of 2 (Test GPU 1)"


def test_auto_falls_back_to_the_cpu_and_says_why(gpus) -> None:
    gpus(0, cuda_build=None)
    assert choose_device("auto").why == "auto: this torch build has no CUDA support"
    gpus(0)  # a CUDA build, but no device: e.g. a driver too old for it
    choice = choose_device("auto")
    assert choice.device == torch.device("cpu")
    assert "driver too old for this torch's CUDA 12.8" in choice.why
    config = resolve_execution("auto", environ={})
    assert config.device_why == choice.why and f"device=cpu({choice.why})" in config.summary()


def test_an_explicit_gpu_that_cannot_run_is_an_error_naming_why(gpus) -> None:
    gpus(0)
    with pytest.raises(ValueError, match=r"device='cuda' cannot be used: no CUDA device"):
        choose_device("cuda")
    gpus(2)
    with pytest.raises(ValueError, match=r"device='cuda:2' needs GPU 2, but this machine has 2"):
        choose_device("cuda:2")


def test_each_rank_gets_its_own_gpu_and_never_wraps_around(gpus) -> None:
    gpus(2)
    assert [rank_device("cuda", r) for r in (0, 1)] == [torch.device("cuda", i) for i in (0, 1)]
    with pytest.raises(
        ValueError, match="tensor-parallel rank 2 needs GPU 2, but this machine has 2"
    ):
        rank_device("cuda", 2)  # it used to share GPU 0 with rank 0, which NCCL refuses
    assert rank_device("auto", 5, local_rank=1) == torch.device("cuda", 1)  # torchrun, node 3
    assert rank_device("cpu", 5) == torch.device("cpu")


def test_use_device_makes_the_gpu_current(gpus) -> None:
    cuda = gpus(2)
    use_device(torch.device("cpu"))
    use_device(torch.device("cuda", 1))
    assert cuda.calls == [torch.device("cuda", 1)] and torch.cuda.current_device() == 1


@pytest.mark.parametrize("asked", ["auto", "cuda", "cuda:1"])
def test_the_chosen_gpu_carries_an_index_that_set_device_accepts(gpus, asked) -> None:
    """What the loader does (`use_device(execution.device)`): a bare "cuda" used to crash it."""
    gpus(2)
    execution = resolve_execution(asked, environ={})
    expected = 1 if asked == "cuda:1" else 0
    assert execution.device == torch.device("cuda", expected)
    use_device(execution.device)
    assert torch.cuda.current_device() == expected


def test_a_bare_cuda_is_the_gpu_this_process_made_current(gpus) -> None:
    """A P/D instance sets its own GPU first; its LLM(device="cuda") must stay on it."""
    gpus(2)
    torch.cuda.set_device(1)
    assert choose_device("cuda").device == torch.device("cuda", 1)
    assert choose_device("auto").why == "auto: GPU 1 of 2 (Test GPU 1)"


def test_the_stand_in_refuses_what_real_set_device_refuses(gpus) -> None:
    gpus(2)
    with pytest.raises(ValueError, match="Expected a torch.device with a specified index"):
        torch.cuda.set_device(torch.device("cuda"))
    with pytest.raises(ValueError, match="Expected a cuda device, but got: cpu"):
        torch.cuda.set_device("cpu")
    with pytest.raises(torch.AcceleratorError, match="invalid device ordinal"):
        torch.cuda.set_device(2)
    torch.cuda.set_device(-1)  # real torch: a no-op
    assert torch.cuda.current_device() == 0


def test_decode_splits_follow_the_gpu_the_tensors_are_on(gpus, monkeypatch) -> None:
    """Flash-decoding fills the SMs of the query's GPU (not always GPU 0's); none on a CPU."""
    from types import SimpleNamespace

    from minserve.attention.triton_decode import choose_num_splits

    gpus(2)
    sms = {0: 132, 1: 16}
    monkeypatch.setattr(
        torch.cuda, "get_device_properties",
        lambda d: SimpleNamespace(multi_processor_count=sms[torch.device(d).index]),
    )  # fmt: skip
    assert choose_num_splits(2, 4, 8192, torch.device("cuda", 0)) == 32  # 264/8, at most 8192/256
    assert choose_num_splits(2, 4, 8192, torch.device("cuda", 1)) == 4  # ceil(32 / 8)
    assert choose_num_splits(2, 4, 8192, torch.device("cpu")) == 1


def test_seeded_rows_draw_on_their_cpu_generator_for_any_device(monkeypatch) -> None:
    """CUDA refuses a CPU generator for a draw on the GPU; emulate that check on `meta`."""
    from minserve.model.sampler import SamplingRow, row_uniforms
    from minserve.request import seeded_generator
    from minserve.sampling_params import SamplingParams

    real_rand = torch.rand

    def strict_rand(*size, generator=None, device=None, **options):
        if generator is not None and torch.device(device or "cpu") != generator.device:
            raise RuntimeError("Expected a generator on the device it draws on")
        return real_rand(*size, generator=generator, device=device, **options)

    rows = [
        SamplingRow(SamplingParams(seed=seed), [1], [], seeded_generator(seed), ())
        for seed in (7, None, 8)
    ]
    on_cpu = row_uniforms(rows, torch.device("cpu"))
    rows = [replace_generator(row) for row in rows]
    monkeypatch.setattr(torch, "rand", strict_rand)
    elsewhere = row_uniforms(rows, torch.device("meta"))  # a device other than the CPU
    assert elsewhere.device.type == "meta" and elsewhere.shape == (3,)
    monkeypatch.setattr(torch, "rand", real_rand)
    again = row_uniforms([replace_generator(row) for row in rows], torch.device("cpu"))
    assert again[0] == on_cpu[0] and again[2] == on_cpu[2]  # a seed draws the same stream


def replace_generator(row):
    from dataclasses import replace

    from minserve.request import seeded_generator

    if row.generator is None:
        return row
    return replace(row, generator=seeded_generator(row.params.seed))
