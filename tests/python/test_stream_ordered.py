"""attngrad.stream_ordered without a GPU: the trainer's stream is a stand-in that runs its queued
flag writes when told to (as a GPU reaches them) and records its waits. The sender sends a call
only after the stream has reached the call's READY write; it writes DONE after the answer, and also
after a failure (so that the stream never waits forever); errors surface at result() and
wait_all(), after every call was waited for; on_result runs in the caller's thread; slots are
reused in order. (With a GPU, test_cuda_ipc.py runs the real driver and server.)"""
from __future__ import annotations

import ctypes
import threading
import time
import unittest

import attngrad_testing  # noqa: F401 - puts client/python on sys.path

from attngrad import stream_ordered

SLOTS = 4


class FakeStream:
    """cuStreamWriteValue32 / cuStreamWaitValue32 of one stream: writes are queued until run()."""

    def __init__(self):
        self.queued_writes = []
        self.waits = []
        self.lock = threading.Lock()

    def stream_write_value32(self, stream: int, address: int, value: int) -> None:
        with self.lock:
            self.queued_writes.append((address, value))

    def stream_wait_value32(self, stream: int, address: int, value: int) -> None:
        with self.lock:
            self.waits.append((address, value))

    def run(self) -> None:
        """The GPU reaches every write queued so far."""
        with self.lock:
            writes, self.queued_writes = self.queued_writes, []
        for address, value in writes:
            ctypes.c_uint32.from_address(address).value = value


def load(address: int) -> int:
    return ctypes.c_uint32.from_address(address).value


