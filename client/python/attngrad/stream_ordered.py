"""Same-host backward calls ordered by the trainer's CUDA stream instead of its CPU.

A backward over CUDA IPC otherwise runs: synchronise the tensors' stream (the server reads the
inputs as soon as the request arrives), send, wait for the answer, return. The trainer's CPU then
sits idle through the round trip and the server's compute, and the GPU idles afterwards while the
CPU launches the kernels that follow. Here a call is queued on the stream instead:

  1. The trainer's stream writes READY into a page-locked flag once the inputs are written
     (cuStreamWriteValue32), then waits until a second flag, DONE, holds the same value
     (cuStreamWaitValue32): every kernel launched after the call runs after the answer is in
     memory.
  2. The call returns at once with the tensors the server will write the answer into.
  3. A sender thread waits for READY, sends the request, receives the answer and writes DONE from
     the CPU: also when the call failed or timed out, so that the stream never waits forever.

The trainer's CPU goes on launching kernels while the server computes. A call's errors surface at
PendingBackward.result() or StreamOrderedCalls.wait_all() (the autograd bridge waits at the end of
each loss.backward()). The flags are host memory, so nothing the server does can leave the
trainer's stream blocked: only this process's sender writes DONE.

GpuOrderedCalls moves the ordering onto the GPU where the server can do it
(DeviceInfo.stream_ordered_batches, BackwardRequest.stream_order): the flags lie in the trainer's
GPU memory (a CUDA IPC region registered once), the request leaves at once, before the stream
has even written the inputs, and the server's GPU waits for READY, computes and writes DONE after
its outputs. Neither the trainer's CPU nor the gRPC round trip is on the GPU's critical path. A
receiver thread reads the answers; for a call the server will not finish (an error answer, a
broken stream, no answer within the call's timeout) it writes DONE itself, from a side stream.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import queue
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import grpc

from . import errors

SLOTS = 256  # calls that may be queued and not yet answered; a flag pair each
_UINT32 = 0xFFFFFFFF


def _reached(loaded: int, value: int) -> bool:
    """LOADED is VALUE or later, in 32-bit wrap-around order (a slot's values count up)."""
    return ((loaded - value) & _UINT32) < 0x80000000


class PendingCall:
    """One queued call: once the sender has run it, its result or error."""

    def __init__(self, on_result: Optional[Callable] = None):
        self._on_result = on_result
        self._finished = threading.Event()
        self._result = None
        self._error: Optional[BaseException] = None
        self._reported = False

    def finish(self, result, error: Optional[BaseException]) -> None:
        self._result, self._error = result, error
        self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Until the call is answered (at most TIMEOUT seconds); True when it succeeded. Its error
        is not raised here (result() and wait_all() raise it)."""
        return self._finished.wait(timeout) and self._error is None

    @property
    def reported(self) -> bool:
        """result() has returned the result or raised the error to a caller."""
        return self._reported

    def result(self, timeout: Optional[float] = None):
        """The call's result (raises its error); ON_RESULT runs once, here."""
        if not self._finished.wait(timeout):
            raise TimeoutError("the queued call has not been answered yet")
        if self._error is not None:
            self._reported = True
            raise self._error
        if not self._reported and self._on_result is not None:
            self._reported = True
            self._on_result(self._result)
        return self._result


class PendingBackward(PendingCall):
    """One queued backward: the tensors its answer goes into (usable at once in the order of the
    stream it was queued on) and, once the sender has it, its BackwardResult (whose own tensor
    fields are None: the answer is in these) or error. ORDERING: who ordered the call after the
    stream's earlier work: "gpu" (the server's GPU, GpuOrderedCalls), "host" (this process's
    sender thread, StreamOrderedCalls) or "" (answered before the call returned). A queued
    forward (Client.submit_forward) has its answer in OUTPUT instead (the others are None)."""

    def __init__(self, grad_hidden_states, weight_gradients, on_result: Optional[Callable] = None,
                 ordering: str = ""):
        super().__init__(on_result)
        self.grad_hidden_states = grad_hidden_states
        self.weight_gradients = weight_gradients
        self.output = None
        self.ordering = ordering

    @classmethod
    def completed(cls, result, on_result: Optional[Callable] = None) -> "PendingBackward":
        """A call answered synchronously (another transport): RESULT is its BackwardResult."""
        pending = cls(result.grad_hidden_states, result.weight_gradients, on_result)
        pending.output = result.output
        pending.finish(result, None)
        return pending


def clear_answer(result) -> None:
    """Drops RESULT's tensors, which a queued call's PendingBackward holds instead."""
    result.grad_hidden_states = result.weight_gradients = result.output = None


def _wait_for(outstanding: Sequence[PendingCall]) -> None:
    """Waits for every call of OUTSTANDING and raises the first one's error that no result() has
    raised yet (the others' results are reported all the same)."""
    first_error = None
    for pending in outstanding:
        raised_before = pending.reported
        try:
            pending.result()
        except BaseException as error:  # noqa: B902 - raised below, after the others
            if not raised_before:
                first_error = first_error or error
    if first_error is not None:
        raise first_error


class _Slots:
    """A ring of COUNT flag slots handed out in call order: call N takes slot N % COUNT with value
    N // COUNT + 1 (a slot's values count up from 1 and wrap around at 2**32; its words hold 0
    until its first call). A slot is handed out again only once its previous call released it,
    so a slot never has two calls in flight; calls answered out of order delay the next holder of
    a slot, never the order of the numbers."""

    def __init__(self, count: int):
        self.count = count
        self._next = 0
        self._busy = [False] * count
        self._changed = threading.Condition()

    def take(self) -> Tuple[int, int]:
        """(slot, value) of the next call; waits while that slot's previous call is in flight."""
        with self._changed:
            while self._busy[self._next % self.count]:
                self._changed.wait()
            number, self._next = self._next, self._next + 1
            slot = number % self.count
            self._busy[slot] = True
        return slot, (number // self.count + 1) & _UINT32

    def release(self, slot: int) -> None:
        with self._changed:
            self._busy[slot] = False
            self._changed.notify_all()


class _Flags:
    """Two rings of page-locked 32-bit flags, READY and DONE, one pair per slot. The GPU writes
    and waits on them through the driver's stream memory operations, the CPU with plain loads
    and stores (host memory the GPU reaches at the same address under unified addressing)."""

    def __init__(self, slots: int, memory=None):
        if memory is None:  # page-locked: the GPU reads and writes it over the bus
            import torch

            memory = torch.zeros(2 * slots, dtype=torch.int32, pin_memory=True)
            self._base = memory.data_ptr()
        else:  # a ctypes array of 2 * SLOTS uint32 (tests without a GPU)
            self._base = ctypes.addressof(memory)
        self._memory = memory
        self._slots = slots

    def ready(self, slot: int) -> int:
        return self._base + 4 * slot

    def done(self, slot: int) -> int:
        return self._base + 4 * (self._slots + slot)

    @staticmethod
    def load(address: int) -> int:
        return ctypes.c_uint32.from_address(address).value

    @staticmethod
    def store(address: int, value: int) -> None:
        ctypes.c_uint32.from_address(address).value = value


class StreamOrderedCalls:
    """A client's queued backward calls and the sender thread that answers them in order.

    SEND(batch, timeout, phases) -> BackwardResult is the client's blocking exchange; DRIVER has
    stream_write_value32 / stream_wait_value32 (cuda_regions._Driver); FLAG_MEMORY: None
    (page-locked memory) or a ctypes array of 2 * SLOTS uint32."""

    def __init__(self, send: Callable, driver, slots: int = SLOTS, flag_memory=None):
        self._send = send
        self._driver = driver
        self._flags = _Flags(slots, flag_memory)
        self._slots = _Slots(slots)
        self._queue: "queue.Queue" = queue.Queue()
        self._outstanding: List[PendingCall] = []
        self._tasks: List[PendingCall] = []  # submit_task's calls not yet seen answered
        self._lock = threading.Lock()
        self._sender = threading.Thread(target=self._run, name="attngrad-stream-ordered",
                                        daemon=True)
        self._sender.start()

    @property
    def driver(self):
        return self._driver

    def submit(self, batch, stream_handle: int, answer, weight_gradients, kept, timeout, phases,
               on_result: Optional[Callable] = None, before_send: Optional[Callable] = None,
               on_queued: Optional[Callable] = None) -> PendingBackward:
        """Queues BATCH (its CUDA IPC layout resolved) on the stream STREAM_HANDLE: the stream
        signals READY, then waits for DONE. ANSWER / WEIGHT_GRADIENTS: the tensors the server
        writes (returned in the PendingBackward); KEPT: tensors to keep alive until answered.
        BEFORE_SEND(ordered=True) runs in the sender once READY is reached, right before the batch
        is sent (it may still change the batch's request fields). ON_QUEUED(pending) runs in this
        thread once the stream's wait is queued, before the sender may touch the call (kernels it
        launches on the stream see the answer)."""
        pending = PendingBackward(answer, weight_gradients, on_result, ordering="host")

        def run():
            if before_send is not None:
                before_send(True)
            phases.mark("synchronize")
            result = self._send(batch, timeout, phases)
            clear_answer(result)  # in PENDING
            result.ordering = "host"
            return result

        self._queue_call(pending, stream_handle, run, kept, timeout, wait_for_done=True,
                         on_queued=on_queued)
        return pending

    def submit_task(self, stream_handle: int, task: Callable, timeout: Optional[float],
                    on_result: Optional[Callable] = None) -> PendingCall:
        """Queues TASK() to run in the sender once the stream STREAM_HANDLE has passed this
        point (what it launched before is done); the stream does not wait for it. Tasks and
        backward calls run in the order they were queued."""
        pending = PendingCall(on_result)
        self._queue_call(pending, stream_handle, task, None, timeout, wait_for_done=False)
        with self._lock:
            self._tasks.append(pending)
        return pending

    def _queue_call(self, pending: PendingCall, stream_handle: int, run: Callable, kept, timeout,
                    wait_for_done: bool, on_queued: Optional[Callable] = None) -> None:
        slot, value = self._slots.take()
        try:
            self._driver.stream_write_value32(stream_handle, self._flags.ready(slot), value)
            if wait_for_done:
                self._driver.stream_wait_value32(stream_handle, self._flags.done(slot), value)
            if on_queued is not None:
                on_queued(pending)
        except BaseException:
            # Nothing queued, or a wait the sender can never release: write DONE now.
            self._flags.store(self._flags.done(slot), value)
            self._slots.release(slot)
            raise
        with self._lock:
            self._outstanding.append(pending)
        self._queue.put((pending, run, kept, slot, value, timeout))

    def wait_for_tasks(self) -> bool:
        """Waits for the tasks (submit_task) queued so far, not for the backward calls queued
        among them; True when each succeeded (a failed task's error is raised by wait_all all the
        same)."""
        with self._lock:
            tasks = list(self._tasks)
        succeeded = all([task.wait() for task in tasks])
        with self._lock:  # those queued meanwhile stay, for the next call
            waited = set(map(id, tasks))
            self._tasks = [task for task in self._tasks if id(task) not in waited]
        return succeeded

    def wait_all(self) -> None:
        """Waits for every call and task queued so far and raises the first one's error (the
        others' results are reported all the same)."""
        with self._lock:
            outstanding, self._outstanding = self._outstanding, []
        _wait_for(outstanding)

    def close(self) -> None:
        self._queue.put(None)
        self._sender.join(timeout=30)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            pending, run, kept, slot, value, timeout = item
            try:
                self._wait_until_ready(slot, value, timeout)
                pending.finish(run(), None)
            except BaseException as error:  # noqa: B902 - handed to the caller's thread
                pending.finish(None, error)
            finally:
                self._flags.store(self._flags.done(slot), value)
                del item, pending, run, kept  # the call's tensors may go now
                self._slots.release(slot)

    def _wait_until_ready(self, slot: int, value: int, timeout: Optional[float]) -> None:
        """Until the stream has passed the call's READY write (its inputs are written)."""
        address = self._flags.ready(slot)
        deadline = None if timeout is None else time.monotonic() + timeout
        polls = 0
        while not _reached(self._flags.load(address), value):
            polls += 1
            time.sleep(0 if polls < 64 else 20e-6)  # both give the GIL away
            if deadline is not None and polls % 256 == 0 and time.monotonic() > deadline:
                raise TimeoutError(f"the trainer's stream did not reach the queued backward's "
                                   f"inputs within {timeout} s")


# ------------------------------------------------------------------------------------------------
# Calls ordered on the GPU by the server (BackwardRequest.stream_order)

_SLOT_BYTES = 32  # a slot's READY word at its byte 0 and its DONE word at byte 16: every CUDA IPC
_DONE_OFFSET = 16  # slice's offset must be a multiple of 16
_ALIGNMENT = 16


@dataclasses.dataclass(frozen=True)
class StreamOrder:
    """BackwardRequest.stream_order of one request as plain values: the READY and DONE words (4
    bytes each, at these byte offsets of the region REGION_ID) and the VALUE the stream writes
    into READY and waits for in DONE."""
    region_id: int
    ready_offset: int
    done_offset: int
    value: int


class _DeviceFlags:
    """One device's READY/DONE words: SLOTS * 32 bytes of its GPU memory at ADDRESS (MEMORY, kept
    for the client's life: the server writes into it), their slots handed out in call order."""

    def __init__(self, memory, address: int, slots: int):
        self.memory = memory
        self.address = address
        self.slots = _Slots(slots)

    def ready(self, slot: int) -> int:
        return self.address + _SLOT_BYTES * slot

    def done(self, slot: int) -> int:
        return self.ready(slot) + _DONE_OFFSET


class TorchDevices:
    """What GpuOrderedCalls does on the GPUs, through PyTorch (tests pass stand-ins)."""

    @staticmethod
    def flag_memory(device: int, byte_size: int):
        """(memory, its address): BYTE_SIZE zeroed bytes on DEVICE, the zeros written (on a side
        stream, waited for) before any call names them: the server must not take a stale word for
        a READY. The side stream is not the current one, which may be waiting for a call."""
        import torch

        side = torch.cuda.Stream(device=device)
        while side.cuda_stream == torch.cuda.current_stream(device).cuda_stream:
            side = torch.cuda.Stream(device=device)  # PyTorch's pool handed out the current one
        with torch.cuda.device(device), torch.cuda.stream(side):
            memory = torch.zeros(byte_size // 4, dtype=torch.int32, device=f"cuda:{device}")
        side.synchronize()
        return memory, int(memory.data_ptr())

    @staticmethod
    def side_stream(device: int):
        """A stream of DEVICE that does not wait for the legacy default stream (PyTorch creates
        its streams with cudaStreamNonBlocking): .cuda_stream, its handle; .synchronize()."""
        import torch

        return torch.cuda.Stream(device=device)

    @staticmethod
    def current(device: int):
        """A context in which DEVICE is the current device (the driver's calls use its context)."""
        import torch

        return torch.cuda.device(device)


class _HostWrites:
    """DONE words written from the host, for calls the server will not finish. Each write is
    queued with the driver on a side stream of the word's device and only that stream is
    synchronised: never the legacy default stream, which would wait for the trainer's stream
    (itself waiting for the word), nor a stream a call was queued on (PyTorch hands its streams
    out of a small pool, so a new one may be the trainer's)."""

    _DRAWS = 64  # PyTorch's pool holds 32 streams per device and priority

    def __init__(self, driver, devices):
        self._driver = driver
        self._devices = devices
        self._lock = threading.Lock()
        self._side_streams: Dict[int, Any] = {}
        self._call_streams: Dict[int, set] = collections.defaultdict(set)

    def note_call_stream(self, device: int, handle: int) -> None:
        """Calls are queued on the stream HANDLE of DEVICE: it is never a side stream."""
        with self._lock:
            self._call_streams[device].add(handle)
            side = self._side_streams.get(device)
            if side is not None and int(side.cuda_stream) == handle:
                del self._side_streams[device]

    def write(self, device: int, address: int, value: int) -> None:
        """Writes VALUE into the word at ADDRESS of DEVICE and waits until it is written."""
        with self._devices.current(device):
            side = self._side_stream(device)
            self._driver.stream_write_value32(int(side.cuda_stream), address, value)
            side.synchronize()

    def _side_stream(self, device: int):
        with self._lock:
            side = self._side_streams.get(device)
            for _ in range(self._DRAWS):
                if side is not None:
                    return side
                candidate = self._devices.side_stream(device)
                handle = int(candidate.cuda_stream)
                if handle != 0 and handle not in self._call_streams[device]:
                    side = self._side_streams[device] = candidate
            if side is None:
                raise RuntimeError(f"no side stream of device {device} that no call waits on")
            return side


class _GpuCall:
    """A sent GPU-ordered call: its PendingBackward and request, the device, flags and (slot,
    value) of each of its parts, the tensors kept alive until every part is answered (the server
    writes into them until then), and its watchdog entry."""

    def __init__(self, pending: PendingBackward, request, device: int, flags: _DeviceFlags,
                 words: List[Tuple[int, int]], kept):
        self.pending = pending
        self.request = request
        self.part_ids = list(request.part_ids)
        self.device = device
        self.flags = flags
        self.words = words
        self.kept = kept
        self.unanswered = set(range(len(words)))  # parts whose slots this call still holds
        self.failed = False
        self.watch = None


class _OrderedStream:
    """A Backward stream of GPU-ordered calls: the calls whose answers are due on it, by the batch
    id of each part, and the thread that reads the answers."""

    def __init__(self, stream):
        self.stream = stream
        self.due: Dict[int, _GpuCall] = {}
        self.thread: Optional[threading.Thread] = None


class GpuOrderedCalls:
    """A client's backward calls ordered on the GPU by the server (BackwardRequest.stream_order).

    OPEN_STREAM() -> a new Backward stream (client._BackwardStream: send(bytes) queues a request
    without blocking, receive() returns the next answer or raises, close(wait)); DRIVER has
    stream_write_value32 / stream_wait_value32 (cuda_regions._Driver); LOCATE(memory) -> (region
    id, byte offset, byte size) registers the flags (CudaRegionCache.slice_of; asked at every
    call, so the flags follow a cache that registers everything anew); WATCHDOG: the client's
    _Watchdog (cancels the stream of a call past its deadline); TASKS: the StreamOrderedCalls
    whose tasks (weight uploads) a call waits for before it is sent; DEVICES: the GPU side
    (TorchDevices). A stream that breaks fails every call still due on it; the next call opens
    another."""

    def __init__(self, open_stream: Callable, driver, locate: Callable, *, watchdog=None,
                 tasks: Optional[StreamOrderedCalls] = None, slots: int = SLOTS, devices=None):
        self._open_stream = open_stream
        self._driver = driver
        self._locate = locate
        self._watchdog = watchdog
        self._tasks = tasks
        self._slot_count = slots
        self._devices = devices if devices is not None else TorchDevices()
        self._host_writes = _HostWrites(driver, self._devices)
        self._flags: Dict[int, _DeviceFlags] = {}
        self._current: Optional[_OrderedStream] = None
        self._outstanding: List[PendingBackward] = []
        # The tensors of calls failed unanswered (a broken stream, a timeout): kept until close(),
        # since the server may still compute such a call once the stream reaches it.
        self._orphaned_tensors: List[Any] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, request, device: int, stream_handle: int, kept, timeout: Optional[float],
               on_result: Optional[Callable] = None, before_send: Optional[Callable] = None,
               on_queued: Optional[Callable] = None) -> PendingBackward:
        """Queues REQUEST on the stream STREAM_HANDLE of DEVICE and sends it now. REQUEST has
        part_ids (the batch id of each request it goes as), encode(part index, StreamOrder) ->
        bytes, add(response) (raises a part's in-band error) and result() (the BackwardResult once
        every part is answered). The call first waits for the tasks queued before it, then runs
        BEFORE_SEND(ordered) (ORDERED: those tasks all succeeded); ON_QUEUED(pending) runs once the
        stream's waits are queued, before the request leaves. KEPT: tensors to keep alive until
        the call is answered; TIMEOUT: seconds (None: no deadline)."""
        ordered = self._tasks.wait_for_tasks() if self._tasks is not None else True
        if before_send is not None:
            before_send(ordered)
        flags = self._flags_of(device)
        region_id, offset, _ = self._locate(flags.memory)
        if offset % _ALIGNMENT:
            raise ValueError(f"the flags of device {device} lie at offset {offset} of their "
                             f"region, not a multiple of {_ALIGNMENT}")
        pending = PendingBackward(None, None, on_result, ordering="gpu")
        call = _GpuCall(pending, request, device, flags,
                        [flags.slots.take() for _ in request.part_ids], kept)
        try:
            payloads = [request.encode(index, self._order(region_id, offset, slot, value))
                        for index, (slot, value) in enumerate(call.words)]
            self._queue_on_stream(call, stream_handle)
            if on_queued is not None:
                on_queued(pending)
            self._send(call, payloads, timeout)
        except BaseException as error:
            self._abandon(call, error)  # nothing sent: no server writes its DONE
            raise
        return pending

    @staticmethod
    def _order(region_id: int, offset: int, slot: int, value: int) -> StreamOrder:
        ready = offset + _SLOT_BYTES * slot
        return StreamOrder(region_id, ready, ready + _DONE_OFFSET, value)

    def _flags_of(self, device: int) -> _DeviceFlags:
        with self._lock:
            flags = self._flags.get(device)
        if flags is None:
            memory, address = self._devices.flag_memory(device, self._slot_count * _SLOT_BYTES)
            with self._lock:
                flags = self._flags.setdefault(device,
                                               _DeviceFlags(memory, address, self._slot_count))
        return flags

    def _queue_on_stream(self, call: _GpuCall, stream_handle: int) -> None:
        """The stream writes each part's READY, then waits for each part's DONE."""
        self._host_writes.note_call_stream(call.device, stream_handle)
        for slot, value in call.words:
            self._driver.stream_write_value32(stream_handle, call.flags.ready(slot), value)
        for slot, value in call.words:
            self._driver.stream_wait_value32(stream_handle, call.flags.done(slot), value)

    def _send(self, call: _GpuCall, payloads: List[bytes], timeout: Optional[float]) -> None:
        """CALL's requests on the calls' stream (opened when there is none), its answers due."""
        with self._lock:
            if self._closed:
                raise ValueError("the client is closed")
            ordered = self._stream_for_calls()
            in_flight = [part_id for part_id in call.part_ids if part_id in ordered.due]
            if in_flight:
                raise ValueError(f"batch id(s) {in_flight} already have a call in flight")
            for part_id in call.part_ids:
                ordered.due[part_id] = call
            self._outstanding.append(call.pending)
            if timeout is not None and self._watchdog is not None:
                call.watch = self._watchdog.watch(time.monotonic() + timeout, ordered.stream)
            for payload in payloads:
                ordered.stream.send(payload)

    def _stream_for_calls(self) -> _OrderedStream:
        """The open stream, or a new one and its receiver thread (under the lock)."""
        if self._current is None:
            ordered = _OrderedStream(self._open_stream())
            ordered.thread = threading.Thread(target=self._receive, args=(ordered,),
                                              name="attngrad-gpu-ordered", daemon=True)
            ordered.thread.start()
            self._current = ordered
        return self._current

    def _receive(self, ordered: _OrderedStream) -> None:
        """Reads ORDERED's answers until the stream ends or breaks."""
        while True:
            try:
                response = ordered.stream.receive()
            except BaseException as raised:  # noqa: B902 - the error of the calls still due
                # A stream that broke raises client._StreamBroken, whose .error is the one to
                # raise; one past a call's deadline raises DeadlineExceededError itself.
                self._end(ordered, getattr(raised, "error", raised))
                return
            if not self._take_answer(ordered, response):
                return

    def _take_answer(self, ordered: _OrderedStream, response) -> bool:
        """Hands RESPONSE to its call; False when no call was due it (the stream is then out of
        step: cancelled, and the calls still due fail)."""
        with self._lock:
            call = ordered.due.pop(response.batch_id, None)
        if call is None:
            self._end(ordered, errors.AttngradError(
                grpc.StatusCode.INTERNAL, f"the server answered unknown batch id "
                f"{response.batch_id}", method="Backward"))
            return False
        index = call.part_ids.index(response.batch_id)
        try:
            call.request.add(response)
        except BaseException as error:  # noqa: B902 - handed to the caller's thread
            self._fail(call, error)
        self._part_answered(call, index)
        return True

    def _end(self, ordered: _OrderedStream, error: BaseException) -> None:
        """ORDERED's stream ended or broke: every call still due on it fails, and the next call
        opens another stream."""
        with self._lock:
            if self._current is ordered:
                self._current = None
            calls = list({id(call): call for call in ordered.due.values()}.values())
            ordered.due.clear()
            self._orphaned_tensors += [call.kept for call in calls]
        ordered.stream.close(wait=0)  # cancelled, if it was not over
        for call in calls:
            self._abandon(call, error)

    def _abandon(self, call: _GpuCall, error: BaseException) -> None:
        """No answer will come for CALL's unanswered parts: it fails and its slots go back."""
        self._fail(call, error)
        for index in list(call.unanswered):
            self._part_answered(call, index)

    def _fail(self, call: _GpuCall, error: BaseException) -> None:
        """CALL will not be finished by the server: its DONE words are written here, then its
        error goes to its PendingBackward (raised by result() and wait_all())."""
        if call.failed:
            return
        call.failed = True
        self._release_stream(call)
        call.pending.finish(None, error)

    def _release_stream(self, call: _GpuCall) -> None:
        """Writes DONE for each part whose slot CALL still holds (the server may not; a released
        slot may have a later call, whose words must not go back)."""
        for index in sorted(call.unanswered):
            slot, value = call.words[index]
            try:
                self._host_writes.write(call.device, call.flags.done(slot), value)
            except Exception as error:  # noqa: B902 - the call's own error is what is raised
                warnings.warn(f"attngrad: writing DONE of slot {slot} of device {call.device} "
                              f"failed ({error}); the stream may wait for it forever",
                              RuntimeWarning)

    def _part_answered(self, call: _GpuCall, index: int) -> None:
        """Part INDEX of CALL is over: its slot goes back; after the last part the call is
        finished and its tensors may go."""
        call.unanswered.discard(index)
        call.flags.slots.release(call.words[index][0])
        if call.unanswered:
            return
        if call.watch is not None:
            self._watchdog.done(call.watch)
        if not call.failed:
            try:
                call.pending.finish(call.request.result(), None)
            except BaseException as error:  # noqa: B902 - the server wrote every DONE already
                call.pending.finish(None, error)
        call.kept = call.request = None

    def wait_all(self) -> None:
        """Waits for every call submitted so far and raises the first one's error."""
        with self._lock:
            outstanding, self._outstanding = self._outstanding, []
        _wait_for(outstanding)

    def close(self, wait: float = 30.0) -> None:
        """Waits up to WAIT seconds for the calls in flight, then closes the stream (calls still
        unanswered then fail, their DONE written here)."""
        with self._lock:
            self._closed = True
            outstanding = list(self._outstanding)
            ordered = self._current
        deadline = time.monotonic() + wait
        for pending in outstanding:
            pending.wait(max(0.0, deadline - time.monotonic()))
        if ordered is not None:
            ordered.stream.close()
            ordered.thread.join(timeout=wait)
        with self._lock:
            self._orphaned_tensors = []


def stream_handle_of(tensor) -> int:
    """The raw handle of the current CUDA stream of TENSOR's device."""
    import torch

    return int(torch.cuda.current_stream(tensor.device).cuda_stream)


def is_supported(driver: Any) -> bool:
    return driver is not None and getattr(driver, "has_stream_memory_operations", False)
