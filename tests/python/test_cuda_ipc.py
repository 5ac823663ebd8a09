"""Same-host zero-copy over CUDA IPC (GPU memory): this process (a trainer with
PyTorch) registers its CUDA tensors with attngrad-server on GPU 0 (a second process) and the server
computes straight from them and writes grad_hidden_states into them. The results equal the bytes
path's bit for bit (RETURN, whose weight gradients go into this process's GPU memory too, and
ACCUMULATE; fp32 and bf16 inputs, fp32 and fp16 answers; a batch split in parts along B); every bad
reference into a CUDA IPC region (unknown region, another client's, out of bounds, misaligned, too
small, a slice on another GPU's memory) is INVALID_ARGUMENT naming the field and the stream goes on;
one registration per GPU allocation, reused by the next calls (also with new tensors each call, as
in a training loop, whose memory is freed when a call returns) and closed by close(); an allocation
freed and made again (torch.cuda.empty_cache()) is registered anew and the answers stay right; a
server on the CPU refuses the regions and the client falls back to the bytes path with a warning.
Weights by reference (load_weights(transport="cuda_ipc"), fp32 and bf16 parameters) compute exactly
as the same values sent as bytes, are copied by the server before it answers and are refused when
not finite; RemoteGemma3Attention's default transport is CUDA IPC, and attach(optimizer) fetches
ACCUMULATE sums before AdamW, Adam and SGD steps.

Needs PyTorch with CUDA and a GPU build of attngrad-server (ATTNGRAD_SERVER); skips otherwise
(label gpu: tests/python/CMakeLists.txt). ATTNGRAD_TEST_GPU: the GPU (default 0)."""
from __future__ import annotations

import os
import threading
import time
import unittest
import unittest.mock

import attngrad_testing as t

try:
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None

import attngrad  # noqa: E402
from attngrad import client as client_module  # noqa: E402
from attngrad import cuda_regions, errors  # noqa: E402

HAVE_GPU = torch is not None and torch.cuda.is_available()
GPU = int(os.environ.get("ATTNGRAD_TEST_GPU", "0"))
MAX_BATCH_TOKENS = 256
STREAM_ORDER_TIMEOUT = 3  # seconds a GPU-ordered batch waits for its client's stream