class StreamOrderedCallsTest(unittest.TestCase):
    def setUp(self):
        self.stream = FakeStream()
        self.sent = []
        self.refused = set()
        self.memory = (ctypes.c_uint32 * (2 * SLOTS))()

        def send(batch, timeout, phases):
            self.sent.append(batch)
            if batch in self.refused:
                raise RuntimeError(f"server refused {batch}")
            return Result(f"result of {batch}")

        self.calls = stream_ordered.StreamOrderedCalls(send, self.stream, slots=SLOTS,
                                                       flag_memory=self.memory)

    def tearDown(self):
        self.calls.close()

    def submit(self, batch, on_result=None):
        return self.calls.submit(batch, 0, f"answer of {batch}", None, [], 5.0,
                                 _NoPhases(), on_result=on_result)

    def wait_for(self, condition, seconds=5.0):
        deadline = time.monotonic() + seconds
        while not condition():
            self.assertLess(time.monotonic(), deadline, "timed out")
            time.sleep(0.001)

    def test_a_call_is_sent_only_after_the_stream_reached_its_inputs(self):
        pending = self.submit("b1")
        self.assertEqual(pending.grad_hidden_states, "answer of b1")  # returned at once
        time.sleep(0.05)
        self.assertEqual(self.sent, [], "sent before the stream wrote READY")
        self.assertFalse(pending.done())
        self.stream.run()
        self.assertEqual(pending.result(timeout=5).name, "result of b1")
        self.assertEqual(self.sent, ["b1"])
        (done_address, value), = self.stream.waits
        self.assertEqual(load(done_address), value, "DONE not written after the answer")

    def test_a_failed_call_still_releases_the_stream_and_raises_at_wait_all(self):
        self.refused.add("bad")
        reported = []
        first = self.submit("bad")
        second = self.submit("good", on_result=lambda result: reported.append(result.name))
        self.stream.run()
        with self.assertRaisesRegex(RuntimeError, "server refused bad"):
            self.calls.wait_all()
        for address, value in self.stream.waits:
            self.assertEqual(load(address), value, "a wait of the stream was never released")
        self.assertTrue(first.done())
        self.assertEqual(reported, ["result of good"], "the later call was not reported")
        self.assertEqual(second.result().name, "result of good")
        self.assertEqual(reported, ["result of good"], "on_result ran twice")

    def test_slots_are_reused_in_order_with_counting_values(self):
        results = []
        for index in range(3 * SLOTS):
            results.append(self.submit(f"b{index}"))
            self.stream.run()
        self.calls.wait_all()
        self.assertEqual(self.sent, [f"b{i}" for i in range(3 * SLOTS)])
        addresses = {address for address, _ in self.stream.waits}
        self.assertEqual(len(addresses), SLOTS)
        values = [value for _, value in self.stream.waits]
        self.assertEqual(values, [1] * SLOTS + [2] * SLOTS + [3] * SLOTS)

    def test_a_task_runs_in_order_with_the_calls_and_the_stream_does_not_wait_for_it(self):
        first = self.submit("b1")
        task = self.calls.submit_task(0, lambda: self.sent.append("task") or 7, 5.0)
        second = self.submit("b2")
        self.stream.run()
        self.calls.wait_all()
        self.assertEqual(task.result(), 7)
        self.assertEqual((first.result().name, second.result().name),
                         ("result of b1", "result of b2"))
        self.assertEqual(self.sent, ["b1", "task", "b2"])
        self.assertEqual(len(self.stream.waits), 2, "the stream waits for the task")
        self.assertIsNone(first.result().grad_hidden_states, "the result keeps the tensors")

    def test_the_ready_wait_times_out_and_releases_the_stream(self):
        calls = stream_ordered.StreamOrderedCalls(
            lambda batch, timeout, phases: "never", self.stream, slots=SLOTS,
            flag_memory=(ctypes.c_uint32 * (2 * SLOTS))())
        try:
            pending = calls.submit("stuck", 0, None, None, [], 0.05, _NoPhases())
            with self.assertRaisesRegex(TimeoutError, "did not reach"):
                pending.result(timeout=5)
            (done_address, value), = self.stream.waits
            self.assertEqual(load(done_address), value)
        finally:
            calls.close()

    def test_on_queued_runs_before_the_sender_may_touch_the_call(self):
        marks = []
        pending = self.calls.submit("b1", 0, None, None, [], 5.0, _NoPhases(),
                                    on_queued=lambda queued: marks.append(queued))
        self.assertEqual(marks, [pending], "on_queued did not run in the submitting thread")
        self.assertEqual(len(self.stream.waits), 1)
        self.stream.run()
        result = pending.result(timeout=5)
        self.assertEqual((pending.ordering, result.ordering), ("host", "host"))

    def test_before_send_is_told_the_call_is_ordered(self):
        seen = []
        pending = self.calls.submit("b1", 0, None, None, [], 5.0, _NoPhases(),
                                    before_send=seen.append)
        self.assertEqual(seen, [], "before_send ran before the stream reached the call")
        self.stream.run()
        pending.result(timeout=5)
        self.assertEqual(seen, [True])

    def test_wait_for_tasks_waits_for_the_tasks_queued_so_far(self):
        outcomes = []

        def failing():
            raise RuntimeError("upload refused")

        self.calls.submit_task(0, lambda: "uploaded", 5.0)
        waiter = threading.Thread(target=lambda: outcomes.append(self.calls.wait_for_tasks()))
        waiter.start()
        time.sleep(0.05)
        self.assertEqual(outcomes, [], "returned before the stream reached the task")
        self.stream.run()
        waiter.join(5)
        self.assertEqual(outcomes, [True])
        self.assertTrue(self.calls.wait_for_tasks(), "waited for a task twice")
        self.calls.submit_task(0, failing, 5.0)
        self.stream.run()
        self.assertFalse(self.calls.wait_for_tasks())
        with self.assertRaisesRegex(RuntimeError, "upload refused"):
            self.calls.wait_all()

    def test_an_error_already_raised_by_result_is_not_raised_again_by_wait_all(self):
        self.refused.add("bad")
        pending = self.submit("bad")
        self.stream.run()
        with self.assertRaisesRegex(RuntimeError, "server refused bad"):
            pending.result(timeout=5)
        self.calls.wait_all()

    def test_wraparound_order(self):
        self.assertTrue(stream_ordered._reached(5, 5))
        self.assertTrue(stream_ordered._reached(6, 5))
        self.assertFalse(stream_ordered._reached(4, 5))
        self.assertTrue(stream_ordered._reached(1, 0xFFFFFFFF))  # counted past the wrap


class Result:
    """What the client's exchange returns: a BackwardResult's tensor fields and a name."""

    def __init__(self, name: str):
        self.name = name
        self.grad_hidden_states = self.weight_gradients = "tensors"


class _NoPhases:
    def mark(self, name: str) -> None:
        pass


if __name__ == "__main__":
    unittest.main()
