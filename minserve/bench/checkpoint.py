"""The model a benchmark runs, for every engine that runs it.

- `model_path`: the checkpoint, by default the bundled SmolLM2-135M-Instruct GGUF;
- `vocab_size`: its vocabulary, read from its config (no weights loaded), for workloads of
  random token ids;
- `hf_model_folder`: a Hugging Face folder of it, for what cannot read a GGUF file (vLLM,
  the layer-truncated drafts of `minserve bench speculative`).
"""

from __future__ import annotations

from pathlib import Path


def model_path(model: str | None) -> Path:
    from minserve.model.default_model import default_model_path

    return default_model_path() if model is None else Path(model)


def vocab_size(model: str | None) -> int:
    """The checkpoint's vocabulary size, read from its config (no weights loaded)."""
    from minserve.model.gguf_loader import config_from_gguf, open_gguf
    from minserve.model.hf_loader import config_from_hf

    path = model_path(model)
    config = config_from_hf(path) if path.is_dir() else config_from_gguf(open_gguf(path))
    return config.vocab_size


def hf_model_folder(folder: Path = Path(".cache/smollm2-hf"), model: str | None = None) -> Path:
    """A Hugging Face folder of `model`: the model itself, or a converted GGUF.

    transformers dequantizes the GGUF once and saves model and tokenizer; a `source.txt`
    beside them names the GGUF, so a different --model is converted again.
    """
    path = model_path(model)
    if path.is_dir():
        return path
    marker = folder / "source.txt"
    if marker.exists() and marker.read_text() == str(path.resolve()):
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.hf_quantizer = None  # the weights are dequantized already: save them as plain fp32
    del model.config.quantization_config
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(folder)
    marker.write_text(str(path.resolve()))
    return folder
