"""attngrad.stream_ordered.GpuOrderedCalls without a GPU. The trainer's stream and the side
streams are simulated in Python (their flag writes and waits run when the test says the GPU reaches
them, on words of host memory); the server is an in-process gRPC server of the generated servicer
whose Backward hands each request to the test as it arrives, and the test plays the server's GPU
(it waits for READY, writes DONE, answers) or makes it fail. The client side is the real one: its
Backward stream, watchdog, request encoding and answer decoding. (With a GPU, test_cuda_ipc.py runs
the real driver and server.)"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import gc
import itertools
import os
import queue
import threading
import time
import unittest
import unittest.mock
import weakref

import grpc
import numpy as np

import attngrad_testing  # noqa: F401 - puts client/python on sys.path

from attngrad import client as client_module
from attngrad import errors, stream_ordered

try:
    import torch
except ImportError:
    torch = None

pb, pb_grpc = client_module.pb, client_module.pb_grpc

TRAINER = 7  # the handle of the trainer's stream on GPU 0
TRAINER_ON_GPU_1 = 8
SLOTS = 4
REGION, REGION_OFFSET = 77, 512  # where the stand-in region cache says GPU 0's flags lie
HIDDEN, SEQ_LEN = 8, 2


def load(address: int) -> int:
    return ctypes.c_uint32.from_address(address).value


def store(address: int, value: int) -> None:
    ctypes.c_uint32.from_address(address).value = value


class SimulatedGpu:
    """The driver's stream memory operations on streams simulated in Python: they are queued per
    stream, and run(stream) executes a stream's queue in order until a wait finds its word below
    its value (GEQ in wrap-around order), as the GPU would."""

    has_stream_memory_operations = True

    def __init__(self):
        self.lock = threading.Lock()
        self.queues = collections.defaultdict(collections.deque)

    def stream_write_value32(self, stream: int, address: int, value: int) -> None:
        with self.lock:
            self.queues[stream].append(("write", address, value))

    def stream_wait_value32(self, stream: int, address: int, value: int) -> None:
        with self.lock:
            self.queues[stream].append(("wait", address, value))

    def run(self, stream: int) -> bool:
        """Runs what STREAM can; True when nothing is left (it does not wait)."""
        with self.lock:
            operations = self.queues[stream]
            while operations:
                kind, address, value = operations[0]
                if kind == "wait" and not stream_ordered._reached(load(address), value):
                    return False
                if kind == "write":
                    store(address, value)
                operations.popleft()
            return True

    def queued(self, stream: int):
        with self.lock:
            return [kind for kind, _, _ in self.queues[stream]]


class SideStream:
    def __init__(self, gpu: SimulatedGpu, handle: int):
        self.gpu = gpu
        self.cuda_stream = handle
        self.synchronized = 0

    def synchronize(self) -> None:
        if not self.gpu.run(self.cuda_stream):
            raise AssertionError(f"side stream {self.cuda_stream} waits: synchronize never ends")
        self.synchronized += 1


class StandInDevices:
    """TorchDevices' stand-in: flag memory is host memory, and side streams come from a pool
    whose first stream is the trainer's (PyTorch's small pool may hand that one out)."""

    def __init__(self, gpu: SimulatedGpu):
        self.gpu = gpu
        self.handles = itertools.chain([TRAINER], itertools.count(100))
        self.side_streams = []
        self.memory = {}

    def flag_memory(self, device: int, byte_size: int):
        memory = self.memory[device] = (ctypes.c_uint32 * (byte_size // 4))()
        return memory, ctypes.addressof(memory)

    def side_stream(self, device: int) -> SideStream:
        stream = SideStream(self.gpu, next(self.handles))
        self.side_streams.append(stream)
        return stream

    def current(self, device: int):
        return contextlib.nullcontext()


class StandInServer(pb_grpc.AttentionGradientServicer):
    """GetModelInfo reports GPU 0 (stream_ordered_batches = self.ordered) and one sequence of
    SEQ_LEN tokens per request; Backward puts each request, as it arrives, into `arrived` with
    the queue its stream's answers go through (an answer, a grpc.StatusCode that ends the stream
    with that status, or None that ends it with OK)."""

    def __init__(self):
        self.ordered = True
        self.arrived: "queue.Queue" = queue.Queue()
        self.streams = 0

    def GetModelInfo(self, request, context):
        response = pb.GetModelInfoResponse(max_batch_tokens=SEQ_LEN, server_instance_id="stand-in")
        response.config.hidden_size = HIDDEN
        response.devices.add(index=0, backend="cuda", stream_ordered_batches=self.ordered)
        return response

    def Backward(self, request_iterator, context):
        self.streams += 1
        answers: "queue.Queue" = queue.Queue()
        context.add_callback(lambda: answers.put(None))  # cancelled: end too

        def read():
            try:
                for request in request_iterator:
                    self.arrived.put((request, answers))
            except grpc.RpcError:
                pass  # cancelled
            answers.put(None)  # half-closed: the stream ends after what was answered

        threading.Thread(target=read, daemon=True).start()
        while True:
            answer = answers.get()
            if answer is None:
                return
            if isinstance(answer, grpc.StatusCode):
                context.abort(answer, "the test broke the stream")
            yield answer


class Kept:
    """A tensor the server writes into, kept alive by the client until the call is answered."""


class GpuOrderedCallsTest(unittest.TestCase):
    def setUp(self):
        self.server_side = StandInServer()
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_AttentionGradientServicer_to_server(self.server_side, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.client = client_module.Client(f"127.0.0.1:{port}", timeout=10)
        self.gpu = SimulatedGpu()
        self.devices = StandInDevices(self.gpu)
        self.tasks = stream_ordered.StreamOrderedCalls(
            self.client._exchange, self.gpu, slots=SLOTS,
            flag_memory=(ctypes.c_uint32 * (2 * SLOTS))())
        self.regions = {}  # region id -> the address of its byte 0
        self.calls = stream_ordered.GpuOrderedCalls(
            lambda: client_module._BackwardStream(self.client._next_backward(serialized=True)),
            self.gpu, self.locate, watchdog=self.client._watchdog, tasks=self.tasks,
            slots=SLOTS, devices=self.devices)

    def tearDown(self):
        self.calls.close(wait=2)
        self.tasks.close()
        self.client.close()
        self.server.stop(0)

    def locate(self, memory):
        """CudaRegionCache.slice_of's stand-in: each device's flags lie at REGION_OFFSET of a
        region of their own, GPU 0's in REGION."""
        base = ctypes.addressof(memory) - REGION_OFFSET
        region = next((known for known, address in self.regions.items() if address == base),
                      REGION + len(self.regions))
        self.regions[region] = base
        return region, REGION_OFFSET, ctypes.sizeof(memory)

    def submit(self, sequences: int = 1, timeout: float = 10.0, before_send=None, kept=(),
               device: int = 0, stream: int = TRAINER):
        inputs = np.zeros((sequences, SEQ_LEN, HIDDEN), np.float32)
        batch = self.client._prepare(inputs, inputs, position_ids=np.arange(SEQ_LEN),
                                     rope_theta=10000.0, mode="accumulate")
        request = client_module._GpuOrderedBatch(batch, client_module._NO_PHASES)
        return self.calls.submit(request, device, stream, list(kept), timeout,
                                 before_send=before_send)

    def arrived(self):
        return self.server_side.arrived.get(timeout=5)

    def word(self, region_slice) -> int:
        """The word a RegionSlice of the request names, as the server would read it."""
        self.assertEqual(region_slice.byte_size, 4)
        self.assertEqual(region_slice.offset % 16, 0, "a CUDA IPC slice must be 16-byte aligned")
        return load(self.regions[region_slice.region_id] + region_slice.offset)

    def compute(self, request, answers, error=None):
        """The server's GPU: READY was reached; DONE written after the outputs (not when the
        batch failed), then the answer."""
        order = request.stream_order
        self.assertTrue(stream_ordered._reached(self.word(order.ready), order.value),
                        "computed before the stream wrote READY")
        response = pb.BackwardResponse(batch_id=request.batch_id, weights_version=3,
                                       server_instance_id="stand-in", device="cuda:0")
        if error is not None:
            response.error.code, response.error.message = error.value[0], "refused by the test"
        else:
            store(self.regions[order.done.region_id] + order.done.offset, order.value)
            gradient = response.grad_hidden_states
            gradient.dtype = client_module.tensor_pb2.DTYPE_FLOAT32
            gradient.shape.extend(request.hidden_states.shape)
            gradient.raw_data = bytes(4 * int(np.prod(request.hidden_states.shape)))
        answers.put(response)

    def wait_for(self, condition, seconds: float = 5.0) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            self.assertLess(time.monotonic(), deadline, "timed out")
            time.sleep(0.002)

    def host_writes(self):
        return [(stream.cuda_stream, stream.synchronized) for stream in self.devices.side_streams
                if stream.synchronized]

    def test_the_request_leaves_before_the_stream_writes_ready_and_done_releases_it(self):
        kept = Kept()
        alive = weakref.ref(kept)
        pending = self.submit(kept=[kept])
        del kept
        request, answers = self.arrived()
        self.assertEqual(self.gpu.queued(TRAINER), ["write", "wait"],
                         "the call waited for the stream before sending")
        order = request.stream_order
        self.assertEqual(self.word(order.ready), 0, "READY written before the request left")
        self.assertEqual((order.ready.region_id, order.done.region_id), (REGION, REGION))
        self.assertEqual((order.ready.offset, order.done.offset, order.value),
                         (REGION_OFFSET, REGION_OFFSET + 16, 1))
        self.assertFalse(self.gpu.run(TRAINER), "the stream does not wait for DONE")
        self.assertEqual(self.word(order.ready), 1)
        time.sleep(0.05)
        self.assertFalse(self.gpu.run(TRAINER), "released before DONE was written")
        self.assertIsNotNone(alive(), "the call's tensors went before it was answered")
        self.compute(request, answers)
        self.assertTrue(self.gpu.run(TRAINER))
        result = pending.result(timeout=5)
        self.assertEqual((pending.ordering, result.ordering), ("gpu", "gpu"))
        self.assertEqual(result.batch_id, request.batch_id)
        self.assertIsNone(result.grad_hidden_states, "the answer is in the pending call's tensors")
        self.assertEqual(self.host_writes(), [], "the host wrote DONE of a finished call")
        gc.collect()
        self.wait_for(lambda: alive() is None)

    def test_an_error_answer_writes_done_from_a_side_stream_and_raises_at_wait_all(self):
        pending = self.submit()
        request, answers = self.arrived()
        answers.put(pb.BackwardResponse(  # refused at once, before the stream got there
            batch_id=request.batch_id,
            error=pb.Error(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="bad field")))
        self.wait_for(pending.done)
        self.assertTrue(self.gpu.run(TRAINER), "the stream waits forever for a failed call")
        self.assertEqual(self.host_writes(), [(100, 1)],
                         "DONE not written once from a side stream other than the trainer's")
        with self.assertRaisesRegex(errors.InvalidArgumentError, "bad field"):
            self.calls.wait_all()
        self.calls.wait_all()  # reported once

    def test_a_broken_stream_fails_every_call_on_it_and_the_next_call_opens_another(self):
        kept = Kept()
        alive = weakref.ref(kept)
        first, second = self.submit(kept=[kept]), self.submit()
        del kept
        _, answers = self.arrived()
        self.arrived()
        answers.put(grpc.StatusCode.UNAVAILABLE)
        self.wait_for(lambda: first.done() and second.done())
        self.assertTrue(self.gpu.run(TRAINER), "a call of the broken stream holds the stream")
        with self.assertRaises(errors.UnavailableError):
            self.calls.wait_all()
        third = self.submit()
        request, answers = self.arrived()
        self.assertEqual(self.server_side.streams, 2)
        self.assertFalse(self.gpu.run(TRAINER))
        self.compute(request, answers)
        self.assertEqual(third.result(timeout=5).batch_id, request.batch_id)
        self.assertTrue(self.gpu.run(TRAINER))
        gc.collect()
        self.assertIsNotNone(alive(), "an unanswered call's tensors went before close()")
        self.calls.close(wait=2)
        gc.collect()
        self.assertIsNone(alive())

    def test_a_call_unanswered_past_its_timeout_gets_deadline_exceeded_and_done(self):
        self.submit(timeout=0.2)
        self.arrived()  # and never answered
        with self.assertRaises(errors.DeadlineExceededError):
            self.calls.wait_all()
        self.assertTrue(self.gpu.run(TRAINER), "the stream waits for a call that timed out")

    def test_answers_out_of_order_are_matched_to_their_calls_and_parts(self):
        first = self.submit(sequences=2)  # split in two requests: a slot each
        second = self.submit(device=1, stream=TRAINER_ON_GPU_1)
        arrived = [self.arrived() for _ in range(3)]
        self.assertEqual(self.gpu.queued(TRAINER), ["write", "write", "wait", "wait"])
        self.assertEqual([(request.stream_order.ready.region_id,
                           request.stream_order.ready.offset) for request, _ in arrived],
                         [(REGION, REGION_OFFSET), (REGION, REGION_OFFSET + 32),
                          (REGION + 1, REGION_OFFSET)])
        self.assertFalse(self.gpu.run(TRAINER))
        self.assertFalse(self.gpu.run(TRAINER_ON_GPU_1))
        for request, answers in reversed(arrived):  # GPU 1's call, then the parts backwards
            self.compute(request, answers)
        self.assertEqual(second.result(timeout=5).batch_id, arrived[2][0].batch_id)
        self.assertEqual(first.result(timeout=5).batch_ids,
                         (arrived[0][0].batch_id, arrived[1][0].batch_id))
        self.assertTrue(self.gpu.run(TRAINER))
        self.assertTrue(self.gpu.run(TRAINER_ON_GPU_1))

    def test_slots_wrap_around_with_counting_values(self):
        values = []
        for _ in range(SLOTS + 1):
            pending = self.submit()
            request, answers = self.arrived()
            values.append((request.stream_order.ready.offset, request.stream_order.value))
            self.gpu.run(TRAINER)
            self.compute(request, answers)
            pending.result(timeout=5)
        self.assertEqual(values, [(REGION_OFFSET + 32 * slot, 1) for slot in range(SLOTS)]
                         + [(REGION_OFFSET, 2)])

    def test_a_queued_task_runs_before_a_later_backward_is_sent(self):
        log, submitted = [], []
        self.tasks.submit_task(TRAINER, lambda: log.append("task"), 5.0)
        submitter = threading.Thread(target=lambda: submitted.append(self.submit(
            before_send=lambda ordered: log.append(("before_send", ordered)))))
        submitter.start()
        time.sleep(0.1)
        self.assertEqual(log, [], "the backward did not wait for the task queued before it")
        self.assertTrue(self.server_side.arrived.empty())
        self.gpu.run(TRAINER)  # the stream passes the task's point: the sender runs it
        submitter.join(5)
        request, answers = self.arrived()
        self.assertEqual(log, ["task", ("before_send", True)])
        self.gpu.run(TRAINER)
        self.compute(request, answers)
        submitted[0].result(timeout=5)

    def test_a_failed_task_makes_the_version_call_unordered_and_raises_at_wait_all(self):
        def failing_upload():
            raise RuntimeError("upload refused")

        seen = []
        self.tasks.submit_task(TRAINER, failing_upload, 5.0)
        self.gpu.run(TRAINER)
        pending = self.submit(before_send=seen.append)
        self.assertEqual(seen, [False])
        request, answers = self.arrived()
        self.gpu.run(TRAINER)
        self.compute(request, answers)
        pending.result(timeout=5)
        with self.assertRaisesRegex(RuntimeError, "upload refused"):
            self.tasks.wait_all()

    def test_a_call_that_fails_before_it_is_sent_releases_the_stream(self):
        def refuse(ordered):
            raise RuntimeError("weights changed in place")

        with self.assertRaisesRegex(RuntimeError, "in place"):
            self.submit(before_send=refuse)  # before anything is queued
        self.assertEqual(self.gpu.queued(TRAINER), [])
        self.submit()
        with self.assertRaisesRegex(ValueError, "in flight"):  # the same batch id again
            self.calls.submit(request_in_flight_again(self), 0, TRAINER, [], 10.0)
        self.assertEqual(self.host_writes(), [(100, 1)])
        request, answers = self.arrived()
        self.assertFalse(self.gpu.run(TRAINER))
        self.compute(request, answers)
        self.assertTrue(self.gpu.run(TRAINER), "the refused call's wait was not released")


