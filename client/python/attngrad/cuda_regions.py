"""Same-host zero-copy over CUDA IPC: torch CUDA tensors registered with the server as regions.

A tensor's memory lies in a GPU allocation (a cudaMalloc segment of torch's caching allocator).
The client asks the CUDA driver (libcuda through ctypes: cuPointerGetAttributes) which allocation
holds the tensor's first byte: its base address, size, device and the driver's process-wide unique
buffer id. It registers ONE region per allocation (RegisterRegion with the cuda_ipc handle of its
base, cuIpcGetMemHandle, offset 0 and the allocation's whole size) and names a tensor by its
offset from the base. Registrations are remembered by (device, buffer id): torch's allocator
keeps its segments and hands their memory to the tensors of the next steps, so a training loop
registers a handful of regions once and then only asks the driver (a few microseconds a tensor).
An allocation freed and another made in its address range (torch.cuda.empty_cache(), a segment
released under memory pressure) has a new buffer id: the new one is registered and the old
registration, which kept the freed memory mapped in the server, is unregistered. At most
CAPACITY registrations are kept (the least recently used is unregistered first); close()
unregisters them all. The default capacity holds every segment of a large training process: the
allocator hands a layer's backward blocks from whichever of its segments is free, so a training
step touches tens of segments and a small cache would register them again every step (each
registration is a round trip and a mapping in the server; a mapping costs the server address
space, not memory).

Nothing of torch's IPC machinery is used (no `storage._share_cuda_()`, whose consumer counters
kept memory out of reuse). The server computes straight from and into this memory: before a batch
is sent, the work of the tensors' stream must be done (the client synchronises the current stream
of the tensors' device), and the answer is there once the response has arrived.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import threading
from typing import Any, Callable, Optional, Tuple

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

    return {"float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16}[wire_dtype]


_IPC_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The GPU allocation that holds an address: [base, base + size) on CUDA device DEVICE;
    BUFFER_ID is the driver's id of it, never reused within the process."""
    device: int
    base: int
    size: int
    buffer_id: int


# CUpointer_attribute (cuda.h)
_BUFFER_ID, _DEVICE_ORDINAL, _IPC_CAPABLE, _RANGE_START, _RANGE_SIZE = 7, 9, 10, 11, 12
_CUDA_SUCCESS = 0


