"""The execution config (`minserve/execution.py`): every path resolved once at load from the
arguments, the machine and the environment, logged in one line, returned by the LLM; the C
kernels off give the same greedy tokens as on."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minserve
from minserve import environment, execution
from minserve.device import native_bf16
from minserve.execution import ExecutionConfig, resolve_execution
from minserve.kernels import cpu_ops
from minserve.kernels.build import cache_dir, cpu_kernels
from minserve.kernels.onednn import can_prepack
from minserve.llm import LLM
from minserve.model.ops import MODEL_OPS
from minserve.platforms.cpu.ops import C_KERNEL_OPS as C_KERNEL_OPS_VALUE
from minserve.platforms.cpu.packed_linear import PackedLinear
from minserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.float32) or cpu_kernels() is None,
    reason="oneDNN or the C kernels are not available",
)
DEFAULT_CACHE = Path.home() / ".cache" / "minserve" / "kernels"
C_KERNEL_OPS = ("rms_norm", "rope", "silu_mul", "linear_rows", "bf16_logits")


def rows_limit(layer: PackedLinear) -> int:
    """Up to how many rows the layer's plan sends to the few-row kernel."""
    return layer.plan.few_rows if layer.plan.few is not None else 0


def cpu(**environ: str) -> ExecutionConfig:
    """The CPU's config under `environ`, "auto" held at fp32 (as every test holds it) unless
    environ says otherwise."""
    return resolve_execution("cpu", environ={"MINSERVE_CPU_BF16": "0", **environ})


# --- resolution -----------------------------------------------------------------------------


def test_the_defaults_on_a_cpu_are_every_c_path() -> None:
    config = cpu()
    assert (config.device, config.dtype, config.attention) == (
        torch.device("cpu"), torch.float32, "cpu",
    )  # fmt: skip
    assert config.c_kernels and config.prepack and config.greedy_screen
    assert config.linear_rows == "measured" and config.kernel_cache == DEFAULT_CACHE
    assert config.c_kernels_missing is None


@pytest.mark.parametrize(
    ("flags", "feature"),
    [
        ("flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni", "AVX512-BF16"),
        ("flags\t\t: fpu avx512_bf16 amx_bf16 amx_tile", "AMX-BF16"),
        ("flags\t\t: fpu avx2 avx512f avx512_vnni", None),  # AVX-512 without bf16
        ("", None),  # unknown: no claim
    ],
)
def test_native_bfloat16_is_read_from_the_cpu_flags(flags: str, feature: str | None) -> None:
    assert native_bf16(flags) == feature


def test_auto_is_bfloat16_on_a_cpu_that_multiplies_it_natively(monkeypatch) -> None:
    monkeypatch.setattr(execution, "native_bf16", lambda: "AVX512-BF16")
    config = resolve_execution("cpu", environ={})
    if not can_prepack(torch.device("cpu"), torch.bfloat16):
        assert config.dtype == torch.float32  # oneDNN could not serve it
        assert config.dtype_why == "auto: oneDNN cannot pack bfloat16 weights here"
        return
    assert (config.dtype, config.dtype_why) == (torch.bfloat16, "auto: the CPU has AVX512-BF16")
    assert " dtype=bfloat16(auto: the CPU has AVX512-BF16) " in config.summary()
    assert config.kv_format.storage_dtype == torch.bfloat16 and config.linear_rows == "measured"
    held = {"MINSERVE_CPU_BF16": "0"}, {"MINSERVE_C_KERNELS": "0"}
    whys = [resolve_execution("cpu", environ=env).dtype_why for env in held]
    assert whys == ["auto: MINSERVE_CPU_BF16=0", "auto: the C kernels that serve bfloat16 are off"]
    asked = resolve_execution("cpu", "float32", environ={})
    assert (asked.dtype, asked.dtype_why) == (torch.float32, "as asked")


