"""attngrad.torch.offload: the attention backward of every layer of a Gemma-3
model moved to attngrad servers in one call, against attngrad-server processes on the CPU backend
serving gemma-3-270m layers (hidden 640, 4 heads, 1 kv head, head_dim 256).

The model is transformers' Gemma3ForCausalLM with a tiny config when transformers is importable,
and always the stand-in of gemma3_standin.py (the same module tree and arithmetic). For each: the
offloaded forward returns exactly the local forward's output, and one training step's parameter
gradients (attention weights and everything else) equal local autograd's to float32 accuracy, in
RETURN and ACCUMULATE mode, on one server and with the layers split over two; a few SGD steps
follow the local loss curve; remove() gives the modules their own backward back. Skips without
PyTorch (CI's interpreter has none)."""
from __future__ import annotations

import copy
import unittest
import unittest.mock

import attngrad_testing as t

try:
    import torch
except ImportError:  # pragma: no cover - CI without PyTorch
    torch = None

try:
    import transformers
except ImportError:
    transformers = None

if torch is not None:
    import gemma3_standin as standin

    import attngrad
    import attngrad.torch as attngrad_torch

SEQ_LEN, BATCH = 8, 2
GRADIENT_RTOL = 2e-4  # ||offloaded - local|| / ||local|| per parameter (float32 on both sides)


