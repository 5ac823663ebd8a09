"""Same-host zero-copy over CUDA IPC (issue 13 item 4, GPU memory): this process (a trainer with
PyTorch) registers its CUDA tensors with attngrad-server on GPU 0 (a second process) and the server
computes straight from them and writes grad_hidden_states into them. The results equal the bytes
path's bit for bit (RETURN, whose weight gradients go into this process's GPU memory too, and
ACCUMULATE; fp32 and bf16 inputs, fp32 and fp16 answers; a batch split in parts along B); every bad reference into a CUDA IPC region (unknown region, another
client's, out of bounds, misaligned, too small, a slice on another GPU's memory) is
INVALID_ARGUMENT naming the field and the stream goes on; registrations are cached per storage and
closed by close(); a server on the CPU refuses the regions and the client falls back to the bytes
path with a warning.

Needs PyTorch with CUDA and a GPU build of attngrad-server (ATTNGRAD_SERVER); skips otherwise
(label gpu: tests/python/CMakeLists.txt). ATTNGRAD_TEST_GPU: the GPU (default 0)."""
from __future__ import annotations

import os
import unittest

import attngrad_testing as t

try:
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None

import attngrad  # noqa: E402
from attngrad import client as client_module  # noqa: E402

HAVE_GPU = torch is not None and torch.cuda.is_available()
GPU = int(os.environ.get("ATTNGRAD_TEST_GPU", "0"))
MAX_BATCH_TOKENS = 256


@unittest.skipUnless(HAVE_GPU, "needs PyTorch with a CUDA GPU")
class CudaIpcAgainstServer(t.ServerTestCase):
    server_flags = (f"--devices={GPU}", f"--max_batch_tokens={MAX_BATCH_TOKENS}")

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
        got = self.client.backward(hidden, grad, position_ids=positions, mode="return")
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
        regions = [cache.slice_of(tensor)[0] for tensor in (hidden, grad, answer)]
        other = attngrad.Client(self.server.target, client_id="other")
        small = torch.empty(bytes_ // 32, device=self.device)  # a region too small for the tensor
        roomy = torch.empty(bytes_ // 4 + 64, device=self.device)  # room for a misaligned slice
        try:
            other_storage = torch.empty_like(hidden)
            other_region = other._cuda_region_cache().slice_of(other_storage)[0]
            small_region = cache.slice_of(small)[0]
            roomy_region = cache.slice_of(roomy)[0]

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

            good = ((regions[0], 0, bytes_), (regions[1], 0, bytes_), (regions[2], 0, bytes_))
            cases = {
                "hidden_states_region.region_id": ((regions[0] + 1000, 0, bytes_),) + good[1:],
                "grad_output_region.region_id": (good[0], (other_region, 0, bytes_), good[2]),
                "grad_hidden_states_region": good[:2] + ((regions[2], 64, bytes_),),  # past the end
                "grad_output_region.offset": (good[0], (roomy_region, 8, bytes_), good[2]),
                "hidden_states_region.byte_size": ((regions[0], 0, bytes_ - 16),) + good[1:],
                "hidden_states_region ": ((small_region, 0, bytes_),) + good[1:],  # too small
                "weight_gradients_region.byte_size": good + ((weights_region, 0, weight_bytes - 4),),
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

    def test_registrations_are_cached_per_storage_and_closed(self):
        client = attngrad.Client(self.server.target, client_id="cache")
        try:
            hidden, grad, positions = self.inputs(1, 32, 6)
            client.backward(hidden, grad, position_ids=positions, zero_copy=True)
            after_one = len(client._cuda_regions)  # hidden, grad and the call's outputs
            hidden_region = client._cuda_region_cache().slice_of(hidden)[0]
            for _ in range(3):
                client.backward(hidden, grad, position_ids=positions, zero_copy=True)
            # The inputs' storages are registered once (the same region every call); each call's
            # new outputs at most once more (H200, 06:31 UTC: 10 regions after four calls, where
            # registering per call would make 4 * after_one).
            self.assertEqual(client._cuda_region_cache().slice_of(hidden)[0], hidden_region)
            self.assertLessEqual(len(client._cuda_regions), 2 + 4 * (after_one - 2))
            region = client._cuda_region_cache().slice_of(hidden)[0]
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