class _Driver:
    """The few CUDA driver calls the cache needs, through ctypes on libcuda (loaded by each
    CudaRegionCache at its first lookup)."""

    def __init__(self, library_path: str = "libcuda.so.1"):
        library = ctypes.CDLL(library_path)
        self._get_attributes = library.cuPointerGetAttributes
        self._get_attributes.restype = ctypes.c_int
        self._get_attributes.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_int),
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_ulonglong]
        self._ipc_handle = library.cuIpcGetMemHandle
        self._ipc_handle.restype = ctypes.c_int
        self._ipc_handle.argtypes = [ctypes.c_char_p, ctypes.c_ulonglong]
        self._error_name = library.cuGetErrorName
        self._error_name.restype = ctypes.c_int
        self._error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        kinds = (_BUFFER_ID, _DEVICE_ORDINAL, _IPC_CAPABLE, _RANGE_START, _RANGE_SIZE)
        self._kinds = (ctypes.c_int * len(kinds))(*kinds)
        # Stream memory operations (CUDA >= 11.7 exports the _v2 entry points).
        self._write_value = self._stream_value_call(library, "cuStreamWriteValue32")
        self._wait_value = self._stream_value_call(library, "cuStreamWaitValue32")
        self.has_stream_memory_operations = None not in (self._write_value, self._wait_value)

    @staticmethod
    def _stream_value_call(library, name: str):
        for symbol in (name + "_v2", name):
            function = getattr(library, symbol, None)
            if function is not None:
                function.restype = ctypes.c_int
                function.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_uint32,
                                     ctypes.c_uint]
                return function
        return None

    def stream_write_value32(self, stream: int, address: int, value: int) -> None:
        """Queues on STREAM: write VALUE to the 32-bit word at ADDRESS (after the stream's
        earlier work)."""
        self._check(self._write_value(stream, address, value, 0), "cuStreamWriteValue32")

    def stream_wait_value32(self, stream: int, address: int, value: int) -> None:
        """Queues on STREAM: wait until the 32-bit word at ADDRESS is >= VALUE
        (CU_STREAM_WAIT_VALUE_GEQ)."""
        self._check(self._wait_value(stream, address, value, 0), "cuStreamWaitValue32")

    def _check(self, status: int, call: str) -> None:
        if status != _CUDA_SUCCESS:
            raise RuntimeError(f"{call} failed: {self.error_name(status)}")

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._error_name(code, ctypes.byref(name)) == _CUDA_SUCCESS and name.value:
            return f"{name.value.decode()} ({code})"
        return f"CUresult {code}"

    def allocation(self, address: int) -> Allocation:
        """The allocation holding ADDRESS (one cuPointerGetAttributes call)."""
        buffer_id, base, size = ctypes.c_ulonglong(), ctypes.c_ulonglong(), ctypes.c_size_t()
        device, capable = ctypes.c_int(-1), ctypes.c_int(0)  # a C bool is written into `capable`
        values = (ctypes.c_void_p * 5)(*(ctypes.addressof(v)
                                         for v in (buffer_id, device, capable, base, size)))
        status = self._get_attributes(5, self._kinds, values, address)
        if status != _CUDA_SUCCESS or base.value == 0 or size.value == 0:
            raise ValueError(f"zero_copy: the CUDA driver does not know the allocation of address "
                             f"{address:#x} ({self.error_name(status)})")
        if not capable.value & 0xFF:
            raise ValueError("zero_copy with CUDA tensors needs cudaMalloc'd memory: this "
                             "tensor lives in memory without a CUDA IPC handle (e.g. an expandable "
                             "segment: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); turn "
                             "expandable segments off")
        return Allocation(device.value, base.value, size.value, buffer_id.value)

    def ipc_handle(self, allocation: Allocation) -> bytes:
        """The 64 bytes of the CUipcMemHandle of ALLOCATION (its base address)."""
        import torch

        handle = ctypes.create_string_buffer(_IPC_HANDLE_BYTES)
        with torch.cuda.device(allocation.device):  # makes the device's context current here
            status = self._ipc_handle(handle, allocation.base)
        if status != _CUDA_SUCCESS:
            raise ValueError(f"zero_copy: cuIpcGetMemHandle of the allocation at "
                             f"{allocation.base:#x} failed: {self.error_name(status)}")
        return handle.raw


def torch_segment_addresses(device: int) -> list:
    """The base addresses of the segments torch's caching allocator holds on DEVICE."""
    import torch

    return [int(segment["address"]) for segment in torch.cuda.memory_snapshot()
            if int(segment["device"]) == device]


def default_driver() -> Optional[_Driver]:
    """libcuda's calls, or None when this process cannot load libcuda."""
    try:
        return _Driver()
    except OSError:
        return None