def relative_error(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@unittest.skipIf(torch is None, "PyTorch is not installed")
class OffloadBase(unittest.TestCase):
    """Servers of gemma-3-270m layers 0-1: one holding both, and two holding one each."""

    @classmethod
    def setUpClass(cls):
        cls.servers = []
        try:
            for layers in ("0-1", "0-0", "1-1"):
                server = t.ServerProcess(t.required_env("ATTNGRAD_SERVER"), "--model=gemma-3-270m",
                                         f"--layers={layers}")
                cls.servers.append(server)
                probe = attngrad.Client(server.target, timeout=120)
                try:
                    server.wait_ready(probe)
                finally:
                    probe.close()
        except BaseException:
            cls.tearDownClass()
            raise
        both, first, second = cls.servers
        cls.one_server = both.target
        cls.two_servers = f"0-0={first.target},1-1={second.target}"
        torch.manual_seed(0)

    @classmethod
    def tearDownClass(cls):
        for server in cls.servers:
            server.stop()

    def make_model(self):
        raise NotImplementedError

    def loss(self, model, input_ids):
        raise NotImplementedError

    def inputs(self, seed=1):
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, 64, (BATCH, SEQ_LEN), generator=generator)

    def check_step(self, target, mode):
        local = self.make_model()
        remote = copy.deepcopy(local)
        input_ids = self.inputs()
        with attngrad_torch.offload(remote, target, mode=mode, precision="fp32",
                                    timeout=120) as handle:
            self.assertEqual(sorted(handle.layers), [0, 1])
            local_loss = self.loss(local, input_ids)
            remote_loss = self.loss(remote, input_ids)
            self.assertTrue(torch.equal(local_loss.detach(), remote_loss.detach()),
                            f"forward changed: {local_loss.item()} vs {remote_loss.item()}")
            local_loss.backward()
            remote_loss.backward()
            if mode == "accumulate":
                states = handle.fetch_gradients()
                self.assertEqual({i: s.tokens for i, s in states.items()},
                                 {0: BATCH * SEQ_LEN, 1: BATCH * SEQ_LEN})
            for layer in handle.last_results().values():
                self.assertIsNotNone(layer)  # every layer's backward ran on a server
        remote_parameters = dict(remote.named_parameters())
        checked = 0
        for name, parameter in local.named_parameters():
            other = remote_parameters[name].grad
            self.assertIsNotNone(other, name)
            self.assertLess(relative_error(other, parameter.grad), GRADIENT_RTOL, name)
            checked += ".self_attn." in name
        self.assertEqual(checked, 12)  # six weights in each of the two layers

    def test_return_mode_one_server(self):
        self.check_step(self.one_server, "return")

    def test_accumulate_mode_one_server(self):
        self.check_step(self.one_server, "accumulate")

    def test_return_mode_two_servers(self):
        self.check_step(self.two_servers, "return")

    def test_accumulate_mode_two_servers(self):
        self.check_step(self.two_servers, "accumulate")

    def test_training_steps_follow_the_local_loss_curve(self):
        self.check_loss_curve(server_forward=False)

    def test_training_steps_with_the_forward_on_the_servers_follow_the_local_curve(self):
        with unittest.mock.patch.object(attngrad_torch, "_remote_forward",
                                        wraps=attngrad_torch._remote_forward) as spied:
            self.check_loss_curve(server_forward=True)
        self.assertEqual(spied.call_count, 4 * 2, "each layer's forward of each step")

    def check_loss_curve(self, server_forward):
        local = self.make_model()
        remote = copy.deepcopy(local)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (local, remote)]
        handle = attngrad_torch.offload(remote, self.two_servers, timeout=120, precision="fp32",
                                        server_forward=server_forward)
        try:
            versions = []
            for step in range(4):
                input_ids = self.inputs(seed=10 + step)
                losses = []
                for model, optimizer in zip((local, remote), optimizers):
                    optimizer.zero_grad()
                    loss = self.loss(model, input_ids)
                    loss.backward()
                    optimizer.step()
                    losses.append(loss.item())
                self.assertLess(abs(losses[1] - losses[0]) / abs(losses[0]), 1e-5, (step, losses))
                versions.append(handle.layers[0].weights_version)
            self.assertEqual(len(set(versions)), len(versions))  # re-uploaded after every step
        finally:
            handle.remove()

    def test_remove_gives_the_modules_their_backward_back(self):
        model = self.make_model()
        handle = attngrad_torch.offload(model, self.one_server, timeout=120)
        attention = handle.layers[0].module
        self.assertIn("forward", attention.__dict__)
        handle.remove()
        self.assertNotIn("forward", attention.__dict__)
        self.loss(model, self.inputs()).backward()
        self.assertIsNone(handle.layers[0].binding.last_result)  # no backward reached a server
        self.assertIsNotNone(attention.q_proj.weight.grad)

    def test_no_grad_forward_stays_local(self):
        model = self.make_model()
        with attngrad_torch.offload(model, self.one_server, timeout=120) as handle:
            with torch.no_grad():
                self.loss(model, self.inputs())
            self.assertIsNone(handle.layers[0].weights_version)  # nothing uploaded

    def test_a_layer_the_servers_do_not_hold_is_refused(self):
        model = self.make_model()
        first = self.servers[1].target  # holds layer 0 only
        with self.assertRaises(attngrad.FailedPreconditionError):
            attngrad_torch.offload(model, f"0-1={first}", timeout=60)
        with self.assertRaises(ValueError) as caught:
            attngrad_torch.offload(model, first, timeout=60)  # one server: layer 1 missing
        self.assertIn("layer 1 is not served", str(caught.exception))


class StandInModel(OffloadBase):
    def make_model(self):
        config = standin.StandInConfig(layer_types=["sliding_attention", "full_attention"])
        model = standin.CausalLM(config)
        standin.randomize(model, seed=3)
        return model

    def loss(self, model, input_ids):
        return model.loss(input_ids)


@unittest.skipIf(transformers is None, "transformers is not installed")
class TransformersModel(OffloadBase):
    def make_model(self):
        config = transformers.Gemma3TextConfig(
            vocab_size=64, hidden_size=640, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=64, attn_implementation="eager", use_cache=False)
        torch.manual_seed(3)
        model = transformers.Gemma3ForCausalLM(config)
        with torch.no_grad():  # norms away from 0 so that their gradients are exercised
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.normal_(0.0, 0.1)
        return model

    def loss(self, model, input_ids):
        return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


del OffloadBase  # the cases above run once per model

if __name__ == "__main__":
    unittest.main()
