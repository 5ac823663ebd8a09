"""attngrad.torch against attngrad-server (CPU backend) when the interpreter has PyTorch: the
autograd bridge's gradients equal float64 PyTorch autograd of the same layer under SPEC section 4
(RETURN and ACCUMULATE), the weights are uploaded by the backward (never the forward) after an
optimizer step, weights changed between a forward and its backward are refused, and the bridge saves
only hidden_states, cos and sin for the backward. CI installs Debian's python3-torch (CPU);
without PyTorch the suite reports itself skipped (the GPU check is
client/python/examples/check_autograd.py)."""
from __future__ import annotations

import pathlib
import re
import unittest
import unittest.mock

import numpy as np

import attngrad_testing as t

try:
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None


@unittest.skipIf(torch is None, "PyTorch is not installed for this interpreter")
class TorchBridgeAgainstServer(t.ServerTestCase):
    server_flags = ("--max_batch_tokens=16",)

    @classmethod
    def set_up_class(cls):
        import attngrad.torch as bridge
        cls.bridge = bridge
        torch.manual_seed(1234)

    def inputs(self, batch, seq_len):
        hidden = (torch.randn(batch, seq_len, 3072) / 3072 ** 0.5).requires_grad_()
        grad = torch.randn(batch, seq_len, 3072)
        cos, sin = self.bridge.rotary_tables(torch.arange(seq_len).expand(batch, seq_len))
        return hidden, grad, cos, sin

    def reference(self, module, hidden, grad, cos, sin):
        """float64 autograd of gemma3_attention with the module's weights."""
        weights = {n: w.detach().double().requires_grad_() for n, w in module.weights().items()}
        hidden64 = hidden.detach().double().requires_grad_()
        out = self.bridge.gemma3_attention(hidden64, cos.double(), sin.double(), weights["q_proj"],
                                           weights["k_proj"], weights["v_proj"], weights["o_proj"],
                                           weights["q_norm"], weights["k_norm"])
        out.backward(grad.double())
        return out.detach(), hidden64.grad, {n: w.grad for n, w in weights.items()}

    def assert_matches(self, output, reference, what):
        passed, matched = t.within_spec(output.detach().numpy(), reference.detach().numpy())
        self.assertTrue(passed, f"{what}: only {matched:.6f} within SPEC section 4")

    def test_return_mode_matches_autograd(self):
        module = self.bridge.RemoteGemma3Attention(self.client, mode="return", precision="fp32")
        hidden, grad, cos, sin = self.inputs(2, 8)
        out = module(hidden, cos, sin)
        out.backward(grad)
        ref_out, ref_hidden, ref_weights = self.reference(module, hidden, grad, cos, sin)
        np.testing.assert_allclose(out.detach().numpy(), ref_out.numpy(), rtol=1e-4, atol=1e-5)
        self.assert_matches(hidden.grad, ref_hidden, "grad hidden_states")
        for name, parameter in module.weights().items():
            self.assert_matches(parameter.grad, ref_weights[name], f"grad {name}")
        self.assertEqual(module.last_result.weights_version, module.weights_version)

    def test_accumulate_mode_fetch_and_weight_upload_after_step(self):
        module = self.bridge.RemoteGemma3Attention(self.client, mode="accumulate", precision="fp32")
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        expected = {n: torch.zeros_like(w, dtype=torch.float64)
                    for n, w in module.weights().items()}
        for batch in (1, 3):  # [3,8] is split in two requests along B
            hidden, grad, cos, sin = self.inputs(batch, 8)
            module(hidden, cos, sin).backward(grad)
            _, ref_hidden, ref_weights = self.reference(module, hidden, grad, cos, sin)
            self.assert_matches(hidden.grad, ref_hidden, "grad hidden_states")
            for name in expected:
                expected[name] += ref_weights[name]
        self.assertTrue(all(w.grad is None for w in module.weights().values()),
                        "ACCUMULATE leaves .grad alone until the fetch")
        state = module.fetch_gradients()
        self.assertEqual(state.tokens, 32)
        for name, parameter in module.weights().items():
            self.assert_matches(parameter.grad, expected[name], f"accumulated grad {name}")
        version = module.weights_version
        optimizer.step()
        optimizer.zero_grad()
        hidden, grad, cos, sin = self.inputs(1, 8)
        module(hidden, cos, sin).backward(grad)
        self.assertGreater(module.weights_version, version,
                           "the step's new weights were not uploaded")
        self.assertEqual(module.last_result.weights_version, module.weights_version)
        state = module.fetch_gradients()
        self.assertEqual((state.tokens, state.weights_version), (8, module.weights_version))

    def test_server_forward_matches_autograd_and_the_local_forward(self):
        hidden, grad, cos, sin = self.inputs(3, 8)  # split in two requests along B
        local = self.bridge.RemoteGemma3Attention(self.client, mode="return", precision="fp32",
                                                  server_forward=False)
        remote = self.bridge.RemoteGemma3Attention(self.client, mode="return", precision="fp32",
                                                   server_forward=True)
        remote.load_state_dict(local.state_dict())
        answers = []
        for module, calls in ((local, 0), (remote, 1)):
            source = hidden.detach().clone().requires_grad_()
            with unittest.mock.patch.object(self.client, "submit_forward",
                                            wraps=self.client.submit_forward) as spied:
                out = module(source, cos, sin)
            self.assertEqual(spied.call_count, calls, "the server computed the forward")
            out.backward(grad)
            answers.append((out.detach(), source.grad))
        self.assertEqual(remote.last_result.weights_version, remote.weights_version)
        ref_out, ref_hidden, ref_weights = self.reference(remote, hidden, grad, cos, sin)
        self.assert_matches(answers[1][0], ref_out, "server forward output")
        np.testing.assert_allclose(answers[1][0].numpy(), answers[0][0].numpy(), rtol=1e-4,
                                   atol=1e-5)
        self.assertTrue(torch.equal(answers[0][1], answers[1][1]),
                        "the backward does not depend on where the forward ran")
        for name, parameter in remote.weights().items():
            self.assert_matches(parameter.grad, ref_weights[name], f"grad {name}")

    def test_server_forward_sees_each_optimizer_step(self):
        module = self.bridge.RemoteGemma3Attention(self.client, mode="accumulate",
                                                   precision="fp32", server_forward=True)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
        for _ in range(2):
            hidden, grad, cos, sin = self.inputs(1, 8)
            out = module(hidden, cos, sin)
            ref_out, _, _ = self.reference(module, hidden, grad, cos, sin)
            self.assert_matches(out, ref_out, "output after a step")
            out.backward(grad)
            module.fetch_gradients()
            optimizer.step()
            optimizer.zero_grad()

    def test_the_forward_makes_no_remote_call_and_the_backward_uploads(self):
        module = self.bridge.RemoteGemma3Attention(self.client, mode="return", precision="fp32")
        before = self.client.info().layers[0].weights_version
        hidden, grad, cos, sin = self.inputs(1, 8)
        out = module(hidden, cos, sin)
        self.assertIsNone(module.weights_version, "the forward uploaded the weights")
        self.assertEqual(self.client.info().layers[0].weights_version, before)
        out.backward(grad)
        self.assertIsNotNone(module.weights_version)
        self.assertGreater(module.weights_version, before)
        self.assertEqual(module.last_result.weights_version, module.weights_version)

    def test_weights_changed_between_forward_and_backward_are_refused(self):
        module = self.bridge.RemoteGemma3Attention(self.client, mode="return", precision="fp32")
        hidden, grad, cos, sin = self.inputs(1, 8)
        out = module(hidden, cos, sin)
        with torch.no_grad():
            module.k_proj.weight.mul_(2.0)
        with self.assertRaisesRegex(RuntimeError, "modified in place"):
            out.backward(grad)
        self.assertIsNone(module.last_result, "a backward reached the server")

    def test_stream_ordered_on_cpu_tensors_answers_each_call_as_before(self):
        hidden, grad, cos, sin = self.inputs(1, 8)
        gradients, state = [], None
        for ordered in (False, True):
            module = self.bridge.RemoteGemma3Attention(self.client, mode="return",
                                                       precision="fp32", stream_ordered=ordered)
            if state is None:
                state = module.state_dict()
            module.load_state_dict(state)
            source = hidden.detach().clone().requires_grad_()
            module(source, cos, sin).backward(grad)
            self.assertIsNotNone(module.last_result)
            gradients.append([source.grad] + [w.grad for w in module.weights().values()])
        for plain, ordered in zip(*gradients):
            self.assertTrue(torch.equal(plain, ordered))

    def test_the_readme_snippets_run_as_written(self):
        root = pathlib.Path(__file__).resolve().parents[2]
        for readme in (root / "README.md", root / "client" / "python" / "README.md"):
            with self.subTest(readme=readme.name):
                blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
                snippet, = [b for b in blocks if "RemoteGemma3Attention(client" in b]
                self.assertIn('"gpu-box:50051"', snippet)
                hidden, _, cos, sin = self.inputs(1, 8)
                names = {"hidden_states": hidden, "cos": cos, "sin": sin}
                with unittest.mock.patch.object(torch.nn.Module, "cuda",
                                                lambda module, *args, **kwargs: module):
                    exec(snippet.replace('"gpu-box:50051"', repr(self.server.target)), names)
                attention = names["attention"]
                self.assertEqual(attention.last_result.server_instance_id,
                                 self.client.info().server_instance_id)
                for parameter in attention.parameters():
                    self.assertIsNotNone(parameter.grad, "fetch_gradients did not fill .grad")
                names["client"].close()

    def test_saves_only_hidden_states_and_rotary_tables(self):
        module = self.bridge.RemoteGemma3Attention(self.client, mode="return")
        hidden, grad, cos, sin = self.inputs(1, 16)
        saved = []

        def pack(tensor):
            saved.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            module(hidden, cos, sin)
        self.assertEqual(sum(saved), (hidden.numel() + cos.numel() + sin.numel()) * 4)
        saved.clear()
        weights = module.weights()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            self.bridge.gemma3_attention(hidden, cos, sin, *weights.values())
        self.assertGreater(sum(saved), 10 * hidden.numel() * 4,
                           "eager autograd should keep many activations")

    def test_train_step_example_loss_goes_down(self):
        import subprocess
        import sys
        script = t.REPO_ROOT / "client" / "python" / "examples" / "train_step.py"
        run = subprocess.run([sys.executable, str(script), "--target", self.server.target,
                              "--device", "cpu", "--batch", "1", "--seq-len", "8", "--steps", "3"],
                             capture_output=True, text=True, timeout=300)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn("went down", run.stdout)


