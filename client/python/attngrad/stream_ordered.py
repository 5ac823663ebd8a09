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
"""
from __future__ import annotations

import ctypes
import itertools
import queue
import threading
import time
from typing import Any, Callable, List, Optional

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

    def result(self, timeout: Optional[float] = None):
        """The call's result (raises its error); ON_RESULT runs once, here."""
        if not self._finished.wait(timeout):
            raise TimeoutError("the queued call has not been answered yet")
        if self._error is not None:
            raise self._error
        if not self._reported and self._on_result is not None:
            self._reported = True
            self._on_result(self._result)
        return self._result


class PendingBackward(PendingCall):
    """One queued backward: the tensors its answer goes into (usable at once in the order of the
    stream it was queued on) and, once the sender has it, its BackwardResult (whose own tensor
    fields are None: the answer is in these) or error."""

    def __init__(self, grad_hidden_states, weight_gradients, on_result: Optional[Callable] = None):
        super().__init__(on_result)
        self.grad_hidden_states = grad_hidden_states
        self.weight_gradients = weight_gradients

    @classmethod
    def completed(cls, result, on_result: Optional[Callable] = None) -> "PendingBackward":
        """A call answered synchronously (another transport): RESULT is its BackwardResult."""
        pending = cls(result.grad_hidden_states, result.weight_gradients, on_result)
        pending.finish(result, None)
        return pending


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
        self._slots = slots
        self._numbers = itertools.count()
        self._free_slots = threading.Semaphore(slots)
        self._queue: "queue.Queue" = queue.Queue()
        self._outstanding: List[PendingCall] = []
        self._lock = threading.Lock()
        self._sender = threading.Thread(target=self._run, name="attngrad-stream-ordered",
                                        daemon=True)
        self._sender.start()

    def submit(self, batch, stream_handle: int, answer, weight_gradients, kept, timeout, phases,
               on_result: Optional[Callable] = None,
               before_send: Optional[Callable] = None) -> PendingBackward:
        """Queues BATCH (its CUDA IPC layout resolved) on the stream STREAM_HANDLE: the stream
        signals READY, then waits for DONE. ANSWER / WEIGHT_GRADIENTS: the tensors the server
        writes (returned in the PendingBackward); KEPT: tensors to keep alive until answered.
        BEFORE_SEND(batch) runs in the sender once READY is reached, right before the batch is
        sent (it may still change the batch's request fields)."""
        pending = PendingBackward(answer, weight_gradients, on_result)

        def run():
            if before_send is not None:
                before_send(batch)
            phases.mark("synchronize")
            result = self._send(batch, timeout, phases)
            result.grad_hidden_states = result.weight_gradients = None  # in PENDING
            return result

        self._queue_call(pending, stream_handle, run, kept, timeout, wait_for_done=True)
        return pending

    def submit_task(self, stream_handle: int, task: Callable, timeout: Optional[float],
                    on_result: Optional[Callable] = None) -> PendingCall:
        """Queues TASK() to run in the sender once the stream STREAM_HANDLE has passed this
        point (what it launched before is done); the stream does not wait for it. Tasks and
        backward calls run in the order they were queued."""
        pending = PendingCall(on_result)
        self._queue_call(pending, stream_handle, task, None, timeout, wait_for_done=False)
        return pending

    def _queue_call(self, pending: PendingCall, stream_handle: int, run: Callable, kept, timeout,
                    wait_for_done: bool) -> None:
        self._free_slots.acquire()
        number = next(self._numbers)
        slot, value = number % self._slots, (number // self._slots + 1) & _UINT32
        try:
            self._driver.stream_write_value32(stream_handle, self._flags.ready(slot), value)
            if wait_for_done:
                self._driver.stream_wait_value32(stream_handle, self._flags.done(slot), value)
        except BaseException:
            # Nothing queued, or a wait the sender can never release: write DONE now.
            self._flags.store(self._flags.done(slot), value)
            self._free_slots.release()
            raise
        with self._lock:
            self._outstanding.append(pending)
        self._queue.put((pending, run, kept, slot, value, timeout))

    def wait_all(self) -> None:
        """Waits for every call and task queued so far and raises the first one's error (the
        others' results are reported all the same)."""
        with self._lock:
            outstanding, self._outstanding = self._outstanding, []
        first_error = None
        for pending in outstanding:
            try:
                pending.result()
            except BaseException as error:  # noqa: B902 - raised below, after the others
                first_error = first_error or error
        if first_error is not None:
            raise first_error

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
                self._free_slots.release()

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


def stream_handle_of(tensor) -> int:
    """The raw handle of the current CUDA stream of TENSOR's device."""
    import torch

    return int(torch.cuda.current_stream(tensor.device).cuda_stream)


def is_supported(driver: Any) -> bool:
    return driver is not None and getattr(driver, "has_stream_memory_operations", False)