class CudaRegionCache:
    """The CUDA IPC regions a client has registered: one per GPU allocation, by (device, buffer
    id). REGISTER (handle bytes, device, offset, size) -> region id and UNREGISTER (region id) are
    the client's RPCs; LOCATE (address) -> Allocation and IPC_HANDLE (Allocation) -> bytes are the
    driver's (None: libcuda's, loaded at the first lookup; stand-ins in tests)."""

    def __init__(self, register, unregister, capacity: int = 4096,
                 locate: Optional[Callable[[int], Allocation]] = None,
                 ipc_handle: Optional[Callable[[Allocation], bytes]] = None):
        self._register = register
        self._unregister = unregister
        self._given_locate = locate
        self._given_ipc_handle = ipc_handle
        self._driver: Optional[_Driver] = None
        self._capacity = max(1, int(capacity))
        self._lock = threading.Lock()
        # (device, buffer id) -> (Allocation, region id), least recently used first.
        self._regions: "collections.OrderedDict[Tuple[int, int], Tuple[Allocation, int]]" = \
            collections.OrderedDict()
        self._swept_devices = set()  # devices whose existing segments were registered at once
        self.registered = 0  # RegisterRegion calls made, over the cache's life
        self.unregistered = 0  # UnregisterRegion calls made (stale, evicted or closed)

    def __len__(self) -> int:
        with self._lock:
            return len(self._regions)

    def _cuda_driver(self) -> _Driver:
        with self._lock:
            if self._driver is None:
                self._driver = _Driver()
            return self._driver

    def _locate(self, address: int) -> Allocation:
        if self._given_locate is not None:
            return self._given_locate(address)
        return self._cuda_driver().allocation(address)

    def ipc_handle_of(self, allocation: Allocation) -> bytes:
        """The 64 bytes of ALLOCATION's CUDA IPC handle."""
        if self._given_ipc_handle is not None:
            return self._given_ipc_handle(allocation)
        return self._cuda_driver().ipc_handle(allocation)

    def allocation_of(self, tensor) -> Allocation:
        """The GPU allocation that holds TENSOR's first byte."""
        return self._locate(int(tensor.data_ptr()))

    def slice_of(self, tensor):
        """(region id, byte offset, byte size) of a contiguous CUDA tensor's bytes, its allocation
        registered when it was not yet."""
        address = int(tensor.data_ptr())
        size = tensor.numel() * tensor.element_size()
        allocation = self._locate(address)
        if address + size > allocation.base + allocation.size:
            raise ValueError(f"zero_copy: the tensor's {size} bytes at {address:#x} run past the "
                             f"end of their allocation [{allocation.base:#x}, +{allocation.size})")
        return self.region_of(allocation), address - allocation.base, size

    def register_segments_once(self, device: int, segment_addresses: Callable[[], list]) -> int:
        """At the first call for DEVICE: registers the allocations at SEGMENT_ADDRESSES() (the
        segments torch's allocator holds on it, torch_segment_addresses) that are not registered
        yet, so that the tensors of later steps, which the allocator carves from whichever
        segment is free, find theirs registered instead of paying a round trip in the middle of
        a backward. Memory that cannot be shared (expandable segments) is skipped. Returns how
        many were registered."""
        with self._lock:
            if device in self._swept_devices:
                return 0
            self._swept_devices.add(device)
        before = self.registered
        for address in segment_addresses():
            try:
                allocation = self._locate(address)
            except ValueError:
                continue
            if len(self) < self._capacity:
                self.region_of(allocation)
        return self.registered - before

    def region_of(self, allocation: Allocation) -> int:
        """The region id of ALLOCATION, registered now when it was not. Registrations of
        allocations that overlap it on its device (freed ones whose address range it reuses) are
        unregistered."""
        key = (allocation.device, allocation.buffer_id)
        with self._lock:
            known = self._regions.get(key)
            if known is not None:
                self._regions.move_to_end(key)
                return known[1]
        region = self._register(self.ipc_handle_of(allocation), allocation.device, 0,
                                allocation.size)
        stale = []
        with self._lock:
            self.registered += 1
            for other_key, (other, other_region) in list(self._regions.items()):
                if other.device == allocation.device and other_key != key and \
                        other.base < allocation.base + allocation.size and \
                        allocation.base < other.base + other.size:
                    stale.append(other_region)
                    del self._regions[other_key]
            previous = self._regions.get(key)
            if previous is not None:  # registered by another thread meanwhile: keep the first
                stale.append(region)
                region = previous[1]
            else:
                self._regions[key] = (allocation, region)
            while len(self._regions) > self._capacity:
                stale.append(self._regions.popitem(last=False)[1][1])
        self._unregister_all(stale)
        return region

    def _unregister_all(self, regions) -> None:
        for region in regions:
            self._unregister(region)
            with self._lock:
                self.unregistered += 1

    def close(self) -> None:
        with self._lock:
            regions = [region for _, region in self._regions.values()]
            self._regions = collections.OrderedDict()
        self._unregister_all(regions)
