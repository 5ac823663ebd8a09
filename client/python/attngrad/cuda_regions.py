"""Same-host zero-copy over CUDA IPC: torch CUDA tensors registered with the server as regions.

A tensor's storage is shared with `storage._share_cuda_()` (the CUDA IPC handle of the allocation
that holds it, its offset there and its size), registered once (RegisterRegion with cuda_ipc) and
remembered by (handle, offset, size): torch's caching allocator hands the same memory to the
same-shaped tensors of the next step, so a training loop registers a few regions once. At most
CAPACITY registrations are kept (the oldest is unregistered first); close() unregisters them all.

torch counts the consumers of a shared storage (a reference counter that `_share_cuda_()` sets
to 1 for the consumer it expects) and keeps its memory out of reuse until a consumer releases it;
the server is no torch consumer, so the client releases that count itself right after sharing,
and torch then reuses the memory as usual. The server computes straight from and into this
memory: before a batch is sent, the work of the tensors' stream must be done (the client
synchronises the current stream of the tensors' device), and the answer is there once the
response has arrived.
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Optional, Tuple

ALIGNMENT = 16  # a CUDA IPC slice's address must be a multiple of this (the server's rule)

_WIRE_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def is_cuda_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and getattr(value, "is_cuda", False)


def torch_wire_dtype(tensor) -> Optional[str]:
    """"float32", "float16" or "bfloat16" for a tensor of that dtype, else None."""
    name = str(tensor.dtype).replace("torch.", "")
    return _WIRE_DTYPES.get(name)


def torch_dtype(wire_dtype: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[wire_dtype]


_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def cuda_ipc_handle(torch_handle: bytes) -> bytes:
    """The cudaIpcMemHandle_t in what `_share_cuda_()` returns: the 64 bytes themselves (older
    torch), or a version byte, a type byte ('c': a cudaMalloc block) and the 64 bytes (torch 2.x's
    caching allocator). Memory of expandable segments (type 'e') has no such handle."""
    raw = bytes(torch_handle)
    if len(raw) == _IPC_HANDLE_BYTES:
        return raw
    if len(raw) == _IPC_HANDLE_BYTES + 2 and raw[1] == ord("c"):
        return raw[2:]
    if len(raw) >= 2 and raw[1] == ord("e"):
        raise ValueError("zero_copy with CUDA tensors needs cudaMalloc'd memory: this tensor lives "
                         "in an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:"
                         "True), which has no CUDA IPC memory handle; turn expandable segments off")
    raise ValueError(f"unknown CUDA IPC handle format from torch ({len(raw)} bytes)")


class CudaRegionCache:
    """The CUDA IPC regions a client has registered, by (device, handle, offset, size)."""

    def __init__(self, register, unregister, capacity: int = 64):
        self._register = register      # (handle bytes, device, offset, size) -> region id
        self._unregister = unregister  # region id -> None
        self._capacity = max(1, int(capacity))
        self._lock = threading.Lock()
        self._regions: "collections.OrderedDict[Tuple, int]" = collections.OrderedDict()
        # torch's consumer counters already released (a storage shared again returns its counter).
        self._released: "collections.OrderedDict[Tuple[bytes, int], None]" = \
            collections.OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._regions)

    def slice_of(self, tensor):
        """(region id, byte offset, byte size) of a contiguous CUDA tensor's bytes, its storage
        registered when it was not yet."""
        storage = tensor.untyped_storage()
        shared = storage._share_cuda_()
        device, handle, storage_bytes, storage_offset = shared[0], shared[1], shared[2], shared[3]
        self._release_torch_count(shared)
        key = (int(device), cuda_ipc_handle(handle), int(storage_offset), int(storage_bytes))
        with self._lock:
            region = self._regions.get(key)
            if region is not None:
                self._regions.move_to_end(key)
        if region is None:
            region = self._register(key[1], key[0], key[2], key[3])
            evicted = []
            with self._lock:
                self._regions[key] = region
                while len(self._regions) > self._capacity:
                    evicted.append(self._regions.popitem(last=False)[1])
            for old in evicted:
                self._unregister(old)
        offset = tensor.storage_offset() * tensor.element_size()
        return region, offset, tensor.numel() * tensor.element_size()

    def _release_torch_count(self, shared) -> None:
        """Releases, once per storage, the consumer count that _share_cuda_() set (see above)."""
        import torch

        counter_handle, counter_offset = shared[4], shared[5]
        if not counter_handle:
            return
        key = (bytes(counter_handle), int(counter_offset))
        with self._lock:
            if key in self._released:
                return
            self._released[key] = None
            while len(self._released) > 4096:
                self._released.popitem(last=False)
        release = getattr(torch.UntypedStorage, "_release_ipc_counter_cuda", None)
        if release is not None:
            try:
                release(counter_handle, counter_offset)
            except (RuntimeError, TypeError):
                pass  # torch keeps that memory out of reuse: a leak, never a wrong result

    def close(self) -> None:
        with self._lock:
            regions, self._regions = list(self._regions.values()), collections.OrderedDict()
        for region in regions:
            self._unregister(region)