class _QueuingClient:
    """A client whose submit_after_stream records the layer of each queued task."""

    def __init__(self):
        self.queued = []

    def submit_after_stream(self, tensor, task, *, timeout=None, layer=None):
        self.queued.append(layer)
        return object()


class _FakeLayer:
    """What _PinnedWeights asks of an offloaded layer: a fingerprint that changes with an
    optimizer step, and the fingerprint uploaded last."""

    def __init__(self, index, client):
        self.binding = unittest.mock.Mock(sender_uploads=True, client=client, layer=index)
        self.step = 0
        self.uploaded = None
        self.upload_queued_for = None
        self.upload_group = None

    def fingerprint(self):
        return (self.binding.layer, self.step)

    def needs_upload(self, fingerprint):
        return fingerprint != self.uploaded

    def sync_weights(self, synchronize=True):
        return 1


@unittest.skipIf(torch is None, "PyTorch is not installed for this interpreter")
class SenderUploadsOfAGroup(unittest.TestCase):
    def test_the_first_forward_after_a_step_queues_every_later_layers_upload(self):
        import attngrad.torch as bridge
        client = _QueuingClient()
        group = [_FakeLayer(index, client) for index in range(3)]
        for layer in group:
            layer.upload_group = group
        sample = torch.zeros(1)
        for step in range(2):
            for layer in group:
                layer.step = step
            bridge._PinnedWeights(group[0], group[0].binding, sample)
            self.assertEqual(client.queued, [0, 1, 2], f"step {step}: the first layer's forward")
            for layer in group[1:]:  # the rest of the model's forward
                bridge._PinnedWeights(layer, layer.binding, sample)
            self.assertEqual(client.queued, [0, 1, 2], f"step {step}")
            client.queued.clear()
        group[2].step = 5  # changed in place after its upload was queued: queued again
        bridge._PinnedWeights(group[2], group[2].binding, sample)
        self.assertEqual(client.queued, [2])


if __name__ == "__main__":
    unittest.main()