def test_auto_is_float32_on_a_cpu_without_native_bfloat16(monkeypatch) -> None:
    monkeypatch.setattr(execution, "native_bf16", lambda: None)
    config = resolve_execution("cpu", environ={})
    assert config.dtype == torch.float32 and config.greedy_screen
    assert config.dtype_why == "auto: no native bfloat16 on this CPU (AVX512-BF16 or AMX)"


def test_auto_means_the_gpu_where_there_is_one() -> None:
    config = resolve_execution(environ={})
    assert config.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_gpu_gets_triton_bfloat16_and_no_c_paths(gpus) -> None:
    gpus(1)  # a simulated GPU: resolving touches no device
    config = resolve_execution("cuda", environ={})
    assert (config.dtype, config.attention) == (torch.bfloat16, "triton")
    assert config.dtype_why == "auto: a GPU"
    assert not (config.c_kernels or config.prepack or config.greedy_screen)
    assert config.linear_rows == 0


def test_arguments_choose_dtype_backend_and_prepacking() -> None:
    assert resolve_execution("cpu", attention="torch", environ={}).attention == "torch"
    bf16 = resolve_execution("cpu", "bfloat16", environ={})
    assert bf16.dtype == torch.bfloat16 and bf16.attention == "cpu"  # as "auto" always chose
    assert bf16.linear_rows == ("measured" if bf16.prepack else 0)  # bf16 weights streamed
    assert not bf16.greedy_screen  # the screen serves fp32 heads only
    plain = resolve_execution("cpu", prepack=False, environ={})
    assert not plain.prepack and plain.linear_rows == 0 and not plain.greedy_screen
    assert plain.c_kernels and plain.attention == "cpu"


def test_the_environment_switches_the_c_kernels_off() -> None:
    config = cpu(MINSERVE_C_KERNELS="0")
    assert not config.c_kernels and config.c_kernels_missing is None
    assert config.attention == "torch" and config.linear_rows == 0 and not config.greedy_screen
    explicit = resolve_execution("cpu", attention="cpu", environ={"MINSERVE_C_KERNELS": "0"})
    assert explicit.attention == "cpu"  # a backend asked for by name is kept


@pytest.mark.parametrize(
    ("environ", "field", "value"),
    [
        ({"MINSERVE_KERNEL_ROWS": "8"}, "linear_rows", 8),
        ({"MINSERVE_KERNEL_ROWS": "0"}, "linear_rows", 0),
        ({"MINSERVE_KERNEL_ROWS": "measured"}, "linear_rows", "measured"),
        ({"MINSERVE_KERNEL_ROWS": ""}, "linear_rows", "measured"),  # empty: unset
        ({"MINSERVE_GREEDY_SCREEN": "0"}, "greedy_screen", False),
        ({"MINSERVE_GREEDY_SCREEN": "1"}, "greedy_screen", True),
        ({"MINSERVE_C_KERNELS": "1"}, "c_kernels", True),
        ({"MINSERVE_KERNEL_CACHE": "/tmp/kernels"}, "kernel_cache", Path("/tmp/kernels")),
    ],
)
def test_each_variable_sets_its_field(environ: dict[str, str], field: str, value: object) -> None:
    assert getattr(cpu(**environ), field) == value


def test_the_process_environment_is_read_when_none_is_given(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MINSERVE_KERNEL_ROWS", "4")
    monkeypatch.setenv("MINSERVE_KERNEL_CACHE", str(tmp_path))
    assert resolve_execution("cpu").linear_rows == 4
    assert cache_dir() == tmp_path  # where the C kernels are built and kept


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("MINSERVE_C_KERNELS", "yes", "expected 0 .off. or 1 .on."),
        ("MINSERVE_C_KERNELS", "2", "expected 0 .off. or 1 .on."),
        ("MINSERVE_GREEDY_SCREEN", "off", "expected 0 .off. or 1 .on."),
        ("MINSERVE_CPU_BF16", "bf16", "expected 0 .off. or 1 .on."),
        (
            "MINSERVE_KERNEL_ROWS",
            "-1",
            "expected a row count .an integer >= 0; 0: oneDNN always. or 'measured'",
        ),
        (
            "MINSERVE_KERNEL_ROWS",
            "eight",
            "expected a row count .an integer >= 0; 0: oneDNN always. or 'measured'",
        ),
        (
            "MINSERVE_KERNEL_ROWS",
            "1.5",
            "expected a row count .an integer >= 0; 0: oneDNN always. or 'measured'",
        ),
    ],
)
def test_an_invalid_value_names_the_variable_and_what_it_takes(
    name: str, value: str, allowed: str
) -> None:
    for device in ("cpu", "cuda"):  # checked on any device, used or not
        with pytest.raises(ValueError, match=f"{name}='{value}': {allowed}"):
            resolve_execution(device, environ={name: value})


