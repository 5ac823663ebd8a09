"""A model's layers spread over several servers and the client's connections and
input dtype, against attngrad-server processes on the CPU backend:

- attngrad.ShardedClient over two servers of gemma-3-270m (--layers=4-4 and --layers=5-5): the
  merged model info, every layer-addressed call reaching the server of its layer (each server's own
  instance id in the answers, its own accumulation windows), backward_many across both, and the
  refusals: servers of different models, a server lacking a mapped layer, a layer outside the map,
  malformed maps; the layer maps of tests/fixtures/layer_maps.json, which the C++ parser is tested
  on too.
- attngrad.Client(channels=N): backward_many's N streams on N distinct TCP connections (this
  process's sockets counted in /proc/net/tcp), channels=1 sharing one; sequential backward()
  calls share one kept-open stream (one connection), concurrent ones take a stream each, on up to
  N connections.
- input_dtype="bfloat16": the answer equals the float32 answer for the bf16-rounded inputs, bit
  for bit (the server computes from exactly those values)."""
from __future__ import annotations

import json
import os
import threading
import time
import unittest
from pathlib import Path

import numpy as np

import attngrad_testing as t

import attngrad  # noqa: E402  (attngrad_testing puts client/python on sys.path)
from attngrad import tensors

HIDDEN = 640


def start(*flags):
    server = t.ServerProcess(t.required_env("ATTNGRAD_SERVER"), *flags)
    client = attngrad.Client(server.target, timeout=120)
    try:
        server.wait_ready(client)
    except BaseException:
        client.close()
        server.stop()
        raise
    return server, client


