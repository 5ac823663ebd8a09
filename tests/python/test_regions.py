"""Same-host zero-copy over POSIX shared memory with the Python client against
attngrad-server on loopback (CPU backend): backward(zero_copy=True) writes the inputs into a region
the client registers, the server reads them there and writes grad_hidden_states back; the results
are the bytes path's bit for bit (fp32, 16-bit inputs and answers, a batch split in parts along B);
register_region / unregister_region refuse bad names, unknown regions and another client's.

The server runs with --max_batch_tokens=16 so that a [3,8] batch is split in two requests."""
from __future__ import annotations

import unittest
from multiprocessing import shared_memory

import numpy as np

import attngrad_testing as t

import attngrad  # noqa: E402  (attngrad_testing puts client/python on sys.path)

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
        with self.assertRaises(attngrad.InvalidArgumentError) as caught:
            self.client.register_region("attngrad-test-no-such-object", 4096)
        self.assertIn("name", caught.exception.message)
        memory = shared_memory.SharedMemory(create=True, size=4096)
        try:
            with self.assertRaises(attngrad.InvalidArgumentError) as caught:
                self.client.register_region(memory.name, 1 << 20)  # larger than the object
            self.assertIn("byte_size", caught.exception.message)
            region = self.client.register_region(memory.name, 4096)
            with attngrad.Client(self.server.target, client_id="someone-else") as other:
                with self.assertRaises(attngrad.InvalidArgumentError):
                    other.unregister_region(region)
            self.client.unregister_region(region)
            with self.assertRaises(attngrad.InvalidArgumentError):
                self.client.unregister_region(region)
        finally:
            memory.close()
            memory.unlink()


if __name__ == "__main__":
    unittest.main()
