"""Test-wide settings: nothing downloads, Triton kernels run in the interpreter on a CPU (on
a GPU they compile, as they do when serving), and dtype "auto" is float32 on every CPU, so
the parity tests compare fp32 with fp32 on any machine (the tests of bfloat16 ask for it)."""

import os

import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["MINSERVE_CPU_BF16"] = "0"  # inherited by the servers, workers and notebooks run
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF (installed by scripts/install.sh)."""
    from minserve.model.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm_tokenizer_dir(smollm_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer as transformers converts and saves it (the oracle's view)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("smollm_tokenizer")
    AutoTokenizer.from_pretrained(smollm_gguf.parent, gguf_file=smollm_gguf.name).save_pretrained(
        folder
    )
    return folder


@pytest.fixture(scope="session")
def tiny_model(smollm_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_model("llama" | "llama3_rope" | "qwen2" | "qwen3") -> a saved HF folder."""
    from tiny_models import make_hf_model

    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_hf_model(kind, tmp_path_factory.mktemp(kind), smollm_tokenizer_dir)
        return made[kind]

    return make


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """Simulate `count` usable GPUs (0: a CUDA build whose driver sees none); the returned
    `SimulatedCuda` enforces real CUDA's `set_device` and per-thread current device."""
    from cuda_stand_in import SimulatedCuda

    def simulate(count: int, cuda_build: str | None = "12.8") -> SimulatedCuda:
        cuda = SimulatedCuda(count)
        monkeypatch.setattr(torch.version, "cuda", cuda_build)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"Test GPU {i}")
        monkeypatch.setattr(torch.cuda, "set_device", cuda.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", cuda.current_device)
        return cuda

    return simulate
