"""Tensors on the wire (attngrad.v1.Tensor: raw little-endian bytes, a dtype and a shape) to and
from NumPy arrays and PyTorch tensors. PyTorch is never imported here: torch tensors are recognised
by their type's module and converted with their own methods.

Copies: a CUDA tensor comes to the host once, into page-locked memory (to_host); contiguous() gives
the wire bytes of an array without copying when it already is C-contiguous little-endian float32
(float16/bfloat16 need one conversion); the client then serialises backward requests and weight
chunks with a single join of those buffers (client._WireRequest/_WireChunk). Decoding is zero-copy
for float32 and float16 (np.frombuffer over the received bytes: the array is read-only and keeps
them alive); bfloat16 needs one widening copy to float32."""
from __future__ import annotations

from typing import Any, Tuple

import numpy as np

DTYPE_NAMES = ("float32", "float16", "bfloat16")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def is_torch_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def to_host(tensor):
    """A GPU tensor's copy in page-locked host memory (from PyTorch's caching host allocator, so a
    buffer of the same size is reused call after call): the device copies into it at DMA speed,
    where tensor.cpu() lands in fresh pageable memory (page faults on every call, and the driver's
    bounce through its own staging buffer). A CPU tensor as it is."""
    if tensor.device.type == "cpu":
        return tensor
    host = tensor.new_empty(tensor.shape, device="cpu", pin_memory=True)
    host.copy_(tensor)  # synchronous: complete when it returns
    return host


def to_numpy(value: Any) -> np.ndarray:
    """A NumPy view (or, for GPU/bf16 tensors, a host copy as float32) of an array-like."""
    if is_torch_tensor(value):
        tensor = value.detach()
        if str(tensor.dtype) == "torch.bfloat16":
            tensor = tensor.float()
        return to_host(tensor).numpy()
    return np.asarray(value)


def itemsize(dtype_name: str) -> int:
    return _ITEMSIZE[dtype_name]


def wire_dtype_name(dtype_name: str) -> str:
    """Normalises 'fp32'/'f32'/'float' spellings to one of DTYPE_NAMES."""
    aliases = {"fp32": "float32", "f32": "float32", "float": "float32", "fp16": "float16",
               "f16": "float16", "half": "float16", "bf16": "bfloat16"}
    name = aliases.get(str(dtype_name).lower(), str(dtype_name).lower())
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown wire dtype {dtype_name!r}: expected one of "
                         f"{', '.join(DTYPE_NAMES)}")
    return name


def contiguous(array: np.ndarray, dtype_name: str) -> np.ndarray:
    """ARRAY as a C-contiguous little-endian array whose bytes are the wire encoding in DTYPE_NAME
    (no copy when it already is one, e.g. a slice along B of a contiguous float32 array)."""
    if dtype_name == "float32":
        return np.ascontiguousarray(array, dtype="<f4")
    if dtype_name == "float16":
        return np.ascontiguousarray(array, dtype="<f2")
    if dtype_name == "bfloat16":
        bits = np.ascontiguousarray(array, dtype="<f4").view("<u4")
        # Round to nearest even; NaNs stay NaNs (quiet bit kept in the top half).
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                   >> np.uint32(16)).astype("<u2")
        nan = np.isnan(bits.view("<f4"))
        if nan.any():
            rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype("<u2")
        return rounded.reshape(np.shape(array))
    raise ValueError(f"unknown wire dtype {dtype_name!r}")


def encode(array: np.ndarray, dtype_name: str) -> Tuple[bytes, Tuple[int, ...]]:
    """(raw little-endian bytes in DTYPE_NAME, shape) of ARRAY."""
    return contiguous(array, dtype_name).tobytes(), tuple(int(d) for d in np.shape(array))


def decode(raw: bytes, dtype_name: str, shape, *, field: str) -> np.ndarray:
    """An array over RAW (zero-copy for float32/float16). Raises ValueError when the byte count does
    not match the shape."""
    shape = tuple(int(d) for d in shape)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    expected = count * _ITEMSIZE[dtype_name]
    if len(raw) != expected:
        raise ValueError(f"{field}: the server sent {len(raw)} bytes for shape {list(shape)} "
                         f"{dtype_name}, expected {expected}")
    if dtype_name == "float32":
        return np.frombuffer(raw, dtype="<f4").reshape(shape)
    if dtype_name == "float16":
        return np.frombuffer(raw, dtype="<f2").reshape(shape)
    if dtype_name == "bfloat16":
        wide = np.frombuffer(raw, dtype="<u2").astype("<u4") << np.uint32(16)
        return wide.view("<f4").reshape(shape)
    raise ValueError(f"{field}: unknown dtype {dtype_name!r}")
