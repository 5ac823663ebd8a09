"""How batches and weights reach a server on this host (attngrad.Client's transport), with the
Python client against attngrad-server on loopback (CPU backend), where shared memory stands in for
CUDA IPC:
- transport="auto" picks shared memory for host arrays, says so in BackwardResult.transport, and
  gives the bytes path's results bit for bit;
- when the server cannot map this host's shared memory, "auto" falls back to bytes with one
  warning and does not ask again, while a forced "shm" raises, and "cuda_ipc" needs CUDA tensors;
- weights by reference (load_weights(transport="shm")): the server computes with exactly the
  weights it would have got as bytes, copies them before it answers (the region may change right
  after), and refuses non-finite values or a slice of the wrong size without changing anything."""
from __future__ import annotations

import unittest
import warnings

import grpc
import numpy as np

import attngrad_testing as t

import attngrad  # noqa: E402  (attngrad_testing puts client/python on sys.path)
from attngrad import client as client_module  # noqa: E402

pb = client_module.pb


class TransportAgainstServer(t.ServerTestCase):

    @classmethod
    def set_up_class(cls):
        cls.rng = np.random.default_rng(20261207)

    def assert_same_result(self, got, expected):
        np.testing.assert_array_equal(np.asarray(got.grad_hidden_states),
                                      np.asarray(expected.grad_hidden_states))
        for name, value in expected.weight_gradients.items():
            np.testing.assert_array_equal(got.weight_gradients[name], value, err_msg=name)

    def refusing_client(self):
        """A client of the server whose RegisterRegion answers as a server on another host does;
        it counts how often it was asked."""
        client = attngrad.Client(self.server.target)
        calls = []

        def refuse(name, size, **_):
            calls.append(name)
            raise attngrad.InvalidArgumentError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"name: cannot open shared-memory object \"/{name}\": No such file or directory",
                method="RegisterRegion")

        client.register_region = refuse
        self.addCleanup(client.close)
        return client, calls

    def test_auto_uses_shared_memory_and_equals_bytes_bit_for_bit(self):
        hidden, grad, cos, sin = t.random_batch(self.rng, 2, 8)
        expected = self.client.backward(hidden, grad, cos, sin, transport="bytes")
        self.assertEqual(expected.transport, "bytes")
        got = self.client.backward(hidden, grad, cos, sin)  # transport="auto"
        self.assertEqual(got.transport, "shm")
        self.assert_same_result(got, expected)
        forced = self.client.backward(hidden, grad, cos, sin, transport="shm")
        self.assertEqual(forced.transport, "shm")
        self.assert_same_result(forced, expected)

    def test_auto_falls_back_to_bytes_once_with_one_warning(self):
        client, calls = self.refusing_client()
        hidden, grad, cos, sin = t.random_batch(self.rng, 1, 8)
        expected = self.client.backward(hidden, grad, cos, sin, transport="bytes")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = client.backward(hidden, grad, cos, sin)
            second = client.backward(hidden, grad, cos, sin)
        self.assertEqual((first.transport, second.transport), ("bytes", "bytes"))
        self.assert_same_result(first, expected)
        self.assertEqual(len(calls), 1, "auto asked the server again after it refused")
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        self.assertEqual(len(messages), 1, messages)
        self.assertIn("shared memory", messages[0])

    def test_a_forced_transport_the_server_refuses_raises(self):
        client, _ = self.refusing_client()
        hidden, grad, cos, sin = t.random_batch(self.rng, 1, 8)
        with self.assertRaises(attngrad.FailedPreconditionError) as caught:
            client.backward(hidden, grad, cos, sin, transport="shm")
        self.assertIn("transport='shm'", caught.exception.message)
        with self.assertRaises(ValueError):
            self.client.backward(hidden, grad, cos, sin, transport="cuda_ipc")  # not CUDA tensors
        with self.assertRaises(ValueError):
            self.client.backward(hidden, grad, cos, sin, transport="carrier-pigeon")

    def test_weights_by_reference_compute_with_the_same_weights_as_bytes(self):
        weights = t.random_weights(self.rng)
        hidden, grad, cos, sin = t.random_batch(self.rng, 1, 8)
        version = self.client.load_weights(weights, transport="bytes")
        expected = self.client.backward(hidden, grad, cos, sin, transport="bytes")
        self.client.load_weights(t.random_weights(self.rng))  # something else in between
        by_reference = self.client.load_weights(weights, transport="shm")
        self.assertEqual(by_reference, version + 2)
        got = self.client.backward(hidden, grad, cos, sin, transport="bytes",
                                   expected_weights_version=by_reference)
        self.assert_same_result(got, expected)
        # The server copied the weights before it answered: the client reuses the region for the
        # next batch, which overwrites them, and the weights stay.
        self.client.backward(hidden, grad, cos, sin, transport="shm")
        again = self.client.backward(hidden, grad, cos, sin, transport="bytes",
                                     expected_weights_version=by_reference)
        self.assert_same_result(again, expected)

    def test_weights_by_reference_refuse_bad_values_and_slices(self):
        before = self.client.info().layers[0].weights_version
        weights = t.random_weights(self.rng)
        weights["v_proj"] = weights["v_proj"].copy()
        weights["v_proj"][3, 5] = np.inf
        with self.assertRaises(attngrad.InvalidArgumentError) as caught:
            self.client.load_weights(weights, transport="shm")
        self.assertIn("v_proj", caught.exception.message)
        weights = t.random_weights(self.rng)
        weights["k_norm"] = weights["k_norm"][:-1]  # 127 values where the layer has 128
        with self.assertRaises(attngrad.InvalidArgumentError) as caught:
            self.client.load_weights(weights, transport="shm")
        self.assertIn("k_norm", caught.exception.message)
        self.assertEqual(self.client.info().layers[0].weights_version, before)

    def shared_destinations(self, layer):
        """A registered shared-memory region holding one float32 slot per weight of LAYER:
        ({name: RegionSlice}, {name: NumPy view of its slot})."""
        shapes = dict(zip(attngrad.WEIGHT_NAMES, client_module._weight_shapes(self.info)))
        sizes = {name: int(np.prod(shape)) * 4 for name, shape in shapes.items()}
        memory = attngrad.SealedMemory(sum(sizes.values()))
        self.addCleanup(memory.close)
        region = self.client.register_region(memory, memory.size)
        self.addCleanup(self.client.unregister_region, region)
        slices, views, offset = {}, {}, 0
        for name, shape in shapes.items():
            slices[name] = pb.RegionSlice(region_id=region, offset=offset, byte_size=sizes[name])
            views[name] = np.ndarray(shape, np.float32, buffer=memory.buf, offset=offset)
            offset += sizes[name]
        return slices, views

    def test_sums_fetched_by_reference_equal_the_streamed_ones(self):
        layer = self.info.layers[0].index
        self.client.zero_gradients(layer=layer)
        for seed in (1, 2):
            hidden, grad, cos, sin = t.random_batch(np.random.default_rng(seed), 1, 8)
            self.client.backward(hidden, grad, cos, sin, mode="accumulate", layer=layer)
        slices, views = self.shared_destinations(layer)
        for view in views.values():
            view.fill(np.nan)  # written over, not added to
        by_reference = self.client.fetch_layers([layer], destinations={layer: slices})[layer]
        self.assertEqual(by_reference.state.tokens, 16)
        streamed = self.client.fetch_layers([layer], zero_after_fetch=True)[layer]
        for name in attngrad.WEIGHT_NAMES:
            np.testing.assert_array_equal(views[name], streamed[name], err_msg=name)

    def test_a_bad_destination_is_refused_before_anything_is_zeroed(self):
        layer = self.info.layers[0].index
        self.client.zero_gradients(layer=layer)
        hidden, grad, cos, sin = t.random_batch(self.rng, 1, 8)
        self.client.backward(hidden, grad, cos, sin, mode="accumulate", layer=layer)
        slices, _ = self.shared_destinations(layer)
        short = dict(slices)
        short["v_proj"] = pb.RegionSlice(region_id=slices["v_proj"].region_id,
                                         offset=slices["v_proj"].offset,
                                         byte_size=slices["v_proj"].byte_size - 4)
        with self.assertRaises(attngrad.InvalidArgumentError) as caught:
            self.client.fetch_layers([layer], zero_after_fetch=True,
                                     destinations={layer: short})
        self.assertIn("destinations", caught.exception.message)
        missing = dict(slices)
        del missing["k_norm"]
        with self.assertRaises(attngrad.InvalidArgumentError) as caught:
            self.client.fetch_layers([layer], zero_after_fetch=True,
                                     destinations={layer: missing})
        self.assertIn("k_norm", caught.exception.message)
        self.assertEqual(self.client.fetch_layers([layer])[layer].state.tokens, 8)


if __name__ == "__main__":
    unittest.main()
