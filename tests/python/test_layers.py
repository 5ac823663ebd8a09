"""The Python client against a server holding several layers of a model:
attngrad-server --weights=random --model=gemma-3-270m --layers=4-5 on the CPU backend (layer 4 a
sliding-window layer, layer 5 a full one). GetModelInfo's layers, layer-addressed batches
(layer=..., sliding_window=...), per-layer accumulation, fetch_layers and a per-layer zero, and an
unknown layer raising InvalidArgumentError naming the range. The gradients themselves are checked
against the CPU reference by tests/server/model_test.cc."""
from __future__ import annotations

import unittest

import numpy as np

import attngrad_testing as t

import attngrad  # noqa: E402  (attngrad_testing puts client/python on sys.path)

HIDDEN, HEAD_DIM = 640, 256


class LayersAgainstServer(t.ServerTestCase):
    server_flags = ("--model=gemma-3-270m", "--layers=4-5")

    @classmethod
    def set_up_class(cls):
        cls.rng = np.random.default_rng(16)

    def batch(self, seq_len=6):
        hidden = self.rng.standard_normal((1, seq_len, HIDDEN), dtype=np.float32) / np.float32(25.0)
        grad = self.rng.standard_normal((1, seq_len, HIDDEN), dtype=np.float32)
        return hidden, grad, np.arange(seq_len)

    def test_info_lists_the_layers(self):
        info = self.client.info()
        self.assertEqual(info.model_name, "gemma-3-270m")
        self.assertEqual(info.num_hidden_layers, 18)
        self.assertEqual([layer.index for layer in info.layers], [4, 5])
        sliding, full = info.layers
        self.assertEqual((sliding.type, sliding.sliding_window, sliding.rope_theta),
                         ("sliding", 512, 10000.0))
        self.assertEqual((full.type, full.sliding_window, full.rope_theta), ("full", 0, 1e6))
        self.assertEqual(full.head_dim, HEAD_DIM)
        self.assertLessEqual(full.softcap, 0.0)
        self.assertAlmostEqual(full.scaling, 256 ** -0.5, places=6)
        self.assertEqual(info.head_dim, HEAD_DIM)  # the old fields: the first layer

    def test_layer_addressed_batches_accumulate_per_layer(self):
        for layer in (4, 5):
            self.client.zero_gradients(layer=layer)
        hidden, grad, positions = self.batch()
        returned = self.client.backward(hidden, grad, position_ids=positions, layer=5)
        self.assertEqual(returned.grad_hidden_states.shape, (1, 6, HIDDEN))
        # sliding_window overrides the layer's; a window of 512 over 6 tokens changes nothing.
        windowed = self.client.backward(hidden, grad, position_ids=positions, layer=5,
                                        sliding_window=512)
        np.testing.assert_allclose(windowed.grad_hidden_states, returned.grad_hidden_states,
                                   rtol=1e-5, atol=1e-6)
        self.client.backward(hidden, grad, position_ids=positions, layer=5, mode="accumulate")
        self.client.backward(hidden, grad, position_ids=positions, layer=4, mode="accumulate")
        self.client.backward(hidden, grad, position_ids=positions, layer=4, mode="accumulate",
                             batch_id=424242)
        fetched = self.client.fetch_layers([5, 4])
        self.assertEqual(sorted(fetched), [4, 5])
        self.assertEqual(fetched[5].state.batches, 1)
        self.assertEqual(fetched[4].state.batches, 2)
        np.testing.assert_allclose(fetched[5]["q_proj"],
                                   returned.weight_gradients["q_proj"], rtol=1e-4, atol=1e-6)
        previous, _ = self.client.zero_gradients(layer=4)
        self.assertEqual((previous.layer, previous.batches), (4, 2))
        self.assertEqual(self.client.fetch_gradients(layer=4).state.batches, 0)
        self.assertEqual(self.client.fetch_gradients(layer=5).state.batches, 1)

    def test_unknown_layer_names_the_range(self):
        hidden, grad, positions = self.batch(3)
        with self.assertRaises(attngrad.InvalidArgumentError) as raised:
            self.client.backward(hidden, grad, position_ids=positions, layer=6)
        self.assertIn("4-5", str(raised.exception))
        with self.assertRaises(attngrad.InvalidArgumentError):
            self.client.fetch_layers([0])


if __name__ == "__main__":
    unittest.main()