@unittest.skipUnless(HAVE_GPU, "needs PyTorch with a CUDA GPU")
class CudaIpcAgainstServer(t.ServerTestCase):
    server_flags = (f"--devices={GPU}", f"--max_batch_tokens={MAX_BATCH_TOKENS}",
                    f"--stream_order_timeout_seconds={STREAM_ORDER_TIMEOUT}")

    @classmethod
    def set_up_class(cls):
        cls.hidden = cls.info.hidden_size
        cls.device = torch.device("cuda", GPU)

    def inputs(self, batch, seq_len, seed):
        generator = torch.Generator(device=self.device).manual_seed(seed)
        shape = (batch, seq_len, self.hidden)
        hidden = torch.randn(shape, generator=generator, device=self.device)
        grad = torch.randn(shape, generator=generator, device=self.device) * 0.1
        positions = torch.arange(seq_len)
        return hidden, grad, positions

    def assert_same_bits(self, a, b, what):
        self.assertEqual(a.dtype, b.dtype, what)
        self.assertTrue(torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                                    b.view(torch.uint8) if b.dtype != torch.bool else b),
                        f"{what}: not bit for bit equal")

    def compare(self, batch, seq_len, seed, **kwargs):
        hidden, grad, positions = self.inputs(batch, seq_len, seed)
        on_host = hidden.cpu(), grad.cpu()
        expected = self.client.backward(*on_host, position_ids=positions, **kwargs)
        got = self.client.backward(hidden, grad, position_ids=positions, zero_copy=True, **kwargs)
        self.assertTrue(got.grad_hidden_states.is_cuda)
        self.assert_same_bits(got.grad_hidden_states.cpu(), expected.grad_hidden_states,
                              f"grad_hidden_states {kwargs}")
        if expected.weight_gradients is not None:
            for name, value in expected.weight_gradients.items():
                self.assert_same_bits(got.weight_gradients[name].cpu(), value.cpu(), name)
        return got

    def test_return_fp32_equals_the_bytes_path(self):
        got = self.compare(2, 64, 1, mode="return", precision="fp32")
        self.assertEqual(got.devices, (f"cuda:{GPU}",))

    def test_split_batch_and_16_bit_dtypes_equal_the_bytes_path(self):
        # 6 x 64 tokens with 256 per request: two parts, each its own slices of the tensors.
        got = self.compare(6, 64, 2, mode="return", input_dtype="bfloat16",
                           response_dtype="float16")
        self.assertEqual(len(got.batch_ids), 2)

    def test_cuda_tensors_on_the_bytes_path_come_through_page_locked_memory(self):
        # zero_copy=False: the inputs are copied to the host once, into page-locked memory
        # (tensors.to_host); the answer is the one of the same values sent from the host.
        from attngrad import tensors
        hidden, grad, positions = self.inputs(2, 64, 5)
        host = tensors.to_host(hidden)
        self.assertTrue(host.is_pinned())
        self.assertTrue(torch.equal(host, hidden.cpu()))
        expected = self.client.backward(hidden.cpu(), grad.cpu(), position_ids=positions,
                                        mode="return")
        got = self.client.backward(hidden, grad, position_ids=positions, mode="return",
                                   transport="bytes")
        self.assertEqual(got.transport, "bytes")
        self.assertTrue(got.grad_hidden_states.is_cuda)
        self.assert_same_bits(got.grad_hidden_states.cpu(), expected.grad_hidden_states,
                              "grad_hidden_states")
        for name, value in expected.weight_gradients.items():
            self.assert_same_bits(got.weight_gradients[name].cpu(), value.cpu(), name)

    def test_accumulate_sums_equal_the_bytes_path(self):
        sums = []
        for zero_copy in (False, True):
            self.client.zero_gradients()
            for seed in (3, 4):
                hidden, grad, positions = self.inputs(2, 64, seed)
                if not zero_copy:
                    hidden, grad = hidden.cpu(), grad.cpu()
                self.client.backward(hidden, grad, position_ids=positions, mode="accumulate",
                                     zero_copy=zero_copy)
            sums.append(self.client.fetch_gradients(zero_after_fetch=True))
        for name in attngrad.WEIGHT_NAMES:
            self.assertTrue((sums[0][name].view("u4") == sums[1][name].view("u4")).all(), name)

    def test_bad_references_are_invalid_argument_and_the_stream_goes_on(self):
        pb = client_module.pb
        seq_len = 16
        hidden, grad, _ = self.inputs(1, seq_len, 5)
        answer = torch.empty_like(hidden)
        bytes_ = hidden.numel() * 4
        cache = self.client._cuda_region_cache()
        slices = [cache.slice_of(tensor) for tensor in (hidden, grad, answer)]
        other = attngrad.Client(self.server.target, client_id="other")
        roomy = torch.empty(bytes_ // 4 + 64, device=self.device)  # room for a misaligned slice

        def exact_region(tensor, size):
            """A region of SIZE bytes from TENSOR's first byte (the cache registers whole
            allocations, which are larger)."""
            allocation = cache.allocation_of(tensor)
            handle = cache.ipc_handle_of(allocation)
            return self.client.register_cuda_region(
                handle, allocation.device, size, offset=tensor.data_ptr() - allocation.base)

        try:
            other_storage = torch.empty_like(hidden)
            other_region = other._cuda_region_cache().slice_of(other_storage)[0]
            small_region = exact_region(hidden, bytes_ // 8)  # a region too small for the tensor
            answer_region = exact_region(answer, bytes_)  # exactly the answer's bytes
            roomy_region, roomy_offset, _ = cache.slice_of(roomy)

            shapes = client_module._weight_shapes(self.client.info())
            weight_bytes = sum(int(torch.tensor(shape).prod()) for shape in shapes) * 4
            weights = torch.empty(weight_bytes // 4, device=self.device)
            weights_region = cache.slice_of(weights)[0]

            def request(batch_id, hidden_slice, grad_slice, answer_slice, weights_slice=None):
                message = pb.BackwardRequest(batch_id=batch_id, mode=pb.GRADIENT_MODE_RETURN)
                for tensor in (message.hidden_states, message.grad_output):
                    tensor.dtype = client_module.tensor_pb2.DTYPE_FLOAT32
                    tensor.shape.extend([1, seq_len, self.hidden])
                message.positions.position_ids.extend(range(seq_len))
                for field, (region, offset, size) in (("hidden_states_region", hidden_slice),
                                                      ("grad_output_region", grad_slice),
                                                      ("grad_hidden_states_region", answer_slice)):
                    getattr(message, field).CopyFrom(
                        pb.RegionSlice(region_id=region, offset=offset, byte_size=size))
                if weights_slice is not None:
                    region, offset, size = weights_slice
                    message.weight_gradients_region.CopyFrom(
                        pb.RegionSlice(region_id=region, offset=offset, byte_size=size))
                return message

            good = tuple(slices)
            regions = [region for region, _, _ in slices]
            cases = {
                "hidden_states_region.region_id": ((regions[0] + 1000,) + good[0][1:],) + good[1:],
                "grad_output_region.region_id": (good[0], (other_region, 0, bytes_), good[2]),
                # past the end of the region:
                "grad_hidden_states_region": good[:2] + ((answer_region, 64, bytes_),),
                "grad_output_region.offset": (good[0], (roomy_region, roomy_offset + 8, bytes_),
                                              good[2]),
                "hidden_states_region.byte_size":
                    ((regions[0], good[0][1], bytes_ - 16),) + good[1:],
                "hidden_states_region ": ((small_region, 0, bytes_),) + good[1:],  # too small
                "weight_gradients_region.byte_size": good + ((weights_region, 0,
                                                              weight_bytes - 4),),
            }
            messages = [request(i + 1, *slices) for i, slices in enumerate(cases.values())]
            messages.append(request(len(messages) + 1, *good))
            torch.cuda.synchronize()
            call = self.client._channel.stream_stream(
                "/attngrad.v1.AttentionGradient/Backward",
                request_serializer=pb.BackwardRequest.SerializeToString,
                response_deserializer=pb.BackwardResponse.FromString)
            responses = {r.batch_id: r for r in call(iter(messages), timeout=120)}
            self.assertEqual(len(responses), len(messages))
            for index, field in enumerate(cases, start=1):
                error = responses[index].error
                self.assertEqual(error.code, 3, f"{field}: {error.message}")  # INVALID_ARGUMENT
                self.assertIn(field.strip(), error.message)
            last = responses[len(messages)]
            self.assertEqual(last.error.code, 0, last.error.message)
            # The good batch wrote grad_hidden_states into `answer`; the bytes path agrees.
            expected = self.client.backward(hidden.cpu(), grad.cpu(),
                                            position_ids=torch.arange(seq_len))
            self.assert_same_bits(answer.cpu(), expected.grad_hidden_states, "good batch")
        finally:
            other.close()

    def test_a_calls_tensors_are_freed_when_it_returns(self):
        import gc
        import weakref

        hidden, grad, positions = self.inputs(1, 64, 8)
        self.client.backward(hidden, grad, position_ids=positions, zero_copy=True)  # registered
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated(self.device)
        gc.disable()  # by reference counting alone: no cycle may hold a call's tensors
        try:
            for _ in range(3):
                fresh_hidden, fresh_grad, _ = self.inputs(1, 64, 9)
                alive = [weakref.ref(fresh_hidden), weakref.ref(fresh_grad)]
                result = self.client.backward(fresh_hidden, fresh_grad, position_ids=positions,
                                              mode="accumulate", zero_copy=True)
                answer = weakref.ref(result.grad_hidden_states)
                del fresh_hidden, fresh_grad, result
                self.assertEqual([ref() is None for ref in alive + [answer]], [True] * 3)
            self.assertEqual(torch.cuda.memory_allocated(self.device), baseline)
        finally:
            gc.enable()

    def test_a_freed_and_remade_allocation_is_registered_anew(self):
        client = attngrad.Client(self.server.target, client_id="remade")
        try:
            positions = torch.arange(64)
            for seed in (11, 12):
                hidden, grad, _ = self.inputs(2, 64, seed)
                expected = client.backward(hidden.cpu(), grad.cpu(), position_ids=positions)
                got = client.backward(hidden, grad, position_ids=positions, zero_copy=True)
                self.assert_same_bits(got.grad_hidden_states.cpu(), expected.grad_hidden_states,
                                      f"seed {seed}")
                first_allocation = client._cuda_region_cache().allocation_of(hidden)
                del hidden, grad, got, expected
                torch.cuda.empty_cache()  # the segments go back to the driver
            self.assertLessEqual(len(client._cuda_regions), 6)
            self.assertIsNotNone(first_allocation)
        finally:
            client.close()

    def test_a_server_on_the_cpu_refuses_and_the_client_falls_back_to_bytes(self):
        server = t.ServerProcess(t.required_env("ATTNGRAD_SERVER"))  # --devices=cpu
        try:
            client = attngrad.Client(server.target, timeout=120)
            server.wait_ready(client)
            hidden, grad, positions = self.inputs(1, 16, 7)
            with self.assertWarnsRegex(RuntimeWarning, "cuda_ipc"):
                got = client.backward(hidden, grad, position_ids=positions, zero_copy=True)
            expected = client.backward(hidden.cpu(), grad.cpu(), position_ids=positions)
            self.assert_same_bits(got.grad_hidden_states.cpu(), expected.grad_hidden_states,
                                  "fallback")
            client.close()
        finally:
            server.stop()

    def test_rotary_tables_in_gpu_memory_equal_the_bytes_path(self):
        import attngrad.torch as attngrad_torch

        hidden, grad, positions = self.inputs(3, 64, 15)
        cos, sin = attngrad_torch.rotary_tables(positions.to(self.device) * 3 + 1)  # [S, D]
        expected = self.client.backward(hidden.cpu(), grad.cpu(), cos.cpu(), sin.cpu(),
                                        transport="bytes")
        got = self.client.backward(hidden, grad, cos, sin, transport="cuda_ipc")  # split in 2
        self.assertEqual(len(got.batch_ids), 1 + (3 * 64 - 1) // MAX_BATCH_TOKENS)
        self.assert_same_bits(got.grad_hidden_states.cpu(), expected.grad_hidden_states,
                              "grad_hidden_states")
        for name, value in expected.weight_gradients.items():
            self.assert_same_bits(got.weight_gradients[name].cpu(), value.cpu(), name)

    def test_sums_fetched_into_cuda_tensors_equal_the_streamed_ones(self):
        self.client.zero_gradients()
        hidden, grad, positions = self.inputs(2, 64, 16)
        self.client.backward(hidden, grad, position_ids=positions, mode="accumulate")
        layer = self.info.layers[0].index
        shapes = client_module._weight_shapes(self.info)
        destinations = {name: torch.full(shape, float("nan"), device=self.device)
                        for name, shape in zip(attngrad.WEIGHT_NAMES, shapes)}
        fetched = self.client.fetch_layers([layer], destinations={layer: destinations})[layer]
        self.assertEqual(fetched.state.tokens, 128)
        streamed = self.client.fetch_layers([layer], zero_after_fetch=True)[layer]
        for name in attngrad.WEIGHT_NAMES:
            self.assert_same_bits(destinations[name].cpu(), torch.from_numpy(streamed[name]), name)

    def weights_on_gpu(self, seed, dtype=torch.float32 if torch is not None else None):
        generator = torch.Generator(device=self.device).manual_seed(seed)
        weights = {}
        for name, shape in zip(attngrad.WEIGHT_NAMES, client_module._weight_shapes(self.info)):
            scale = 0.02 if len(shape) == 1 else (2.0 / self.hidden) ** 0.5
            weights[name] = (torch.randn(shape, generator=generator, device=self.device)
                             * scale).to(dtype)
        return weights

    def test_weights_by_reference_compute_as_the_same_weights_sent_as_bytes(self):
        hidden, grad, positions = self.inputs(1, 64, 11)
        for dtype in (torch.float32, torch.bfloat16):
            with self.subTest(dtype=str(dtype)):
                weights = self.weights_on_gpu(12, dtype)
                self.client.load_weights({n: w.cpu() for n, w in weights.items()},
                                         transport="bytes")
                expected = self.client.backward(hidden, grad, position_ids=positions,
                                                precision="fp32")
                version = self.client.load_weights(weights, transport="cuda_ipc")
                got = self.client.backward(hidden, grad, position_ids=positions, precision="fp32",
                                           expected_weights_version=version)
                self.assertEqual(got.transport, "cuda_ipc")
                self.assert_same_bits(got.grad_hidden_states, expected.grad_hidden_states,
                                      "grad_hidden_states")
                for tensor in weights.values():  # the server holds its own copy
                    tensor.mul_(3.0)
                again = self.client.backward(hidden, grad, position_ids=positions,
                                             precision="fp32", expected_weights_version=version)
                self.assert_same_bits(again.grad_hidden_states, expected.grad_hidden_states,
                                      "after the trainer changed its tensors")

    def test_weights_by_reference_refuse_non_finite_values(self):
        before = self.client.info().layers[0].weights_version
        weights = self.weights_on_gpu(13)
        weights["o_proj"][7, 9] = float("nan")
        with self.assertRaises(attngrad.InvalidArgumentError) as caught:
            self.client.load_weights(weights, transport="cuda_ipc")
        self.assertIn("o_proj", caught.exception.message)
        self.assertEqual(self.client.info().layers[0].weights_version, before)

    def test_the_bridge_defaults_to_cuda_ipc_and_attach_fetches_before_each_optimizer(self):
        import attngrad.torch as attngrad_torch

        hidden, _, positions = self.inputs(1, 32, 14)
        cos, sin = attngrad_torch.rotary_tables(positions.to(self.device))
        for optimizer_class in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
            with self.subTest(optimizer=optimizer_class.__name__):
                client = attngrad.Client(self.server.target, client_id="bridge")
                layer = attngrad_torch.RemoteGemma3Attention(client, mode="accumulate")
                layer = layer.to(self.device)
                optimizer = optimizer_class(layer.parameters(), lr=1e-3)
                layer.attach(optimizer)
                before = layer.q_proj.weight.detach().clone()
                layer(hidden, cos, sin).square().mean().backward()
                self.assertEqual(layer.last_result.transport, "cuda_ipc")
                optimizer.step()  # the pre-hook fetched the sums into .grad first
                self.assertIsNotNone(layer.q_proj.weight.grad)
                self.assertFalse(torch.equal(layer.q_proj.weight.detach(), before))
                client.close()

    def test_stream_ordered_calls_equal_the_waited_ones_bit_for_bit(self):
        # Work queued before the call (a long matmul chain writing the inputs) and after it
        # (a kernel reading the answer): the stream's flags order both around the server's,
        # whether the server's GPU waits for them ("gpu") or this process's sender ("host").
        hidden, grad, positions = self.inputs(2, 64, 15)
        expected = self.client.backward(hidden, grad, position_ids=positions, mode="return",
                                        precision="fp32", transport="cuda_ipc")
        for ordering, switch in (("gpu", "1"), ("host", "0")):
            with unittest.mock.patch.dict(os.environ, {"ATTNGRAD_GPU_ORDERED": switch}):
                self.assertEqual(self.client.orders_on_gpu(GPU), ordering == "gpu")
                scratch = torch.randn(2048, 2048, device=self.device)
                for _ in range(20):
                    scratch = torch.tanh(scratch @ scratch / 2048 ** 0.5)  # bounded: finite
                late_grad = grad * 1.0 + scratch[0, 0] * 0.0  # written after the chain
                pending = self.client.submit_backward(hidden, late_grad, position_ids=positions,
                                                      mode="return", precision="fp32")
                answer = pending.grad_hidden_states * 1.0  # read in stream order, after it
                weights = {name: value * 1.0 for name, value in pending.weight_gradients.items()}
                self.client.wait_submitted()
            self.assertEqual(pending.result().transport, "cuda_ipc")
            self.assertEqual(pending.result().ordering, ordering)
            self.assert_same_bits(answer, expected.grad_hidden_states,
                                  f"grad_hidden_states, {ordering}-ordered")
            for name, value in expected.weight_gradients.items():
                self.assert_same_bits(weights[name], value, f"{name}, {ordering}-ordered")

    def test_forward_on_the_gpu_equals_the_bytes_path_in_every_ordering(self):
        hidden, _, positions = self.inputs(3, 96, 17)  # [3,96] goes as two requests along B
        expected = self.client.forward(hidden.cpu(), position_ids=positions, precision="fp32")
        got = self.client.forward(hidden, position_ids=positions, precision="fp32")
        self.assertEqual((got.transport, got.output.device), ("cuda_ipc", self.device))
        self.assert_same_bits(got.output.cpu(), expected.output, "forward over CUDA IPC")
        for ordering, switch in (("gpu", "1"), ("host", "0")):
            with unittest.mock.patch.dict(os.environ, {"ATTNGRAD_GPU_ORDERED": switch}):
                scratch = torch.randn(2048, 2048, device=self.device)
                for _ in range(20):
                    scratch = torch.tanh(scratch @ scratch / 2048 ** 0.5)  # bounded: finite
                late_hidden = hidden * 1.0 + scratch[0, 0] * 0.0  # written after the chain
                pending = self.client.submit_forward(late_hidden, position_ids=positions,
                                                     precision="fp32")
                output = pending.output * 1.0  # read in stream order, after it
                self.client.wait_submitted()
            self.assertEqual(pending.result().ordering, ordering)
            self.assertIsNone(pending.grad_hidden_states)
            self.assert_same_bits(output.cpu(), expected.output, f"forward, {ordering}-ordered")

    def test_a_stream_that_never_reaches_its_call_stalls_no_one_and_times_out(self):
        # A trainer whose stream is blocked before a GPU-ordered call: the server parks the batch
        # on a gate of its own and serves another client meanwhile; after
        # --stream_order_timeout_seconds it answers DEADLINE_EXCEEDED, the client releases its
        # stream and raises at wait_submitted(), and the next call of that client works.
        blocked = attngrad.Client(self.server.target, client_id="blocked", timeout=60)
        hidden, grad, positions = self.inputs(1, 32, 21)
        word = torch.zeros(4, dtype=torch.int32, device=self.device)
        stream = torch.cuda.Stream(device=self.device)
        torch.cuda.synchronize()

        def release():
            with torch.cuda.stream(torch.cuda.Stream(device=self.device)):
                word.fill_(1)

        safety = threading.Timer(4 * STREAM_ORDER_TIMEOUT, release)  # never hang the test
        safety.start()
        switch = unittest.mock.patch.dict(os.environ, {"ATTNGRAD_GPU_ORDERED": "1"})
        switch.start()
        try:
            with torch.cuda.stream(stream):
                cuda_regions.default_driver().stream_wait_value32(stream.cuda_stream,
                                                                  word.data_ptr(), 1)
                pending = blocked.submit_backward(hidden, grad, position_ids=positions,
                                                  mode="return", precision="fp32")
            started = time.monotonic()
            other = self.client.backward(hidden, grad, position_ids=positions, mode="return",
                                         precision="fp32", transport="cuda_ipc")
            self.assertLess(time.monotonic() - started, 2.0, "another client waited")
            # A new allocation of the other client, opened by the server (cudaIpcOpenMemHandle)
            # while the gate is closed: no server stream waits on the blocked client's memory.
            fresh = torch.empty(256 << 20, dtype=torch.uint8, device=self.device)  # a new segment
            counts = self.client.cuda_region_counts()
            started = time.monotonic()
            self.client._cuda_region_cache().slice_of(fresh)
            self.assertLess(time.monotonic() - started, 2.0, "a registration waited")
            self.assertNotEqual(self.client.cuda_region_counts(), counts, "nothing was registered")
            self.assertEqual(other.transport, "cuda_ipc")
            self.assertFalse(pending.done(), "answered before its stream reached it")
            with self.assertRaisesRegex(errors.DeadlineExceededError, "stream_order"):
                blocked.wait_submitted()
            self.assertLess(time.monotonic() - started, STREAM_ORDER_TIMEOUT + 5)
            release()
            stream.synchronize()  # its wait for the answer was released by the client
            with torch.cuda.stream(stream):
                again = blocked.submit_backward(hidden, grad, position_ids=positions,
                                                mode="return", precision="fp32")
                answer = again.grad_hidden_states * 1.0
            blocked.wait_submitted()
            stream.synchronize()
            self.assert_same_bits(answer, other.grad_hidden_states, "the next call")
        finally:
            switch.stop()
            safety.cancel()
            release()
            blocked.close()

    def test_stream_ordered_bridge_trains_like_the_waited_one(self):
        import attngrad.torch as attngrad_torch

        hidden, _, positions = self.inputs(1, 48, 16)
        cos, sin = attngrad_torch.rotary_tables(positions.to(self.device))
        losses = {}
        # (stream-ordered, $ATTNGRAD_SENDER_UPLOADS, $ATTNGRAD_GPU_ORDERED, server forward):
        # waited; host-ordered with uploads by the backward or by the sender; GPU-ordered
        # (uploads by the sender); the forward on the server, waited, host- and GPU-ordered.
        variants = ((False, "0", "0", False), (True, "0", "0", False), (True, "1", "0", False),
                    (True, None, "1", False), (False, "0", "0", True), (True, "0", "0", True),
                    (True, None, "1", True))
        for ordered, sender_uploads, gpu_ordered, server_forward in variants:
            torch.manual_seed(7)
            switches = {"ATTNGRAD_GPU_ORDERED": gpu_ordered}
            if sender_uploads is not None:
                switches["ATTNGRAD_SENDER_UPLOADS"] = sender_uploads
            with unittest.mock.patch.dict(os.environ, switches):
                layer = attngrad_torch.RemoteGemma3Attention(
                    self.client, precision="fp32", stream_ordered=ordered,
                    server_forward=server_forward).to(self.device)
                optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
                curve = []
                for _ in range(3):
                    optimizer.zero_grad()
                    loss = layer(hidden, cos, sin).square().mean()
                    loss.backward()
                    optimizer.step()
                    curve.append(loss.item())
                if ordered:
                    self.assertEqual(layer.last_result.ordering,
                                     "gpu" if gpu_ordered == "1" else "host")
            losses[variants.index((ordered, sender_uploads, gpu_ordered, server_forward))] = curve
        for index in (1, 2, 3):
            self.assertEqual(losses[0], losses[index], f"variant {variants[index]}")
        for index in (5, 6):  # the server's forward is deterministic: the same in every ordering
            self.assertEqual(losses[4], losses[index], f"variant {variants[index]}")
        # ... and agrees with the local fp32 forward within fp32 rounding.
        for local, remote in zip(losses[0], losses[4]):
            self.assertLess(abs(local - remote), 1e-5 * abs(local) + 1e-7)

    def test_one_registration_per_allocation_reused_by_later_calls_and_closed(self):
        client = attngrad.Client(self.server.target, client_id="cache")
        client.register_existing_segments = False  # one allocation at a time, as calls name them
        try:
            hidden, grad, positions = self.inputs(1, 32, 6)
            client.backward(hidden, grad, position_ids=positions, zero_copy=True)
            after_one = len(client._cuda_regions)  # the allocations of hidden, grad and the answer
            self.assertLessEqual(after_one, 3)
            hidden_region = client._cuda_region_cache().slice_of(hidden)[0]
            for _ in range(3):
                client.backward(hidden, grad, position_ids=positions, zero_copy=True)
            # A training loop: new tensors every call, dropped after it; the allocator hands their
            # memory to the next call's, in the same allocations: no new registration.
            for seed in range(8):
                fresh_hidden, fresh_grad, _ = self.inputs(1, 32, 100 + seed)
                client.backward(fresh_hidden, fresh_grad, position_ids=positions, zero_copy=True)
                del fresh_hidden, fresh_grad
            self.assertEqual(client._cuda_region_cache().slice_of(hidden)[0], hidden_region)
            self.assertEqual(len(client._cuda_regions), after_one)
            region = hidden_region
        finally:
            client.close()
        again = attngrad.Client(self.server.target, client_id="cache")
        try:
            with self.assertRaises(attngrad.errors.InvalidArgumentError):
                again.unregister_region(region)  # closed by close()
        finally:
            again.close()


if __name__ == "__main__":
    unittest.main()