def test_an_unknown_dtype_says_which_there_are() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; choose auto, float32, bfloat16"):
        resolve_execution("cpu", "fp8", environ={})


def test_no_module_but_the_environment_module_mentions_minserve_variables() -> None:
    package = Path(minserve.__file__).parent
    own = Path(environment.__file__)
    readers = [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        if path != own and "MINSERVE_" in path.read_text()
    ]
    assert readers == []


# --- the summary line -----------------------------------------------------------------------


def test_the_summary_names_every_choice_on_one_line() -> None:
    config = ExecutionConfig(
        device=torch.device("cpu"), dtype=torch.float32, attention="cpu", c_kernels=True,
        prepack=True, linear_rows="measured", greedy_screen=True, kernel_cache=Path("/k"),
        rows_by_shape=(("576x576", 16), ("576x1536", 12)), packed_as="oneDNN", fused_decode=True,
    )  # fmt: skip
    assert config.summary() == (
        "execution: platform=cpu device=cpu dtype=float32 attention=cpu ops=torch c_kernels=on "
        "prepack=on(oneDNN) linear_rows=measured(576x576:16,576x1536:12) greedy_screen=on "
        "fused_decode=on quantization=none openmp_waits=spin(10000)-then-sleep kv_cache=float32 "
        "kernel_cache=/k"
    )
    fixed = cpu(MINSERVE_KERNEL_ROWS="8", MINSERVE_GREEDY_SCREEN="0").summary()
    assert "linear_rows=8 greedy_screen=off" in fixed
    assert "c_kernels=off prepack=on linear_rows=off" in cpu(MINSERVE_C_KERNELS="0").summary()


def test_the_llm_logs_its_config_once_and_returns_it(tiny_model, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="minserve"):
        llm = LLM(tiny_model("llama"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("execution:")]
    config = llm.get_execution_config()
    assert lines == [config.summary()] and config is llm.engine.execution
    assert lines[0].startswith("execution: platform=cpu device=cpu(auto: ")  # and why
    assert (
        " dtype=float32(auto: MINSERVE_CPU_BF16=0) attention=cpu ops=c-kernels c_kernels=on "
        "prepack=on(oneDNN) linear_rows=measured(" in lines[0]
    )
    linears = [m for m in llm.loaded.model.modules() if isinstance(m, PackedLinear)]
    assert dict(config.rows_by_shape) == {  # what the platform set on each layer shape
        f"{m.in_features}x{m.out_features}": rows_limit(m) for m in linears
    }


def test_a_fixed_row_count_from_the_environment_reaches_every_layer(
    tiny_model, monkeypatch
) -> None:
    monkeypatch.setenv("MINSERVE_KERNEL_ROWS", "3")
    llm = LLM(tiny_model("llama"))
    linears = [m for m in llm.loaded.model.modules() if isinstance(m, PackedLinear)]
    assert {rows_limit(m) for m in linears} == {3}
    assert llm.get_execution_config().linear_rows == 3


def test_the_greedy_screen_switched_off_is_not_attached(tiny_model, monkeypatch) -> None:
    monkeypatch.setenv("MINSERVE_GREEDY_SCREEN", "0")
    llm = LLM(tiny_model("llama"))
    assert llm.engine.worker.runner.screen is None
    assert not llm.get_execution_config().greedy_screen


def test_each_engine_resolves_its_own_attention_backend(tiny_model) -> None:
    base = LLM(tiny_model("llama"))
    torch_attention = LLM(base.loaded, attention_backend="torch").get_execution_config()
    assert torch_attention.attention == "torch"
    assert torch_attention.rows_by_shape == base.get_execution_config().rows_by_shape
    reference = LLM(base.loaded, engine="reference").get_execution_config()
    assert reference.attention == "contiguous"


# --- the C kernels off --------------------------------------------------------------------


def greedy_tokens(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 7 * i))} for i in range(3)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # one prompt alone (the head's screen at batch 1), then three (the few-row linears)
    return [
        o.outputs[0].token_ids
        for batch in (prompts[:1], prompts)
        for o in llm.generate(batch, params, use_tqdm=False)
    ]