def request_in_flight_again(test: GpuOrderedCallsTest):
    """A request whose batch id is that of the call in flight (the only one)."""
    in_flight = test.calls._current.due
    (batch_id,) = in_flight
    inputs = np.zeros((1, SEQ_LEN, HIDDEN), np.float32)
    batch = test.client._prepare(inputs, inputs, position_ids=np.arange(SEQ_LEN),
                                 rope_theta=10000.0, mode="accumulate", batch_id=batch_id)
    return client_module._GpuOrderedBatch(batch, client_module._NO_PHASES)


class SlotsTest(unittest.TestCase):
    def test_a_slot_is_handed_out_again_only_after_its_call_and_in_call_order(self):
        slots = stream_ordered._Slots(2)
        self.assertEqual([slots.take(), slots.take()], [(0, 1), (1, 1)])
        slots.release(1)  # answered out of order
        taken = []
        taker = threading.Thread(target=lambda: taken.append(slots.take()))
        taker.start()
        time.sleep(0.05)
        self.assertEqual(taken, [], "slot 0 handed out while its call is in flight, or slot 1 "
                                    "out of turn")
        slots.release(0)
        taker.join(5)
        self.assertEqual(taken, [(0, 2)])


class SelectionTest(unittest.TestCase):
    """Client.orders_on_gpu: GPU ordering where the driver has stream memory operations, the
    server reports stream_ordered_batches for the batch's GPU and ATTNGRAD_GPU_ORDERED is 1 (off
    by default until it has run on a GPU)."""

    def setUp(self):
        self.server_side = StandInServer()
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_AttentionGradientServicer_to_server(self.server_side, self.server)
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()
        self.clients = []

    def tearDown(self):
        for client in self.clients:
            client.close()
        self.server.stop(0)

    def client(self, stream_memory_operations: bool = True):
        client = client_module.Client(self.target, timeout=10)
        self.clients.append(client)
        client._stream_ordered_supported = stream_memory_operations
        if stream_memory_operations:
            client._stream_ordered = stream_ordered.StreamOrderedCalls(
                client._exchange, SimulatedGpu(), slots=SLOTS,
                flag_memory=(ctypes.c_uint32 * (2 * SLOTS))())
        return client

    def test_gpu_ordered_on_a_gpu_the_server_orders(self):
        client = self.client()
        with unittest.mock.patch.dict(os.environ, {"ATTNGRAD_GPU_ORDERED": "1"}):
            self.assertTrue(client.orders_on_gpu(0))
            self.assertTrue(client.orders_on_gpu())
            self.assertFalse(client.orders_on_gpu(1), "a GPU the server does not report")
            self.assertIsInstance(client._gpu_ordered_calls(0), stream_ordered.GpuOrderedCalls)
            self.assertIsNone(client._gpu_ordered_calls(1))

    def test_host_ordered_when_turned_off_unreported_or_without_the_driver(self):
        for switch in ("0", None):  # turned off, or not asked for
            with unittest.mock.patch.dict(os.environ, {"ATTNGRAD_GPU_ORDERED": switch or ""}):
                if switch is None:
                    del os.environ["ATTNGRAD_GPU_ORDERED"]  # patch.dict puts it back after
                client = self.client()
                self.assertFalse(client.orders_on_gpu(0), f"ATTNGRAD_GPU_ORDERED={switch}")
                self.assertIsNone(client._gpu_ordered_calls(0))
        with unittest.mock.patch.dict(os.environ, {"ATTNGRAD_GPU_ORDERED": "1"}):
            self.assertFalse(self.client(stream_memory_operations=False).orders_on_gpu(0))
            self.server_side.ordered = False
            self.assertFalse(self.client().orders_on_gpu(0))

    def test_a_sharded_client_asks_the_server_of_the_layer(self):
        from attngrad import sharded

        gpu_ordered, host_ordered = self.client(), self.client(stream_memory_operations=False)
        client = sharded.ShardedClient({(0, 3): gpu_ordered, (4, 7): host_ordered})
        with unittest.mock.patch.dict(os.environ, {"ATTNGRAD_GPU_ORDERED": "1"}):
            self.assertTrue(client.orders_on_gpu(0, layer=2))
            self.assertFalse(client.orders_on_gpu(0, layer=5))
            self.assertTrue(client.orders_on_gpu(), "not GPU-ordered on any of its servers")


