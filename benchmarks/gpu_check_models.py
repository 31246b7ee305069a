"""The GPU check's model stages: engine equality and offline throughput (benchmarks/gpu_check.py).

Models are random-weight Llamas built from a config and saved as Hugging Face folders with
SmolLM2's tokenizer (rebuilt from the bundled GGUF's metadata): nothing is downloaded.
Prompts are token ids, so every model reads the same ones.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.gpu_check_stages import device_name

if TYPE_CHECKING:
    from benchmarks.gpu_check import Rows

BASE = dict(vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, rope_theta=10000.0)  # fmt: skip
SHAPES = {  # initializer_range 0.1 keeps the tiny model's logits far from ties
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                 initializer_range=0.1),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      rope_theta=500000.0, tie_word_embeddings=False),
}  # fmt: skip
EIGHT_B_NEEDS_GIB = 60  # fp32 init (32 GiB) cast to bf16, then minserve's bf16 copy


def write_tokenizer(folder: Path) -> None:
    """SmolLM2's tokenizer, from the bundled GGUF, as tokenizer.json and its config."""
    from minserve.model.default_model import default_model_path
    from minserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(default_model_path())
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    special = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    (folder / "tokenizer_config.json").write_text(json.dumps(special))


def random_model(shape: str, folder: Path, device: str, dtype: torch.dtype) -> Any:
    """A random Llama of `shape` (SHAPES), saved in `folder` with a tokenizer; the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **{**BASE, **SHAPES[shape]})
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: an 8B model in seconds
        model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model.eval()


def prompts(count: int, length: int, shared: int = 0, seed: int = 0) -> list[list[int]]:
    """`count` prompts of token ids; the first `shared` ids are the same in each."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(100, 20000, (shared,), generator=g).tolist()
    tails = torch.randint(100, 20000, (count, length - shared), generator=g).tolist()
    return [prefix + tail for tail in tails]


def release() -> None:
    """Free what a finished LLM or model held, before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def generate(model: str | None, ids: Sequence[list[int]], params: Any, rounds: int = 1,
             **options: Any) -> list[list[int]]:  # fmt: skip
    """Each round's tokens for `ids` from a fresh `LLM(model, **options)`, rounds in a row."""
    from minserve import LLM

    llm = LLM(model, **options)
    try:
        batch = [{"prompt_token_ids": p} for p in ids]
        return [o.outputs[0].token_ids for _ in range(rounds)
                for o in llm.generate(batch, params, use_tqdm=False)]  # fmt: skip
    finally:
        llm.shutdown()
        del llm
        release()


def first_mismatch(got: list[list[int]], want: list[list[int]]) -> list[int] | None:
    """[prompt, position] of the first differing token, or None when all are equal."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return [i, j]
        if len(a) != len(b):
            return [i, min(len(a), len(b))]
    return None


# ---------------------------------------------------------------- 3. engine


ENGINE_RUNS = {  # label: (LLM options over the defaults, rounds of the same prompts)
    "triton": ({}, 1),
    "triton, chunked prefill (16-token steps)": ({"max_num_batched_tokens": 16}, 1),
    "triton, preemption (8 blocks)": ({"num_blocks": 8, "max_model_len": 128}, 1),
    "triton, prefix cache + host tier, twice": (
        {"enable_prefix_caching": True, "kv_offloading_size": 0.01, "num_blocks": 16}, 2),
}  # fmt: skip


def engine_checks(
    rows: Rows, name: str, model: str | None, dtype: str, device: str, new: int
) -> None:
    """Greedy tokens of every ENGINE_RUNS equal the torch backend's; seeded sampling repeats."""
    from minserve import SamplingParams

    ids = prompts(4, 32, shared=24)  # 24 shared tokens: a block and a half to cache
    greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    base = dict(dtype=dtype, device=device, block_size=16, num_blocks=64, max_model_len=256)
    reference = generate(model, ids, greedy, attention_backend="torch", **base)
    for label, (options, rounds) in ENGINE_RUNS.items():
        got = generate(model, ids, greedy, rounds, attention_backend="triton", **base | options)
        miss = first_mismatch(got, reference * rounds)
        rows.add(model=name, check=f"greedy: {label} == torch", first_mismatch=miss, ok=not miss)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=new, ignore_eos=True)
    twice = generate(model, ids, seeded, 2, attention_backend="triton", **base)
    miss = first_mismatch(twice[: len(ids)], twice[len(ids) :])
    rows.add(model=name, check="seeded sampling repeats", first_mismatch=miss, ok=not miss)


