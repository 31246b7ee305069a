"""Bad input gets a specific error that says what is wrong and what is allowed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from minserve import LLM, ModelLoadError, PromptTooLongError, SamplingParams
from minserve.loader import load_model


@pytest.fixture(scope="module")
def tiny_llm(tiny_model) -> LLM:
    return LLM(tiny_model("llama"), max_model_len=32)


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_path_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist; pass a \.gguf file"):
        load_model(tmp_path / "nope")


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_architecture_names_the_supported_ones(tiny_model, tmp_path: Path) -> None:
    folder = copy_model(tiny_model("llama"), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture.*LlamaForCausalLM.*Qwen3"):
        load_model(folder)


def test_truncated_safetensors_is_reported_as_corrupt(tiny_model, tmp_path: Path) -> None:
    folder = copy_model(tiny_model("llama"), tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(folder)


def test_missing_weights_file_is_reported(tiny_model, tmp_path: Path) -> None:
    folder = copy_model(tiny_model("llama"), tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="expected model.safetensors"):
        load_model(folder)


@pytest.mark.parametrize("cut", ["in the metadata", "in the last tensor"])
def test_truncated_gguf_is_reported(smollm_gguf: Path, tmp_path: Path, cut: str) -> None:
    broken = tmp_path / "broken.gguf"
    size = 1_000_000 if cut == "in the metadata" else smollm_gguf.stat().st_size - 1000
    with smollm_gguf.open("rb") as f:
        broken.write_bytes(f.read(size))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(broken)


def test_prompt_longer_than_context_gives_both_numbers(tiny_llm: LLM) -> None:
    with pytest.raises(PromptTooLongError, match=r"prompt has 40 tokens; max_model_len is 32"):
        tiny_llm.generate([[7] * 40], use_tqdm=False)


def test_generation_stops_at_max_model_len(tiny_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    out = tiny_llm.generate([[7] * 30], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"


def test_empty_prompt_is_rejected(tiny_llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny_llm.generate([[]], use_tqdm=False)


def test_out_of_vocabulary_token_ids_are_rejected(tiny_llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"integers in \[0, 49152\)"):
        tiny_llm.generate([[1, 2, 49152]], use_tqdm=False)


def test_one_params_per_prompt_or_one_for_all(tiny_llm: LLM) -> None:
    with pytest.raises(ValueError, match="got 2 SamplingParams for 3 prompts"):
        tiny_llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(top_p=0), "top_p"),
        (dict(temperature=-0.5), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_k=-3), "top_k"),
    ],
)
def test_invalid_sampling_values_are_rejected(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**options)


def test_max_model_len_beyond_the_model_is_rejected(tiny_model) -> None:
    with pytest.raises(ValueError, match=r"max_model_len must be in \[1, 512\]"):
        LLM(tiny_model("llama"), max_model_len=4096)
