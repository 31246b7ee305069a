"""How a KV cache stores each token's keys and values: the model's dtype, fp8, or int8.

Decode reads the whole KV of every sequence at every step, so the bytes per cached value set
both its speed and how many tokens a fixed memory budget holds. An 8-bit cache halves them
against bfloat16 (vLLM's `kv_cache_dtype`):

- "fp8_e4m3" / "fp8_e5m2": each value converted to an 8-bit float (scale 1.0, as vLLM
  without calibration), rounded to nearest, clamped to the format's largest finite value
  first (e4m3: +-448; e5m2: +-57344) so that no value turns into a NaN or an infinity.
- "int8": symmetric int8 with one scale per token and KV head (LMDeploy's and KIVI's
  scheme): scale = absmax(x[token, head, :]) / 127, q = round(x / scale) in [-127, 127].
  A stored row is the D int8 values followed by the scale's two bytes as fp16, so the pool
  stays one uint8 tensor whose blocks move (copy-on-write, swap, host tier, hand-off)
  exactly as a 16-bit pool's do: D + 2 bytes per token and head.

`encode` and `decode` here are the reference every backend's kernels match. An int8 format
may carry a `KVCodec`, another pair of int8 functions (chapter 10's exercise 10.5:
`LLM(kv_cache_dtype="int8", kv_codec=KVCodec.from_module(module))`); only the torch
attention paths call a format's `encode` and `decode`, so the engine runs such a pool there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType

import torch

from minserve.config import KV_CACHE_DTYPES

INT8_MAX = 127
SCALE_BYTES = 2  # the int8 row's scale, stored as fp16

# x [..., D] float -> (q [..., D] int8, scale [..., 1] fp16)
QuantizeInt8 = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (q [..., D] int8, scale [..., 1] fp16) -> [..., D] float32
DequantizeInt8 = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class KVCodec:
    """The int8 KV arithmetic an `Int8Format` calls: minserve's (`INT8_CODEC`) or a
    module's (`KVCodec.from_module`, chapter 10's exercise 10.5)."""

    quantize: QuantizeInt8
    dequantize: DequantizeInt8

    @classmethod
    def from_module(cls, module: ModuleType) -> KVCodec:
        """`module.quantize_int8` and `module.dequantize_int8` (the exercises or solutions)."""
        wanted = ("quantize_int8", "dequantize_int8")
        missing = [name for name in wanted if not callable(getattr(module, name, None))]
        if missing:
            raise ValueError(f"module {module.__name__} has no function {', '.join(missing)}")
        return cls(module.quantize_int8, module.dequantize_int8)


@dataclass(frozen=True)
class KVFormat:
    """A KV cache format: what one cached row [Hkv, row] holds for a token's [Hkv, D] values.

    `storage_dtype` is the pool tensor's dtype; `quantized` formats store fewer bits than the
    model computes in, and attention widens them to fp32 as it reads them.
    """

    name: str
    storage_dtype: torch.dtype
    quantized: bool = False

    def row_size(self, head_dim: int) -> int:
        """Elements of `storage_dtype` per token and KV head (the pool's last dimension)."""
        return head_dim

    def bytes_per_token_head(self, head_dim: int) -> int:
        return self.row_size(head_dim) * self.storage_dtype.itemsize

    def head_dim(self, row_size: int) -> int:
        """The inverse of `row_size`: the model's head_dim behind a stored row."""
        return row_size

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, Hkv, D] (any float dtype) -> stored [T, Hkv, row] in `storage_dtype`."""
        return x.to(self.storage_dtype)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """stored [..., Hkv, row] -> [..., Hkv, D] float32."""
        return stored.float()

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, Hkv, D] -> the values a cache in this format holds for it, float32."""
        return self.decode(self.encode(x))


@dataclass(frozen=True)
class Fp8Format(KVFormat):
    """An 8-bit float per value (scale 1.0), saturating at the format's largest value."""

    quantized: bool = True

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        largest = torch.finfo(self.storage_dtype).max
        return x.float().clamp(-largest, largest).to(self.storage_dtype)