def own_socket_inodes() -> set[str]:
    """Inodes of the sockets this process holds open (links "socket:[inode]" in /proc/self/fd)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:[") and link.endswith("]"):
            inodes.add(link[len("socket:["):-1])
    return inodes


def established_connections(port: int) -> int:
    """ESTABLISHED TCP connections of this process whose remote end is 127.0.0.1:PORT (the
    client's side of each connection to the server; the server's side has PORT as its local port
    instead). Other processes' sockets (the server's, other tests') are not counted."""
    own = own_socket_inodes()
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            if state == "01" and inode in own and int(remote.rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def settled_connections(port: int) -> int:
    """established_connections(port) once it has stayed the same for 200 ms (at most 10 s): a
    closed client's connections go away asynchronously, and a count taken before they have would
    be one too many."""
    deadline = time.monotonic() + 10
    count, since = established_connections(port), time.monotonic()
    while time.monotonic() - since < 0.2 and time.monotonic() < deadline:
        time.sleep(0.02)
        now = established_connections(port)
        if now != count:
            count, since = now, time.monotonic()
    return count


class LayerMapParsing(unittest.TestCase):
    def test_ranges_single_layers_and_plain_targets(self):
        ranges = attngrad.parse_layer_map(" 13-25=host-b:50051, 0-12=host-a:50051 ,26=host-c:1")
        self.assertEqual([(r.first, r.last, r.target) for r in ranges],
                         [(0, 12, "host-a:50051"), (13, 25, "host-b:50051"), (26, 26, "host-c:1")])
        self.assertEqual(str(ranges[2]), "26=host-c:1")
        plain = attngrad.parse_layer_map("host-a:50051")
        self.assertEqual([(plain[0].first, plain[0].target)], [(None, "host-a:50051")])
        as_dict = attngrad.parse_layer_map({(0, 3): "a:1", "4-7": "b:2", 8: "c:3"})
        self.assertEqual([(r.first, r.last) for r in as_dict], [(0, 3), (4, 7), (8, 8)])

    def test_connect_picks_client_or_sharded_client(self):
        plain = attngrad.connect("127.0.0.1:1", channels=2)  # channels connect on first use
        try:
            self.assertIsInstance(plain, attngrad.Client)
            self.assertEqual(plain.channels, 2)
            self.assertIs(attngrad.connect(plain), plain)
            sharded = attngrad.connect({(0, 3): plain, (4, 7): "127.0.0.1:2"})
            self.assertIsInstance(sharded, attngrad.ShardedClient)
            self.assertIs(sharded.client_for(2), plain)
            self.assertEqual(sharded.client_for(7).target, "127.0.0.1:2")
            with self.assertRaises(attngrad.InvalidArgumentError):
                sharded.client_for(8)
            sharded.close()  # closes the client it created, not the one it was given
        finally:
            plain.close()

    def test_malformed_maps_are_refused_naming_the_piece(self):
        for text, fragment in (("0-12=a:1,12-20=b:2", "overlap"), ("0-x=a:1", "'0-x'"),
                               ("5-2=a:1", "FIRST <= LAST"), ("0-3=", "no address"),
                               ("a:1,b:2", "layer ranges"), ("", "empty")):
            with self.subTest(text=text):
                with self.assertRaises(ValueError) as caught:
                    attngrad.parse_layer_map(text)
                self.assertIn(fragment, str(caught.exception))


class LayerMapExamples(unittest.TestCase):
    """tests/fixtures/layer_maps.json: the examples of the one layer-map grammar, shared with the
    C++ parser's test (tests/proto/layer_range_test.cc)."""

    @classmethod
    def setUpClass(cls):
        path = Path(__file__).resolve().parent.parent / "fixtures" / "layer_maps.json"
        cls.examples = json.loads(path.read_text())

    def test_valid_maps_parse_to_their_ranges(self):
        self.assertTrue(self.examples["valid"])
        for example in self.examples["valid"]:
            with self.subTest(map=example["map"]):
                ranges = attngrad.parse_layer_map(example["map"])
                self.assertEqual([[r.first, r.last, r.target] for r in ranges], example["ranges"])
                self.assertEqual(",".join(str(r) for r in ranges), example["written"])

    def test_invalid_maps_are_refused(self):
        self.assertTrue(self.examples["invalid"])
        for text in self.examples["invalid"]:
            with self.subTest(map=text):
                with self.assertRaises(ValueError):
                    attngrad.parse_layer_map(text)


class ShardedAgainstTwoServers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.started = []
        try:
            for layers in ("4-4", "5-5"):
                cls.started.append(start("--model=gemma-3-270m", f"--layers={layers}"))
        except BaseException:
            cls.tearDownClass()
            raise
        (cls.server_a, cls.client_a), (cls.server_b, cls.client_b) = cls.started
        cls.layer_map = f"4={cls.server_a.target},5={cls.server_b.target}"
        cls.sharded = attngrad.ShardedClient(cls.layer_map, timeout=120)
        cls.rng = np.random.default_rng(1616)

    @classmethod
    def tearDownClass(cls):
        if hasattr(cls, "sharded"):
            cls.sharded.close()
        for server, client in cls.started:
            client.close()
            server.stop()

    def batch(self, seq_len=5, batch=1):
        hidden = (self.rng.standard_normal((batch, seq_len, HIDDEN), dtype=np.float32)
                  / np.float32(25))
        grad = self.rng.standard_normal((batch, seq_len, HIDDEN), dtype=np.float32)
        return hidden, grad, np.arange(seq_len)

    def test_info_merges_both_servers_layers(self):
        info = self.sharded.info()
        self.assertEqual([layer.index for layer in info.layers], [4, 5])
        self.assertEqual(info.model_name, "gemma-3-270m")
        self.assertEqual(info.num_hidden_layers, 18)
        ids = (self.client_a.info().server_instance_id, self.client_b.info().server_instance_id)
        self.assertEqual(info.server_instance_id, ",".join(ids))
        self.assertEqual(len(info.devices), 2)
        self.assertEqual(self.sharded.health(), "SERVING")

    def test_each_layer_goes_to_its_server(self):
        ids = {4: self.client_a.info().server_instance_id,
               5: self.client_b.info().server_instance_id}
        for layer in (4, 5):
            hidden, grad, positions = self.batch()
            result = self.sharded.backward(hidden, grad, position_ids=positions, layer=layer)
            self.assertEqual(result.server_instance_id, ids[layer])
            direct = self.sharded.client_for(layer).backward(hidden, grad, position_ids=positions,
                                                             layer=layer)
            np.testing.assert_array_equal(result.grad_hidden_states, direct.grad_hidden_states)

    def test_accumulation_fetch_and_zero_per_server(self):
        self.sharded.fetch_layers([4, 5], zero_after_fetch=True)
        sent = {4: 0, 5: 0}
        for layer, seq_len in ((4, 3), (5, 4), (5, 6)):
            hidden, grad, positions = self.batch(seq_len)
            self.sharded.backward(hidden, grad, position_ids=positions, layer=layer,
                                  mode="accumulate")
            sent[layer] += seq_len
        fetched = self.sharded.fetch_layers([5, 4])
        self.assertEqual(list(fetched), [5, 4])
        self.assertEqual({layer: g.state.tokens for layer, g in fetched.items()}, sent)
        # The same windows seen through each server's own client.
        self.assertEqual(self.client_a.fetch_gradients(layer=4).state.tokens, sent[4])
        self.assertEqual(self.client_b.fetch_gradients(layer=5).state.tokens, sent[5])
        previous, current = self.sharded.zero_gradients(layer=5)
        self.assertEqual(previous.tokens, sent[5])
        self.assertEqual(current.tokens, 0)
        self.assertEqual(self.sharded.fetch_gradients(layer=4).state.tokens, sent[4])

    def test_load_weights_reaches_the_layers_server(self):
        shapes = {"q_proj": (1024, HIDDEN), "k_proj": (256, HIDDEN), "v_proj": (256, HIDDEN),
                  "o_proj": (HIDDEN, 1024), "q_norm": (256,), "k_norm": (256,)}
        weights = {name: self.rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
                   for name, shape in shapes.items()}
        before = {layer.index: layer.weights_version for layer in self.sharded.info().layers}
        version = self.sharded.load_weights(weights, layer=5)
        after = {layer.index: layer.weights_version for layer in self.sharded.info().layers}
        self.assertEqual(after[5], version)
        self.assertNotEqual(after[5], before[5])
        self.assertEqual(after[4], before[4])

    def test_backward_many_across_servers_in_input_order(self):
        batches = []
        for layer in (4, 5, 5, 4, 5):
            hidden, grad, positions = self.batch()
            batches.append(dict(hidden_states=hidden, grad_output=grad, position_ids=positions,
                                layer=layer))
        results = list(self.sharded.backward_many(batches))
        self.assertEqual(len(results), len(batches))
        for given, result in zip(batches, results):
            alone = self.sharded.client_for(given["layer"]).backward(**given)
            np.testing.assert_array_equal(result.grad_hidden_states, alone.grad_hidden_states)

    def test_a_layer_outside_the_map_is_refused(self):
        hidden, grad, positions = self.batch()
        with self.assertRaises(attngrad.InvalidArgumentError) as caught:
            self.sharded.backward(hidden, grad, position_ids=positions, layer=6)
        self.assertIn("layer 6 is not in the layer map", caught.exception.message)
        with self.assertRaises(ValueError):
            self.sharded.backward(hidden, grad, position_ids=positions)  # no layer, two servers

    def test_a_server_without_the_mapped_layer_is_refused(self):
        wrong = attngrad.ShardedClient(f"4-5={self.server_a.target}", timeout=60)
        try:
            with self.assertRaises(attngrad.FailedPreconditionError) as caught:
                wrong.info()
            self.assertIn("missing [5]", caught.exception.message)
            self.assertIn("--layers=4-5", caught.exception.message)
        finally:
            wrong.close()

    def test_servers_of_different_models_are_refused(self):
        server, client = start("--model=gemma-3-1b", "--layers=5-5")
        try:
            mixed = attngrad.ShardedClient({4: self.client_a, 5: client})
            with self.assertRaises(attngrad.FailedPreconditionError) as caught:
                mixed.info()
            self.assertIn("different models", caught.exception.message)
        finally:
            client.close()
            server.stop()


class ChannelsAndInputDType(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server, cls.client = start("--model=gemma-3-270m", "--layers=0-0")
        cls.rng = np.random.default_rng(13)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def batch(self, seq_len=4):
        hidden = self.rng.standard_normal((2, seq_len, HIDDEN), dtype=np.float32) / np.float32(25)
        grad = self.rng.standard_normal((2, seq_len, HIDDEN), dtype=np.float32)
        return hidden, grad, np.arange(seq_len)

    def connections_after(self, channels: int, streams: int) -> int:
        before = settled_connections(self.server.port)
        with attngrad.Client(self.server.target, channels=channels, timeout=60) as client:
            self.assertEqual(client.channels, channels)
            hidden, grad, positions = self.batch()
            for _ in range(streams):
                client.backward(hidden, grad, position_ids=positions)
            return established_connections(self.server.port) - before

    def test_sequential_calls_share_one_stream_and_concurrent_ones_take_their_own(self):
        # backward() keeps its stream open: a loop of calls shares one stream, so one connection.
        self.assertEqual(self.connections_after(channels=3, streams=6), 1)
        # Concurrent calls each take a stream of their own, each opened on the next connection.
        hidden, grad, positions = self.batch(seq_len=64)
        expected = self.client.backward(hidden, grad, position_ids=positions)
        before = settled_connections(self.server.port)
        with attngrad.Client(self.server.target, channels=3, timeout=60) as client:
            start = threading.Barrier(3)
            results, failures = [], []

            def caller():
                try:
                    start.wait()
                    for _ in range(4):
                        results.append(client.backward(hidden, grad, position_ids=positions))
                except BaseException as error:  # noqa: BLE001 - reported below
                    failures.append(error)

            threads = [threading.Thread(target=caller) for _ in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            connections = established_connections(self.server.port) - before
            idle = len(client._streams._idle)
        self.assertEqual(failures, [])
        self.assertEqual(len(results), 12)
        for result in results:
            np.testing.assert_array_equal(result.grad_hidden_states, expected.grad_hidden_states)
        self.assertGreaterEqual(connections, 1)
        self.assertLessEqual(connections, 3)
        self.assertGreaterEqual(idle, 1)
        self.assertLessEqual(idle, 3)

    def test_backward_many_spreads_over_streams_in_input_order(self):
        batches = []
        for seq_len in (3, 4, 5, 6, 3, 4, 5):
            hidden, grad, positions = self.batch(seq_len)
            batches.append(dict(hidden_states=hidden, grad_output=grad, position_ids=positions))
        before = settled_connections(self.server.port)
        with attngrad.Client(self.server.target, channels=3, timeout=60) as client:
            spread = list(client.backward_many(batches, streams=3))
            connections = established_connections(self.server.port) - before
            one = list(client.backward_many(batches))
        self.assertEqual(connections, 3)
        self.assertEqual([r.grad_hidden_states.shape[1] for r in spread], [3, 4, 5, 6, 3, 4, 5])
        for a, b in zip(spread, one):
            np.testing.assert_array_equal(a.grad_hidden_states, b.grad_hidden_states)
            np.testing.assert_array_equal(a.weight_gradients["o_proj"],
                                          b.weight_gradients["o_proj"])
        with self.assertRaises(ValueError):
            list(self.client.backward_many(batches, streams=0))

    def test_a_failing_stream_raises_in_the_caller(self):
        hidden, grad, positions = self.batch()
        bad = dict(hidden_states=hidden, grad_output=grad, position_ids=positions, layer=9)
        good = dict(hidden_states=hidden, grad_output=grad, position_ids=positions)
        with self.assertRaises(attngrad.InvalidArgumentError):
            list(self.client.backward_many([good, bad, good, good], streams=2))

    def test_one_channel_shares_one_connection(self):
        self.assertEqual(self.connections_after(channels=1, streams=4), 1)

    def test_bfloat16_inputs_are_the_rounded_inputs(self):
        hidden, grad, positions = self.batch()
        rounded = [tensors.decode(tensors.contiguous(a, "bfloat16").tobytes(), "bfloat16",
                                  a.shape, field="test") for a in (hidden, grad)]
        self.assertFalse(np.array_equal(rounded[0], hidden))  # the rounding changes the input
        wire = self.client.backward(hidden, grad, position_ids=positions, input_dtype="bfloat16")
        exact = self.client.backward(*rounded, position_ids=positions, input_dtype="float32")
        np.testing.assert_array_equal(wire.grad_hidden_states, exact.grad_hidden_states)
        for name in attngrad.WEIGHT_NAMES:
            np.testing.assert_array_equal(wire.weight_gradients[name], exact.weight_gradients[name])

    def test_input_dtype_halves_the_request(self):
        hidden, grad, positions = self.batch()
        batch16 = self.client._prepare(hidden, grad, position_ids=positions, input_dtype="float16")
        batch32 = self.client._prepare(hidden, grad, position_ids=positions)
        size16 = len(batch16.request(0).serialize())
        size32 = len(batch32.request(0).serialize())
        self.assertAlmostEqual(size16 / size32, 0.5, delta=0.01)
        message = batch16.request(0).to_message()
        self.assertEqual(message.hidden_states.dtype, attngrad.client.tensor_pb2.DTYPE_FLOAT16)

    def test_unknown_input_dtype_is_refused(self):
        hidden, grad, positions = self.batch()
        with self.assertRaises(ValueError):
            self.client.backward(hidden, grad, position_ids=positions, input_dtype="int8")


if __name__ == "__main__":
    unittest.main()