def engine(rows: Rows, dry_run: bool) -> str:
    """The tiny random model (fp32), then the bundled SmolLM2 on a GPU (its default dtype)."""
    device = device_name(dry_run)
    with tempfile.TemporaryDirectory() as tmp:
        random_model("tiny", Path(tmp), "cpu", torch.float32)
        release()
        engine_checks(rows, "tiny", tmp, "float32", device, new=4 if dry_run else 16)
    if dry_run:
        return "dry run: the tiny model only, 4 new tokens (Triton interpreted)"
    engine_checks(rows, "smollm2 (bundled)", None, "auto", device, new=16)
    return "tiny model and SmolLM2"


# ---------------------------------------------------------------- 5. throughput


def timed(fn: Any) -> float:
    """Wall-clock seconds of `fn()`, the device synchronised on both sides."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def transformers_tokens_per_s(model: Any, ids: list[list[int]], new: int) -> float:
    """transformers' greedy `generate` on the batch (equal lengths: no padding)."""
    x = torch.tensor(ids, device=model.device)  # [batch, prompt_len]
    options = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(x))
    with torch.inference_mode():
        model.generate(x, max_new_tokens=2, **options)  # warm-up
        seconds = timed(lambda: model.generate(x, max_new_tokens=new, min_new_tokens=new,
                                               **options))  # fmt: skip
    return len(ids) * new / seconds


def minserve_tokens_per_s(folder: Path, ids: list[list[int]], new: int, dtype: str,
                          device: str) -> float:  # fmt: skip
    """`LLM.generate` on the batch, after a warm-up batch, with KV blocks for all of it."""
    from minserve import LLM, SamplingParams

    max_len = len(ids[0]) + new
    llm = LLM(str(folder), dtype=dtype, device=device, max_model_len=max_len,
              num_blocks=len(ids) * (-(-max_len // 16)) + 8)  # fmt: skip
    batch = [{"prompt_token_ids": p} for p in ids]
    try:
        llm.generate(batch[:2], SamplingParams(max_tokens=2), use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        seconds = timed(lambda: llm.generate(batch, params, use_tqdm=False))
    finally:
        llm.shutdown()
    return len(ids) * new / seconds


def memory_short(shape: str) -> str | None:
    """Why the 8B model cannot be built here, or None."""
    if shape != "llama3-8b":
        return None
    free = torch.cuda.mem_get_info()[0] / 2**30
    if free < EIGHT_B_NEEDS_GIB:
        return f"skipped: {free:.0f} GiB free on the device; the 8B model needs {EIGHT_B_NEEDS_GIB}"
    return None


def throughput(rows: Rows, dry_run: bool) -> str:
    """Offline tokens/s of minserve and transformers on random SmolLM2- and 8B-shaped models."""
    device = device_name(dry_run)
    dtype = torch.float32 if dry_run else torch.bfloat16
    shapes = ["tiny"] if dry_run else ["smollm2-135m", "llama3-8b"]
    count, length, new = (4, 16, 8) if dry_run else (32, 128, 128)
    ids = prompts(count, length)
    for shape in shapes:
        if why := memory_short(shape):
            rows.add(model=shape, note=why)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            model = random_model(shape, Path(tmp), device, dtype)
            theirs = transformers_tokens_per_s(model, ids, new)
            del model
            release()
            ours = minserve_tokens_per_s(Path(tmp), ids, new, str(dtype).removeprefix("torch."),
                                         device)  # fmt: skip
            release()
        rows.add(model=shape, batch=count, prompt_len=length, new_tokens=new,
                 minserve_tokens_per_s=ours, transformers_tokens_per_s=theirs,
                 minserve_over_transformers=ours / theirs)  # fmt: skip
    return "dry run: the tiny model only" if dry_run else "8B included unless noted"


STAGES = {"engine": engine, "throughput": throughput}
