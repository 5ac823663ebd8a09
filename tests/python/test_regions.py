"""Same-host zero-copy over shared memory (sealed memfds) with the Python client against
attngrad-server on loopback (CPU backend): backward(zero_copy=True) writes the inputs into a region
the client registers, the server reads them there and writes grad_hidden_states back; the results
are the bytes path's bit for bit (fp32, 16-bit inputs and answers, a batch split in parts along B);
register_region / unregister_region refuse names, memory that could shrink, unknown regions and
another client's.

The server runs with --max_batch_tokens=16 so that a [3,8] batch is split in two requests."""
from __future__ import annotations

import mmap
import os
import unittest
from multiprocessing import shared_memory

import grpc

import numpy as np

import attngrad_testing as t

import attngrad  # noqa: E402  (attngrad_testing puts client/python on sys.path)
from attngrad import client as client_module  # noqa: E402

attngrad_pb = client_module.pb

MAX_BATCH_TOKENS = 16


class RegionsAgainstServer(t.ServerTestCase):
    server_flags = (f"--max_batch_tokens={MAX_BATCH_TOKENS}",)

    @classmethod
    def set_up_class(cls):
        cls.rng = np.random.default_rng(20261202)

    def assert_same_bits(self, zero_copy, expected):
        np.testing.assert_array_equal(np.asarray(zero_copy.grad_hidden_states).view(np.uint8),
                                      np.asarray(expected.grad_hidden_states).view(np.uint8))
        if expected.weight_gradients is not None:
            for name, value in expected.weight_gradients.items():
                np.testing.assert_array_equal(zero_copy.weight_gradients[name], value, err_msg=name)

    def assert_went_through_a_region(self, hidden, result, kwargs):
        """The client's cached region holds the first part's inputs at its start, and the first
        part's answer after its two inputs (the layout of client._RegionLayout)."""
        self.assertTrue(self.client._free_regions, "no region was used")
        memory = self.client._free_regions[-1].memory
        first = MAX_BATCH_TOKENS // hidden.shape[1]  # sequences in the first part
        part = hidden[:first]
        if kwargs.get("input_dtype") == "float16":
            part = part.astype(np.float16)
        raw = part.tobytes()
        self.assertEqual(bytes(memory.buf[:len(raw)]), raw)
        answer = np.asarray(result.grad_hidden_states[:first])
        if kwargs.get("response_dtype") == "bfloat16":
            answer = (answer.view(np.uint32) >> 16).astype(np.uint16)  # exact: bf16 widened
        answer_raw = answer.tobytes()
        start = 2 * len(raw)  # a multiple of 64 here
        self.assertEqual(bytes(memory.buf[start:start + len(answer_raw)]), answer_raw)

    def test_zero_copy_equals_the_bytes_path_bit_for_bit(self):
        hidden, grad, cos, sin = t.random_batch(self.rng, 3, 8)  # split in two parts
        original = hidden.copy()
        for kwargs in ({}, {"mode": "accumulate"},
                       {"input_dtype": "float16", "response_dtype": "bfloat16"}):
            with self.subTest(**kwargs):
                expected = self.client.backward(hidden, grad, cos, sin, transport="bytes",
                                                **kwargs)
                result = self.client.backward(hidden, grad, cos, sin, zero_copy=True, **kwargs)
                self.assertEqual(len(result.batch_ids), 2)
                self.assert_same_bits(result, expected)
                self.assert_went_through_a_region(hidden, result, kwargs)
        np.testing.assert_array_equal(hidden, original)  # the inputs were only read

    def test_zero_copy_with_torch_cpu_tensors(self):
        try:
            import torch
        except ImportError:
            self.skipTest("PyTorch is not installed")
        hidden, grad, cos, sin = t.random_batch(self.rng, 1, 8)
        expected = self.client.backward(hidden, grad, cos, sin)
        result = self.client.backward(torch.from_numpy(hidden), torch.from_numpy(grad), cos, sin,
                                      zero_copy=True)
        self.assertIsInstance(result.grad_hidden_states, torch.Tensor)
        np.testing.assert_array_equal(result.grad_hidden_states.numpy(),
                                      expected.grad_hidden_states)

    def test_register_and_unregister_check_their_arguments(self):
        with attngrad.SealedMemory(4096) as memory:
            with self.assertRaises(attngrad.InvalidArgumentError) as caught:
                self.client.register_region(memory, 1 << 20)  # larger than the memfd
            self.assertIn("byte_size", caught.exception.message)
            region = self.client.register_region(memory)
            with attngrad.Client(self.server.target, client_id="someone-else") as other:
                with self.assertRaises(attngrad.InvalidArgumentError):
                    other.unregister_region(region)
            self.client.unregister_region(region)
            with self.assertRaises(attngrad.InvalidArgumentError):
                self.client.unregister_region(region)

    def test_names_are_refused_alike_whether_the_object_exists_or_not(self):
        """RegisterRegion by name reaches nothing: the server answers an existing object and a
        missing one with the same FAILED_PRECONDITION, and the client does not send names."""
        memory = shared_memory.SharedMemory(create=True, size=4096)
        try:
            answers = []
            for name in (memory.name, memory.name + "-missing"):
                with self.assertRaises(grpc.RpcError) as caught:
                    self.client._stub.RegisterRegion(
                        attngrad_pb.RegisterRegionRequest(name=name, byte_size=4096))
                answers.append((caught.exception.code(), caught.exception.details()))
            self.assertEqual(answers[0], answers[1])
            self.assertEqual(answers[0][0], grpc.StatusCode.FAILED_PRECONDITION)
            with self.assertRaises(attngrad.FailedPreconditionError) as caught:
                self.client.register_region(memory.name, 4096)
            self.assertIn("name", caught.exception.message)
        finally:
            memory.close()
            memory.unlink()

    def test_memory_that_could_shrink_is_refused_and_sealed_memory_cannot_shrink(self):
        """A memfd without F_SEAL_SHRINK is refused naming the seal; a SealedMemory registered
        with the server cannot be shrunk by its owner, who may drop and remap its own mapping:
        the server keeps computing from and into the region."""
        fd = os.memfd_create("attngrad-test", os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, 4096)
            with self.assertRaises(attngrad.InvalidArgumentError) as caught:
                self.client.register_region(fd, 4096)
            self.assertIn("F_SEAL_SHRINK", caught.exception.message)
        finally:
            os.close(fd)
        hidden, grad, cos, sin = t.random_batch(self.rng, 1, 8)
        expected = self.client.backward(hidden, grad, cos, sin, transport="bytes")
        result = self.client.backward(hidden, grad, cos, sin, zero_copy=True)
        shared = self.client._free_regions[-1]
        with self.assertRaises(PermissionError):
            os.ftruncate(shared.memory.fd, 0)
        remapped = mmap.mmap(shared.memory.fd, shared.size)
        shared.memory.close()  # the client's first mapping and descriptor are gone
        shared.memory = _Remapped(remapped)
        again = self.client.backward(hidden, grad, cos, sin, zero_copy=True)
        self.assert_same_bits(result, expected)
        self.assert_same_bits(again, expected)
        self.assertEqual(self.client.health(), "SERVING")