@dataclass(frozen=True)
class Int8Format(KVFormat):
    """Symmetric int8, one fp16 scale per token and KV head, stored after the D values.

    `codec` None: minserve's `quantize_int8` and `dequantize_int8`; else that codec's.
    """

    storage_dtype: torch.dtype = torch.uint8
    quantized: bool = True
    codec: KVCodec | None = None

    @property
    def arithmetic(self) -> KVCodec:
        """The functions `encode` and `decode` call."""
        return self.codec or INT8_CODEC

    def row_size(self, head_dim: int) -> int:
        return head_dim + SCALE_BYTES

    def head_dim(self, row_size: int) -> int:
        return row_size - SCALE_BYTES

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = self.arithmetic.quantize(x)  # [T, Hkv, D] int8, [T, Hkv, 1] fp16
        return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        values = stored[..., :-SCALE_BYTES].view(torch.int8)  # [..., Hkv, D]
        # a fresh, packed copy of the scales' bytes: a view of fp16 needs them aligned
        scale_bytes = stored[..., -SCALE_BYTES:].clone(memory_format=torch.contiguous_format)
        scale = scale_bytes.view(torch.float16)  # [..., Hkv, 1]
        return self.arithmetic.dequantize(values, scale)


# >>> exercise 10.5: the int8 KV store
def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] int8, scale [..., 1] fp16) with x ~= q * scale.

    scale = absmax(x) / 127 per row (in fp32), rounded to fp16 first so that the stored
    scale is the one used; q = round(x / scale) (torch.round: halves to even) clamped to
    [-127, 127]. An all-zero row gets scale 0 and q 0 (no division by zero); a row past
    fp16's range (absmax > 127 x 65504) saturates at the largest scale instead of
    overflowing.
    """
    # >>> solution
    absmax = x.float().abs().amax(dim=-1, keepdim=True)  # [..., 1]
    largest = torch.finfo(torch.float16).max
    scale = (absmax / INT8_MAX).clamp(max=largest).to(torch.float16)
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(absmax))
    q = torch.round(x.float() / safe).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale
    # <<< solution


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of `quantize_int8`: q [..., D] int8 times scale [..., 1] -> float32."""
    # >>> solution
    return q.float() * scale.float()
    # <<< solution


# <<< exercise


INT8_CODEC = KVCodec(quantize_int8, dequantize_int8)


KV_FORMATS: dict[str, KVFormat] = {
    "fp8_e4m3": Fp8Format("fp8_e4m3", torch.float8_e4m3fn),
    "fp8_e5m2": Fp8Format("fp8_e5m2", torch.float8_e5m2),
    "int8": Int8Format("int8"),
}
ALIASES = {"fp8": "fp8_e4m3"}


def check_kv_cache_dtype(name: str) -> str:
    """The canonical name of `name` ("fp8" -> "fp8_e4m3"); an unknown one lists the choices."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown kv_cache_dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return ALIASES.get(name, name)


def check_kv_codec(name: str, codec: KVCodec | None) -> None:
    """A codec is int8 arithmetic: it goes with kv_cache_dtype="int8" only."""
    if codec is not None and check_kv_cache_dtype(name) != "int8":
        raise ValueError(
            f"kv_codec quantizes an int8 KV cache, but kv_cache_dtype is {name!r}; "
            "pass kv_cache_dtype='int8' with it"
        )


def kv_format(name: str, model_dtype: torch.dtype, codec: KVCodec | None = None) -> KVFormat:
    """The format called `name`; "auto" stores the model's own dtype; int8 with `codec`
    encodes and decodes through it."""
    check_kv_codec(name, codec)
    name = check_kv_cache_dtype(name)
    if name == "auto":
        return KVFormat(str(model_dtype).removeprefix("torch."), model_dtype)
    if codec is not None:
        return replace(KV_FORMATS[name], codec=codec)
    return KV_FORMATS[name]


def stored_format(storage_dtype: torch.dtype) -> KVFormat:
    """The format of a pool tensor, read from its dtype (what attention backends see)."""
    for fmt in KV_FORMATS.values():
        if fmt.storage_dtype == storage_dtype:
            return fmt
    return KVFormat(str(storage_dtype).removeprefix("torch."), storage_dtype)


def attention_dtype(storage_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention computes in over a pool of `storage_dtype`: fp32 for 8-bit ones."""
    return torch.float32 if stored_format(storage_dtype).quantized else storage_dtype
