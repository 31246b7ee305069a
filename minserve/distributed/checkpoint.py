"""A checkpoint read one tensor at a time, so a rank can keep only its slices.

`load_model` reads every tensor into one dict: fine for one process, but it would hold the
full model on every rank. `CheckpointTensors` opens the same files (a GGUF file or a
Hugging Face safetensors folder) and produces one named tensor on demand; the caller
slices it and lets the full tensor go.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from minserve.model.default_model import default_model_path
from minserve.model.gguf_loader import config_from_gguf, hf_name, open_gguf, read_gguf_tensor
from minserve.model.hf_loader import config_from_hf, safetensors_files
from minserve.model_config import ModelConfig


class CheckpointTensors:
    """Named tensors (Hugging Face names) of a checkpoint, read lazily, plus its config."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = default_model_path() if path is None else Path(path).expanduser()
        if not self.path.exists():
            raise FileNotFoundError(f"model path {self.path} does not exist")
        if self.path.is_dir():
            self.config: ModelConfig = config_from_hf(self.path)
            self._files = _safetensors_files(self.path)
        else:
            self._reader = open_gguf(self.path)
            self.config = config_from_gguf(self._reader)
            self._gguf = {hf_name(t.name): t for t in self._reader.tensors}

    def names(self) -> set[str]:
        return set(self._gguf if not self.path.is_dir() else self._files)

    def get(self, name: str) -> torch.Tensor:
        """The full tensor `name`, as stored (GGUF: dequantized to fp32, q/k rows un-permuted)."""
        if self.path.is_dir():
            with safe_open(self._files[name], framework="pt") as f:
                return f.get_tensor(name)
        return read_gguf_tensor(self._gguf[name], self.config)


def _safetensors_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded index)."""
    files: dict[str, Path] = {}
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files