class RegionsOffServer(t.ServerTestCase):
    """A server without shared-memory regions (--region_socket=off): transport="auto" falls back
    to bytes with one warning, a forced "shm" is FAILED_PRECONDITION naming the socket."""
    server_flags = ("--region_socket=off",)

    def test_auto_falls_back_to_bytes_and_shm_is_refused(self):
        hidden, grad, cos, sin = t.random_batch(np.random.default_rng(5), 1, 8)
        expected = self.client.backward(hidden, grad, cos, sin, transport="bytes")
        with self.assertWarns(RuntimeWarning):
            result = self.client.backward(hidden, grad, cos, sin, transport="auto")
        np.testing.assert_array_equal(result.grad_hidden_states, expected.grad_hidden_states)
        with attngrad.Client(self.server.target) as fresh:
            with self.assertRaises(attngrad.FailedPreconditionError) as caught:
                fresh.backward(hidden, grad, cos, sin, transport="shm")
        self.assertIn("region_socket", caught.exception.message)


class _Remapped:
    """A mapping standing in for a SealedMemory whose descriptor the test closed."""

    def __init__(self, mapping):
        self.mapping = mapping
        self.buf = memoryview(mapping)

    def close(self):
        self.buf = self.mapping = None  # unmapped once nothing uses it


if __name__ == "__main__":
    unittest.main()