class RestartedServerTest(unittest.TestCase):
    """A queued call refused for a region the server does not know (the server restarted) makes
    Client.wait_submitted drop the client's registrations, so that the next calls register
    anew."""

    class RefusedCalls:
        def wait_all(self):
            raise errors.InvalidArgumentError(
                grpc.StatusCode.INVALID_ARGUMENT, "hidden_states_region.region_id: 7 is not a "
                "region of this client (RegisterRegion)", method="Backward")

    def test_wait_submitted_forgets_the_registrations_of_a_restarted_server(self):
        client = client_module.Client("127.0.0.1:1", timeout=1)  # never called
        try:
            client._cuda_regions = registrations = object()
            client._gpu_ordered = self.RefusedCalls()
            with self.assertRaises(errors.InvalidArgumentError):
                client.wait_submitted()
            self.assertIsNone(client._cuda_regions)
            client._cuda_regions = registrations
            client._gpu_ordered = None
            client.wait_submitted()  # nothing refused: the registrations stay
            self.assertIs(client._cuda_regions, registrations)
        finally:
            client._cuda_regions = client._gpu_ordered = None
            client.close()


@unittest.skipIf(torch is None, "PyTorch is not installed for this interpreter")
class SenderUploadsTest(unittest.TestCase):
    """attngrad.torch uploads changed weights from the sender by default where calls are
    GPU-ordered; ATTNGRAD_SENDER_UPLOADS forces it."""

    class Client:
        def __init__(self, gpu_ordered: bool):
            self.gpu_ordered = gpu_ordered

        def orders_on_gpu(self, device=None, *, layer=None):
            return self.gpu_ordered

    def binding(self, gpu_ordered: bool, stream_ordered: bool = True):
        import attngrad.torch as bridge

        return bridge._Binding(self.Client(gpu_ordered), config=None, mode="return",
                               precision="auto", scaling=1.0, softcap=0.0, eps=1e-6,
                               wire_dtype="float32", stream_ordered=stream_ordered)

    def test_on_with_gpu_ordering_unless_forced(self):
        environment = {k: v for k, v in os.environ.items() if k != "ATTNGRAD_SENDER_UPLOADS"}
        with unittest.mock.patch.dict(os.environ, environment, clear=True):
            self.assertTrue(self.binding(True).sender_uploads)
            self.assertFalse(self.binding(False).sender_uploads)
            self.assertFalse(self.binding(True, stream_ordered=False).sender_uploads)
        with unittest.mock.patch.dict(os.environ, {"ATTNGRAD_SENDER_UPLOADS": "0"}):
            self.assertFalse(self.binding(True).sender_uploads)
        with unittest.mock.patch.dict(os.environ, {"ATTNGRAD_SENDER_UPLOADS": "1"}):
            self.assertTrue(self.binding(False).sender_uploads)


if __name__ == "__main__":
    unittest.main()
