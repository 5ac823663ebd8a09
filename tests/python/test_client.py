"""The Python client (client/python, package attngrad) against attngrad-server on loopback with the
CPU backend: backward round trips (split along B, position ids, non-default scalars, pipelined)
match the CPU reference through the C ABI; ACCUMULATE + fetch with dedup of retried batches; weights
version and accumulation window mismatches; bad input raises with the server's message and the
stream and accumulators stay usable; backward()'s kept-open stream (BackwardStream).

The server runs with small limits (--max_message_bytes=134217728, --max_batch_tokens=16) so that
[3,8] batches are split in two requests along B by the client."""
from __future__ import annotations

import gc
import math
import signal
import threading
import time
import unittest
import weakref

import grpc
import numpy as np

import attngrad_testing as t

import attngrad  # noqa: E402  (attngrad_testing puts client/python on sys.path)

MAX_MESSAGE_BYTES = 128 << 20
MAX_BATCH_TOKENS = 16


class ClientAgainstServer(t.ServerTestCase):
    server_flags = (f"--max_message_bytes={MAX_MESSAGE_BYTES}",
                    f"--max_batch_tokens={MAX_BATCH_TOKENS}")

    @classmethod
    def set_up_class(cls):
        cls.reference = t.Reference(t.required_env("ATTNGRAD_LIBRARY"))
        cls.rng = np.random.default_rng(20261129)
        cls.weights = t.random_weights(cls.rng)
        cls.version = cls.client.load_weights(cls.weights)

    def assert_matches(self, output, reference, what, atol=0.0067):
        passed, matched = t.within_spec(output, reference, atol=atol)
        self.assertTrue(passed, f"{what}: only {matched:.6f} of elements within SPEC section 4")

    def current_version(self) -> int:
        return self.client.info().weights_version

    # -- info, health, weights -------------------------------------------------------------------

    def test_info_and_health(self):
        info = self.client.info()
        self.assertEqual((info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim),
                         (3072, 24, 8, 128))
        self.assertEqual(info.max_message_bytes, MAX_MESSAGE_BYTES)
        self.assertEqual(info.max_batch_tokens, MAX_BATCH_TOKENS)
        self.assertGreaterEqual(len(info.devices), 1)
        self.assertEqual(info.devices[0].backend, "cpu")
        self.assertTrue(info.server_instance_id)
        self.assertGreaterEqual(info.weights_version, self.version)
        self.assertIn("float32", info.supported_wire_dtypes)
        self.assertAlmostEqual(info.default_scaling, 1 / math.sqrt(128), places=6)
        self.assertAlmostEqual(info.default_softcap, 50.0)
        self.assertEqual(self.client.health(), "SERVING")

    def test_load_weights_bumps_version_and_honours_expected_version(self):
        before = self.current_version()
        with self.assertRaises(attngrad.FailedPreconditionError) as caught:
            self.client.load_weights(self.weights, expected_weights_version=before + 1000)
        self.assertEqual(caught.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertTrue(caught.exception.message)
        self.assertEqual(self.current_version(), before, "a refused upload changed the version")
        after = self.client.load_weights(self.weights, expected_weights_version=before)
        self.assertGreater(after, before)
        self.assertEqual(self.current_version(), after)

    def test_load_weights_rejects_wrong_shape_with_server_message(self):
        bad = dict(self.weights)
        bad["k_proj"] = np.zeros((1000, 3072), np.float32)
        before = self.current_version()
        with self.assertRaises(attngrad.AttngradError) as caught:
            self.client.load_weights(bad)
        self.assertEqual(caught.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("k_proj", caught.exception.message.lower())
        self.assertEqual(self.current_version(), before)

    # -- backward, RETURN ------------------------------------------------------------------------

    def test_backward_return_split_along_batch_matches_reference(self):
        hidden, grad, cos, sin = t.random_batch(self.rng, 3, 8)
        result = self.client.backward(hidden, grad, cos, sin, mode="return", precision="fp32")
        self.assertEqual(len(result.batch_ids), 2, "a [3,8] batch should go as 2 requests")
        self.assertEqual(result.grad_hidden_states.shape, (3, 8, 3072))
        self.assertEqual(result.weights_version, self.current_version())
        self.assertEqual(result.devices[0], "cpu")
        self.assertTrue(all(timing.total >= timing.compute > 0 for timing in result.timings))
        ref_hidden, ref_weights = self.reference.backward(hidden, grad, cos, sin, self.weights)
        self.assert_matches(result.grad_hidden_states, ref_hidden, "grad_hidden_states")
        for name, ref in ref_weights.items():
            self.assertEqual(result.weight_gradients[name].shape, ref.shape, name)
            self.assert_matches(result.weight_gradients[name], ref, f"grad {name}")
        # A split is exact: the CPU backend is deterministic, the sums differ only by fp32 rounding.
        np.testing.assert_allclose(result.grad_hidden_states, ref_hidden, rtol=1e-4, atol=1e-5)

    # -- forward ---------------------------------------------------------------------------------

    def test_forward_split_along_batch_matches_float64(self):
        hidden, _, cos, sin = t.random_batch(self.rng, 3, 8)
        version = self.current_version()
        result = self.client.forward(hidden, cos, sin, precision="fp32",
                                     expected_weights_version=version)
        self.assertEqual(len(result.batch_ids), 2, "a [3,8] batch should go as 2 requests")
        self.assertEqual(result.output.shape, (3, 8, 3072))
        self.assertIsNone(result.grad_hidden_states)
        self.assertIsNone(result.weight_gradients)
        self.assertEqual(result.weights_version, version)
        reference = t.forward_reference(hidden, cos, sin, self.weights)
        self.assert_matches(result.output, reference, "output")
        np.testing.assert_allclose(result.output, reference, rtol=1e-3, atol=1e-5)

    def test_forward_scalars_and_a_stale_version(self):
        hidden, _, cos, sin = t.random_batch(self.rng, 1, 6)
        result = self.client.forward(hidden, cos[0], sin[0], scaling=0.07, softcap=20.0)
        reference = t.forward_reference(hidden, cos, sin, self.weights, scaling=0.07,
                                        softcap=20.0)
        self.assert_matches(result.output, reference, "output")
        default = t.forward_reference(hidden, cos, sin, self.weights)
        self.assertGreater(np.abs(default - reference).max(), 1e-4, "the scalars must matter")
        with self.assertRaises(attngrad.FailedPreconditionError):
            self.client.forward(hidden, cos, sin,
                                expected_weights_version=self.current_version() + 1000)
        with self.assertRaises(ValueError):
            self.client.forward(hidden, cos, sin, mode="accumulate")
        with self.assertRaises(ValueError):
            self.client.forward(hidden, cos, sin, transport="shm")

    def test_backward_position_ids_and_scalars(self):
        hidden, grad, _, _ = t.random_batch(self.rng, 1, 8)
        positions = np.arange(5, 13)
        scaling, softcap, eps = 0.07, 20.0, 1e-5
        result = self.client.backward(hidden, grad, position_ids=positions, rope_theta=1000.0,
                                      scaling=scaling, softcap=softcap, eps=eps)
        cos, sin = t.rotary(1, 8, theta=1000.0, positions=positions[None])
        ref_hidden, ref_weights = self.reference.backward(hidden, grad, cos, sin, self.weights,
                                                          scaling=scaling, softcap=softcap, eps=eps)
        self.assert_matches(result.grad_hidden_states, ref_hidden, "grad_hidden_states")
        self.assert_matches(result.weight_gradients["q_norm"], ref_weights["q_norm"], "grad q_norm")
        # The scalars matter: the default scalars give another answer.
        default_hidden, _ = self.reference.backward(hidden, grad, cos, sin, self.weights)
        self.assertGreater(np.abs(default_hidden - ref_hidden).max(), 1e-3)

    def test_backward_zero_copy_response(self):
        hidden, grad, cos, sin = t.random_batch(self.rng, 1, 4)
        result = self.client.backward(hidden, grad, cos[0], sin[0])  # [S,D] tables broadcast
        array = result.grad_hidden_states
        self.assertFalse(array.flags.owndata, "grad_hidden_states should view the response bytes")
        self.assertIsInstance(array.base, (bytes, memoryview, np.ndarray))
        ref_hidden, _ = self.reference.backward(hidden, grad, cos, sin, self.weights)
        self.assert_matches(array, ref_hidden, "grad_hidden_states")

    def test_backward_many_pipelined_in_order(self):
        batches = [t.random_batch(self.rng, 1, 4) for _ in range(3)]
        results = list(self.client.backward_many(
            dict(hidden_states=h, grad_output=g, cos=c, sin=s, batch_id=1000 + i)
            for i, (h, g, c, s) in enumerate(batches)))
        self.assertEqual([r.batch_id for r in results], [1000, 1001, 1002])
        for (h, g, c, s), result in zip(batches, results):
            ref_hidden, _ = self.reference.backward(h, g, c, s, self.weights)
            self.assert_matches(result.grad_hidden_states, ref_hidden, "grad_hidden_states")

    def test_backward_many_error_mid_stream_names_the_batch(self):
        good = t.random_batch(self.rng, 1, 4)
        bad = (np.zeros((1, 4, 100), np.float32), np.zeros((1, 4, 100), np.float32)) + good[2:]
        batches = [dict(hidden_states=h, grad_output=g, cos=c, sin=s, batch_id=2000 + i)
                   for i, (h, g, c, s) in enumerate([good, bad, good])]
        seen = []
        with self.assertRaises(attngrad.InvalidArgumentError) as caught:
            for result in self.client.backward_many(batches):
                seen.append(result.batch_id)
        self.assertEqual(caught.exception.batch_id, 2001)
        self.assertIn("hidden_states", caught.exception.message)
        self.assertNotIn(2001, seen)
        self.assertEqual(self.client.health(), "SERVING")

    def test_float16_wire(self):
        info = self.client.info()
        hidden, grad, cos, sin = t.random_batch(self.rng, 1, 4)
        if "float16" not in info.supported_wire_dtypes:
            with self.assertRaises(attngrad.AttngradError):
                self.client.backward(hidden, grad, cos, sin, wire_dtype="float16")
            return
        result = self.client.backward(hidden, grad, cos, sin, wire_dtype="float16",
                                      response_dtype="float16")
        self.assertEqual(result.grad_hidden_states.dtype, np.float16)
        rounded = [a.astype(np.float16).astype(np.float32) for a in (hidden, grad, cos, sin)]
        ref_hidden, _ = self.reference.backward(*rounded, self.weights)
        self.assert_matches(result.grad_hidden_states.astype(np.float32), ref_hidden,
                            "grad_hidden_states", atol=0.02)

    # -- ACCUMULATE ------------------------------------------------------------------------------

    def test_accumulate_fetch_dedup_and_zero(self):
        self.client.zero_gradients()
        first = t.random_batch(self.rng, 3, 8)   # split in 2 requests
        second = t.random_batch(self.rng, 1, 8)
        r1 = self.client.backward(*first, mode="accumulate", batch_id=501)
        r2 = self.client.backward(*second, mode="accumulate", batch_id=502)
        self.assertIsNone(r1.weight_gradients)
        self.assertFalse(r1.duplicate or r2.duplicate)
        self.assertEqual(len(r1.batch_ids), 2)
        retry = self.client.backward(*first, mode="accumulate", batch_id=501)
        self.assertTrue(retry.duplicate, "a retried batch id must be reported as duplicate")
        self.assertEqual(retry.batch_ids, r1.batch_ids)
        ref1_hidden, ref1 = self.reference.backward(*first, self.weights)
        ref2_hidden, ref2 = self.reference.backward(*second, self.weights)
        self.assert_matches(r1.grad_hidden_states, ref1_hidden, "accumulate grad_hidden_states")
        self.assert_matches(retry.grad_hidden_states, ref1_hidden, "retried grad_hidden_states")

        gradients = self.client.fetch_gradients(chunk_bytes=1 << 20)
        self.assertEqual(gradients.state.tokens, 32, "the retry must not be counted twice")
        self.assertEqual(gradients.state.weights_version, self.current_version())
        self.assertEqual(gradients.state.server_instance_id, self.client.info().server_instance_id)
        for name in attngrad.WEIGHT_NAMES:
            self.assert_matches(gradients[name], ref1[name] + ref2[name], f"accumulated {name}")

        window = gradients.state.window_id
        fetched = self.client.fetch_gradients(zero_after_fetch=True, expected_window_id=window)
        self.assertEqual(fetched.state.tokens, 32)
        np.testing.assert_array_equal(fetched["o_proj"], gradients["o_proj"])
        empty = self.client.fetch_gradients()
        self.assertNotEqual(empty.state.window_id, window)
        self.assertEqual(empty.state.tokens, 0)
        self.assertEqual(empty.state.batches, 0)
        for name in attngrad.WEIGHT_NAMES:
            self.assertFalse(np.any(empty[name]), f"{name} not zeroed")
        # The old window is gone: naming it is refused.
        with self.assertRaises(attngrad.FailedPreconditionError):
            self.client.fetch_gradients(expected_window_id=window)
        with self.assertRaises(attngrad.FailedPreconditionError) as caught:
            self.client.backward(*second, mode="accumulate", accumulation_window_id=window)
        self.assertEqual(caught.exception.code, grpc.StatusCode.FAILED_PRECONDITION)

        previous, current = self.client.zero_gradients()
        self.assertEqual(previous.window_id, empty.state.window_id)
        self.assertNotEqual(current.window_id, previous.window_id)

    # -- refusals ----------------------------------------------------------------------------------

    def test_weights_version_mismatch(self):
        hidden, grad, cos, sin = t.random_batch(self.rng, 1, 4)
        stale = self.current_version() + 1000
        with self.assertRaises(attngrad.FailedPreconditionError) as caught:
            self.client.backward(hidden, grad, cos, sin, expected_weights_version=stale)
        error = caught.exception
        self.assertEqual(error.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn(str(stale), error.message)
        self.assertIn(error.message, str(error))
        # The pinned current version works.
        result = self.client.backward(hidden, grad, cos, sin,
                                      expected_weights_version=self.current_version())
        self.assertEqual(result.weights_version, self.current_version())

    def test_bad_input_raises_with_server_message_and_leaves_accumulators(self):
        self.client.zero_gradients()
        before = self.client.fetch_gradients().state
        hidden, grad, cos, sin = t.random_batch(self.rng, 1, 4)
        cases = [
            ("hidden_states", dict(hidden_states=np.zeros((1, 4, 100), np.float32),
                                   grad_output=np.zeros((1, 4, 100), np.float32), cos=cos,
                                   sin=sin)),
            ("cos", dict(hidden_states=hidden, grad_output=grad, cos=cos[..., :64],
                         sin=sin[..., :64])),
            ("scaling", dict(hidden_states=hidden, grad_output=grad, cos=cos, sin=sin,
                             scaling=float("nan"))),
        ]
        for field, kwargs in cases:
            with self.subTest(field=field):
                with self.assertRaises(attngrad.AttngradError) as caught:
                    self.client.backward(mode="accumulate", **kwargs)
                error = caught.exception
                self.assertEqual(error.code, grpc.StatusCode.INVALID_ARGUMENT, str(error))
                self.assertIn(field, error.message, f"the message should name {field}: {error}")
                self.assertIsNotNone(error.batch_id, "an in-band error carries the batch id")
        after = self.client.fetch_gradients().state
        self.assertEqual((after.window_id, after.tokens, after.batches),
                         (before.window_id, before.tokens, before.batches),
                         "refused batches must leave the accumulators untouched")
        # The server keeps serving.
        ref_hidden, _ = self.reference.backward(hidden, grad, cos, sin, self.weights)
        self.assert_matches(self.client.backward(hidden, grad, cos, sin).grad_hidden_states,
                            ref_hidden, "grad_hidden_states after errors")

    def test_sequence_over_the_limits_is_refused_with_a_reason(self):
        seq_len = MAX_BATCH_TOKENS + 8  # one sequence cannot be split further
        hidden, grad, cos, sin = t.random_batch(self.rng, 1, seq_len)
        with self.assertRaises(attngrad.AttngradError) as caught:
            self.client.backward(hidden, grad, cos, sin)
        self.assertIn(caught.exception.code, (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                              grpc.StatusCode.INVALID_ARGUMENT))
        self.assertTrue(caught.exception.message)
        self.assertEqual(self.client.health(), "SERVING")

    def test_client_side_validation(self):
        hidden, grad, cos, sin = t.random_batch(self.rng, 1, 4)
        with self.assertRaises(ValueError):
            self.client.backward(hidden[0], grad[0], cos, sin)
        with self.assertRaises(ValueError):
            self.client.backward(hidden, grad[:, :2], cos, sin)
        with self.assertRaises(ValueError):
            self.client.backward(hidden, grad)  # neither cos/sin nor position_ids
        with self.assertRaises(ValueError):
            self.client.backward(hidden, grad, cos, sin, mode="sometimes")

    def test_unreachable_server_raises_unavailable(self):
        with attngrad.Client(f"127.0.0.1:{t.free_port()}", timeout=2) as nobody:
            with self.assertRaises(attngrad.AttngradError) as caught:
                nobody.info()
        self.assertIn(caught.exception.code, (grpc.StatusCode.UNAVAILABLE,
                                              grpc.StatusCode.DEADLINE_EXCEEDED))


class BackwardStream(t.ServerTestCase):
    """backward() keeps one Backward stream open across calls: a loop of calls shares it (no
    stream, thread or connection per call); a stream that breaks under a call is replaced and the
    call's requests are sent again once with the same batch ids (ACCUMULATE counts them once); a
    call past its deadline raises DeadlineExceededError and the next call gets a new stream; a
    restarted server is reached by the next call; close() ends the stream with OK; phase timings;
    a call's arrays are freed when it returns, without the garbage collector.

    An idle open stream does not hold a server's shutdown: SIGTERM ends it at once (UNAVAILABLE),
    so these servers keep the default grace period of 30 s."""

    server_flags = ("--max_clients_with_sums=16",)

    def batch(self, batch=1, seq_len=4):
        return t.random_batch(np.random.default_rng(seq_len), batch, seq_len)

    def test_a_loop_of_calls_shares_one_stream_and_no_thread_per_call(self):
        with attngrad.Client(self.server.target, client_id="loop", timeout=60) as client:
            hidden, grad, cos, sin = self.batch()
            client.backward(hidden, grad, cos, sin, mode="accumulate")
            stream = client._streams._idle[0]
            threads = threading.active_count()
            for _ in range(5):
                result = client.backward(hidden, grad, cos, sin, mode="accumulate")
            self.assertEqual(client._streams._idle, [stream])
            self.assertEqual(threading.active_count(), threads)  # the watchdog's is there already
            self.assertEqual(client.fetch_gradients().state.batches, 6)
            self.assertIsNone(result.client_phases)

    def test_a_broken_stream_is_replaced_and_the_batch_resent_with_its_id(self):
        class Unavailable(grpc.RpcError):
            def code(self):
                return grpc.StatusCode.UNAVAILABLE

            def details(self):
                return "test: the connection dropped after the server answered"

        class LosesTheFirstAnswer:
            """A Backward call whose first answer is lost: the server has computed the batch."""

            def __init__(self, call):
                self.call = call

            def __next__(self):
                next(self.call)
                raise Unavailable()

            def __getattr__(self, name):
                return getattr(self.call, name)

        with attngrad.Client(self.server.target, client_id="resend", timeout=60) as client:
            open_stream, opened = client._streams._open, []

            def open_breaking():
                backward = open_stream()
                if opened:
                    return backward
                opened.append(True)
                return lambda requests, **options: LosesTheFirstAnswer(
                    backward(requests, **options))

            client._streams._open = open_breaking
            hidden, grad, cos, sin = self.batch()
            result = client.backward(hidden, grad, cos, sin, mode="accumulate", batch_id=4242)
            self.assertEqual(result.batch_ids, (4242,))
            self.assertTrue(result.duplicate)  # the resent batch was the one already summed
            self.assertEqual(client.fetch_gradients().state.batches, 1)
            self.assertEqual(len(client._streams._idle), 1)  # the new stream, kept

    def test_a_call_past_its_deadline_raises_and_the_next_call_works(self):
        with attngrad.Client(self.server.target, client_id="deadline", timeout=60) as client:
            hidden, grad, cos, sin = self.batch(2, 64)
            with self.assertRaises(attngrad.DeadlineExceededError):
                client.backward(hidden, grad, cos, sin, mode="accumulate", timeout=0.05)
            self.assertEqual(client._streams._idle, [])  # the expired stream is not reused
            small = self.batch()
            result = client.backward(*small, mode="accumulate")
            self.assertFalse(result.duplicate)
            self.assertEqual(len(client._streams._idle), 1)

    def test_a_restarted_server_is_reached_by_the_next_call(self):
        # The client's kept-open idle stream does not hold the server's shutdown (default grace,
        # 30 s): the server ends it at once with UNAVAILABLE and exits.
        server = t.ServerProcess(t.required_env("ATTNGRAD_SERVER"))
        restarted = None
        try:
            with attngrad.Client(server.target, timeout=60) as client:
                server.wait_ready(client)
                hidden, grad, cos, sin = self.batch()
                first = client.backward(hidden, grad, cos, sin, mode="accumulate")
                stream = client._streams._idle[0]
                self.assert_sigterm_ends_the_stream_and_exits(server, stream)
                restarted = t.ServerProcess(server.binary, f"--listen={server.target}")
                with attngrad.Client(server.target, timeout=60) as probe:
                    restarted.wait_ready(probe)
                # The first call went through a shared-memory region (transport auto), which
                # the new server does not know: the client registers one anew.
                self.assertEqual(first.transport, "shm")
                second = client.backward(hidden, grad, cos, sin, mode="accumulate")
                self.assertEqual(second.transport, "shm")
                self.assertNotEqual(second.server_instance_id, first.server_instance_id)
                self.assertFalse(second.duplicate)
                self.assertIsNot(client._streams._idle[0], stream)  # a new one
                self.assert_sigterm_ends_the_stream_and_exits(restarted, client._streams._idle[0])
        finally:
            server.stop()
            if restarted is not None:
                restarted.stop()

    def assert_sigterm_ends_the_stream_and_exits(self, server, stream):
        """SIGTERM to SERVER: its idle open STREAM ends with UNAVAILABLE naming the shutdown, and
        the server exits 0 well within its grace period of 30 s. What the exit still waits for is
        the client's connection: gRPC's server shutdown waits until its connections close, and an
        idle grpc-python channel reads the server's GOAWAY at its backup poll, every 5 s (measured:
        exit after 4.0-4.8 s; 0.04 s with GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS=200)."""
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        self.assertEqual(stream._responses.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertIn("shutting down", stream._responses.details())
        self.assertEqual(server.stop(), 0)
        self.assertLess(time.monotonic() - start, 10.0)

    def test_close_ends_the_stream_with_ok(self):
        client = attngrad.Client(self.server.target, client_id="close", timeout=60)
        try:
            client.backward(*self.batch(), mode="accumulate")
            stream = client._streams._idle[0]
        finally:
            client.close()
        self.assertTrue(stream._responses.done())
        self.assertEqual(stream._responses.code(), grpc.StatusCode.OK)

    def test_phase_timings(self):
        with attngrad.Client(self.server.target, client_id="phases", timeout=60,
                             phase_timings=True) as client:
            start = time.perf_counter()
            result = client.backward(*self.batch(), mode="accumulate", transport="bytes")
            elapsed = time.perf_counter() - start
            shared = client.backward(*self.batch(), mode="accumulate", transport="shm")
        self.assertEqual(set(shared.client_phases),
                         {"prepare", "register", "encode", "send", "wait", "decode"})
        phases = result.client_phases
        self.assertEqual(set(phases), {"prepare", "encode", "send", "wait", "decode"})
        self.assertTrue(all(seconds >= 0 for seconds in phases.values()), phases)
        self.assertLessEqual(sum(phases.values()), elapsed)
        self.assertGreater(phases["wait"], 0)

    def test_a_calls_arrays_are_freed_when_it_returns(self):
        for zero_copy in (False, True):
            with self.subTest(zero_copy=zero_copy):
                gc.disable()  # freed by reference counting alone: no cycle holds them
                try:
                    hidden, grad, cos, sin = self.batch()
                    alive = [weakref.ref(array) for array in (hidden, grad, cos, sin)]
                    result = self.client.backward(hidden, grad, cos, sin, mode="accumulate",
                                                  zero_copy=zero_copy)
                    del hidden, grad, cos, sin
                    self.assertEqual([ref() is None for ref in alive], [True] * 4)
                    self.assertEqual(result.grad_hidden_states.shape, (1, 4, t.HIDDEN))
                finally:
                    gc.enable()


class IdleExpiredStream(t.ServerTestCase):
    """A training loop that pauses longer than the server's --stream_idle_timeout_seconds (an
    evaluation, a checkpoint): the server has ended the client's kept-open stream as idle
    (DEADLINE_EXCEEDED), which the client may learn only when its next call uses that stream; the
    call then goes through on a new stream, its batch computed once."""

    server_flags = ("--stream_idle_timeout_seconds=1",)

    def test_a_call_after_the_server_ended_the_idle_stream_goes_through(self):
        with attngrad.Client(self.server.target, client_id="pause", timeout=60) as client:
            hidden, grad, cos, sin = t.random_batch(np.random.default_rng(7), 1, 4)
            client.backward(hidden, grad, cos, sin, mode="accumulate")
            stream = client._streams._idle[0]
            time.sleep(2.5)  # the server ends the stream after 1 s (checked every 0.25 s)
            # As when the client has not yet read the stream's end (an idle channel is read late).
            stream.usable = lambda: not (stream.broken or stream.expired or stream.outstanding)
            result = client.backward(hidden, grad, cos, sin, mode="accumulate")
            self.assertFalse(result.duplicate)
            self.assertEqual(client.fetch_gradients().state.batches, 2)
            self.assertIsNot(client._streams._idle[0], stream)


class WireEncoding(unittest.TestCase):
    """The client's one-copy BackwardRequest serialisation parses to the same message as
    protobuf's."""

    def test_one_copy_request_equals_the_protobuf_message(self):
        from attngrad import client as c
        rng = np.random.default_rng(3)
        for wire_dtype in ("float32", "float16", "bfloat16"):
            with self.subTest(wire_dtype=wire_dtype):
                hidden, grad, cos, sin = t.random_batch(rng, 3, 5)
                batch = c._Batch(
                    batch_id=9, hidden_states=hidden, grad_output=grad, cos=cos, sin=sin,
                    position_ids=None, rope_theta=None, mode=c.pb.GRADIENT_MODE_ACCUMULATE,
                    precision=c.pb.PRECISION_FP32, scaling=0.5, softcap=None, eps=1e-5,
                    expected_weights_version=4, accumulation_window_id=2, wire_dtype=wire_dtype,
                    response_dtype="float16", sequences_per_part=2, like=None)
                parsed = batch.request(1).to_message()  # the second part: sequence 2 only
                expected = c.pb.BackwardRequest(
                    batch_id=batch.parts[1][0], mode=c.pb.GRADIENT_MODE_ACCUMULATE,
                    precision=c.pb.PRECISION_FP32, expected_weights_version=4,
                    accumulation_window_id=2, response_dtype=c.tensor_pb2.DTYPE_FLOAT16,
                    scaling=0.5, eps=1e-5)
                c._fill_tensor(expected.hidden_states, hidden[2:3], wire_dtype)
                c._fill_tensor(expected.grad_output, grad[2:3], wire_dtype)
                c._fill_tensor(expected.rotary_tables.cos, cos[2:3], wire_dtype)
                c._fill_tensor(expected.rotary_tables.sin, sin[2:3], wire_dtype)
                self.assertEqual(parsed, expected)
                self.assertFalse(parsed.HasField("softcap"))
                decoded = c._decode(parsed.grad_output, "grad_output").astype(np.float32)
                tolerance = {"float32": 0, "float16": 1e-2, "bfloat16": 1e-1}[wire_dtype]
                np.testing.assert_allclose(decoded, grad[2:3], rtol=tolerance, atol=tolerance)

    def test_one_copy_weight_chunk(self):
        from attngrad import client as c
        data = np.arange(10, dtype=np.float32)
        head = c.pb.LoadWeightsRequest(name=c.pb.WEIGHT_NAME_K_NORM, offset=4,
                                       expected_weights_version=2)
        chunk = c._WireChunk(head, memoryview(data).cast("B")[16:40])
        parsed = c.pb.LoadWeightsRequest.FromString(chunk.serialize())
        self.assertEqual((parsed.name, parsed.offset, parsed.expected_weights_version),
                         (c.pb.WEIGHT_NAME_K_NORM, 4, 2))
        np.testing.assert_array_equal(np.frombuffer(parsed.data, np.float32), data[4:10])

    def test_zero_copy_response_parsing(self):
        from attngrad import client as c
        rng = np.random.default_rng(4)
        message = c.pb.BackwardResponse(batch_id=77, weights_version=3, device="cpu",
                                        server_instance_id="abc", duplicate=True)
        message.timings.compute_seconds = 0.25
        arrays = {"grad_hidden_states": rng.standard_normal((2, 3, 4), dtype=np.float32)}
        c._fill_tensor(message.grad_hidden_states, arrays["grad_hidden_states"], "float32")
        for index, name in enumerate(attngrad.WEIGHT_NAMES):
            arrays[name] = rng.standard_normal((index + 1, 2), dtype=np.float32)
            c._fill_tensor(getattr(message.weight_gradients, name), arrays[name], "float32")
        data = message.SerializeToString()
        parsed = c._parse_backward_response(data)
        self.assertEqual((parsed.batch_id, parsed.weights_version, parsed.device, parsed.duplicate),
                         (77, 3, "cpu", True))
        self.assertEqual(parsed.timings.compute_seconds, 0.25)
        self.assertEqual(set(parsed.raw), set(arrays))
        self.assertEqual(parsed.grad_hidden_states.raw_data, b"", "raw_data is left in the bytes")
        for name, array in arrays.items():
            tensor = (parsed.grad_hidden_states if name == "grad_hidden_states"
                      else getattr(parsed.weight_gradients, name))
            decoded = c._decode(tensor, name, c._raw_of(parsed, name))
            np.testing.assert_array_equal(decoded, array)
            self.assertFalse(decoded.flags.owndata)
        error = c.pb.BackwardResponse(batch_id=5)
        error.error.code, error.error.message = 3, "hidden_states: bad"
        parsed = c._parse_backward_response(error.SerializeToString())
        self.assertTrue(parsed.HasField("error"))
        self.assertEqual(parsed.error.message, "hidden_states: bad")
        self.assertEqual(parsed.raw, {})


class SplitPlanning(unittest.TestCase):
    """attngrad.client.sequences_per_part: the client's split along B under the server's limits."""

    def limits(self, tokens, message_bytes):
        import types
        return types.SimpleNamespace(max_batch_tokens=tokens, max_message_bytes=message_bytes)

    def test_token_limit(self):
        plan = attngrad.client.sequences_per_part
        self.assertEqual(plan(self.limits(16, 0), 3, 8, 1), 2)
        self.assertEqual(plan(self.limits(16, 0), 1, 8, 1), 1)
        self.assertEqual(plan(self.limits(0, 0), 64, 256, 1), 64)
        self.assertEqual(plan(self.limits(16, 0), 3, 32, 1), 1, "one sequence always goes")

    def test_message_limit_on_requests_and_answers(self):
        plan = attngrad.client.sequences_per_part
        per_request = 2 * 8 * 3072 * 4
        limit = (1 << 20) + 65536
        self.assertEqual(plan(self.limits(0, limit), 10, 8, per_request), (1 << 20) // per_request)
        # RETURN answers: the weight gradients leave room for fewer sequences.
        fixed = (1 << 20) - 3 * 8 * 3072 * 4
        self.assertEqual(plan(self.limits(0, limit), 10, 8, per_request, 8 * 3072 * 4, fixed), 3)


if __name__ == "__main__":
    unittest.main()