def refuse_c_kernels(monkeypatch) -> None:
    for name in C_KERNEL_OPS:
        monkeypatch.setattr(cpu_ops, name, lambda *args: pytest.fail("a C kernel ran"))


def test_the_c_kernels_off_give_the_same_greedy_tokens(tiny_model, monkeypatch) -> None:
    with_c = greedy_tokens(LLM(tiny_model("llama")))
    monkeypatch.setenv("MINSERVE_C_KERNELS", "0")
    llm = LLM(tiny_model("llama"))
    config = llm.get_execution_config()
    assert not config.c_kernels and config.attention == "torch"
    refuse_c_kernels(monkeypatch)
    assert greedy_tokens(llm) == with_c


def test_the_platforms_ops_reach_every_layer(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), attention_backend="torch")
    model = llm.loaded.model
    assert model.ops is C_KERNEL_OPS_VALUE and llm.get_execution_config().ops == "c-kernels"
    with_c = greedy_tokens(llm)
    calls: list[str] = []

    def counting(name: str):
        fn = getattr(MODEL_OPS, name)
        return lambda *args: calls.append(name) or fn(*args)

    counted = {name: counting(name) for name in ("rms_norm", "apply_rope", "swiglu")}
    model.use_ops(dataclasses.replace(MODEL_OPS, **counted))  # torch, counted
    try:
        assert greedy_tokens(llm) == with_c
    finally:
        model.use_ops(C_KERNEL_OPS_VALUE)
    assert set(calls) == set(counted)  # every op the layers call came from the ops given
    # two norms a layer and the final one, in every forward
    assert calls.count("rms_norm") % (2 * model.config.num_layers + 1) == 0


# --- how OpenMP threads wait ----------------------------------------------------------------

WAITS = (
    "import os, sys; {first}from minserve.openmp_env import openmp_waits; "
    "print(os.environ.get('GOMP_SPINCOUNT'), openmp_waits())"
)


@pytest.mark.parametrize(
    ("first", "env", "expected"),
    [
        ("", {}, "10000 spin(10000)-then-sleep"),  # nobody chose: a short spin
        ("", {"OMP_WAIT_POLICY": "active"}, "None OMP_WAIT_POLICY=active"),
        ("", {"GOMP_SPINCOUNT": "1000"}, "1000 GOMP_SPINCOUNT=1000"),
        ("import torch; ", {}, "10000 spin(torch was imported before minserve"),
    ],
)
def test_openmp_threads_spin_briefly_unless_someone_chose(
    first: str, env: dict, expected: str
) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = WAITS.format(first=first)
    run = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout.strip()
    assert out.startswith(expected)


def test_the_kv_cache_format_is_part_of_the_config() -> None:
    config = ExecutionConfig(
        device=torch.device("cpu"), dtype=torch.bfloat16, attention="cpu", c_kernels=True,
        prepack=True, linear_rows=0, greedy_screen=False, kernel_cache=Path("/k"),
    )  # fmt: skip
    assert config.kv_format.storage_dtype == torch.bfloat16  # "auto": the model's dtype
    eight = config.with_kv_cache("fp8")
    assert eight.kv_cache_dtype == "fp8_e4m3" and "kv_cache=fp8_e4m3" in eight.summary()
    assert eight.kv_format.storage_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="choose one of auto, fp8"):
        config.with_kv_cache("int4")
