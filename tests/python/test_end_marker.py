"""The end marker of the Python client's Backward streams (BackwardRequest.end, declared with the
request metadata attngrad-end-marker: 1): gRPC reports a stream cut inside its last message to the
server as a clean end, so a client that declares the marker ends every stream with a last request
that counts the ones before it, and the server ends a declared stream that lacks it with DATA_LOSS.
- the request iterator yields the marker after the requests, counting them, and only when asked;
- against attngrad-server (CPU backend): backward() and backward_many() declare it and end their
  streams with it (the server records those streams OK, none DATA_LOSS), and a declared stream that
  ends without it is DATA_LOSS naming the marker, after its batch was answered."""
from __future__ import annotations

import queue
import time
import unittest
import urllib.request

import grpc
import numpy as np

import attngrad_testing as t

import attngrad  # noqa: E402  (attngrad_testing puts client/python on sys.path)
from attngrad import client as client_module  # noqa: E402

pb = client_module.pb


def _outbox_of(*items):
    outbox: "queue.Queue" = queue.Queue()
    for item in items:
        outbox.put(item)
    outbox.put(client_module._END)
    return outbox


class RequestIterator(unittest.TestCase):

    def test_the_marker_follows_the_requests_and_counts_them(self):
        yielded = list(client_module._outbox_requests(_outbox_of(b"a", b"b", b"c"),
                                                      end_marker=True, serialize=True))
        self.assertEqual(yielded[:3], [b"a", b"b", b"c"])
        marker = pb.BackwardRequest.FromString(yielded[3])
        self.assertTrue(marker.HasField("end"))
        self.assertEqual(marker.end.requests, 3)
        marker.ClearField("end")
        self.assertEqual(marker.ByteSize(), 0, "the marker carries nothing but end")
        self.assertEqual(len(yielded), 4)

    def test_without_the_marker_only_the_requests(self):
        self.assertEqual(list(client_module._outbox_requests(_outbox_of(b"a"), end_marker=False,
                                                             serialize=True)), [b"a"])

    def test_unserialized_the_marker_is_a_wire_request(self):
        yielded = list(client_module._outbox_requests(_outbox_of(), end_marker=True,
                                                      serialize=False))
        self.assertEqual(len(yielded), 1)
        self.assertEqual(pb.BackwardRequest.FromString(yielded[0].serialize()).end.requests, 0)


class _RecordingCall:
    """A Backward multi-callable that records each call's metadata and the requests gRPC takes
    from it (serialised) into CALLS, and passes everything on."""

    def __init__(self, call, calls):
        self._call = call
        self._calls = calls

    def __call__(self, requests, **kwargs):
        record = {"metadata": kwargs.get("metadata"), "requests": []}
        self._calls.append(record)

        def tee():
            for request in requests:
                record["requests"].append(request if isinstance(request, bytes)
                                          else request.serialize())
                yield request

        return self._call(tee(), **kwargs)


class EndMarkerAgainstServer(t.ServerTestCase):

    metrics_port = t.free_port()
    server_flags = (f"--metrics_listen=127.0.0.1:{metrics_port}",)

    @classmethod
    def set_up_class(cls):
        cls.rng = np.random.default_rng(20261208)

    def calls_ended_with(self, code: str) -> int:
        """Backward calls the server's /metrics records as ended with CODE."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as page:
            text = page.read().decode()
        for line in text.splitlines():
            if (line.startswith("attngrad_rpc_duration_seconds_count{")
                    and 'method="Backward"' in line and f'code="{code}"' in line):
                return int(float(line.rsplit(" ", 1)[1]))
        return 0

    def wait_for_calls(self, code: str, at_least: int) -> int:
        """calls_ended_with(CODE) once it reaches AT_LEAST (a call is recorded when gRPC closes it,
        a moment after the client saw its end), or after 5 s."""
        deadline = time.monotonic() + 5
        while self.calls_ended_with(code) < at_least and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.calls_ended_with(code)

    def recording_client(self):
        """A new client whose Backward calls are recorded (_RecordingCall) into the list it
        returns with it."""
        client = attngrad.Client(self.server.target, timeout=120)
        calls = []
        next_backward = client._next_backward
        client._next_backward = lambda serialized=False: _RecordingCall(
            next_backward(serialized), calls)
        return client, calls

    def assert_ended_with_marker(self, record):
        self.assertEqual(record["metadata"], (("attngrad-end-marker", "1"),))
        requests = [pb.BackwardRequest.FromString(raw) for raw in record["requests"]]
        self.assertGreater(len(requests), 1)
        self.assertFalse(any(request.HasField("end") for request in requests[:-1]))
        self.assertTrue(requests[-1].HasField("end"))
        self.assertEqual(requests[-1].end.requests, len(requests) - 1)

    def test_info_says_the_server_checks_it(self):
        self.assertTrue(self.client.info().backward_end_marker)

    def test_backward_and_backward_many_end_their_streams_with_it(self):
        ok_before = self.calls_ended_with("OK")
        data_loss_before = self.calls_ended_with("DATA_LOSS")
        client, calls = self.recording_client()
        hidden, grad, cos, sin = t.random_batch(self.rng, 1, 4)
        for batch_id in (1, 2):
            client.backward(hidden, grad, cos, sin, mode="accumulate", batch_id=batch_id)
        results = list(client.backward_many(
            [dict(hidden_states=hidden, grad_output=grad, cos=cos, sin=sin, mode="accumulate",
                  batch_id=batch_id) for batch_id in (3, 4, 5)]))
        self.assertEqual(len(results), 3)
        client.close()  # half-closes the kept-open stream of backward()
        self.assertEqual(len(calls), 2)  # backward()'s kept-open stream, backward_many()'s
        for record in calls:
            self.assert_ended_with_marker(record)
        # backward()'s stream ended OK: its marker came and counted right (close() waits for the
        # end; backward_many() does not, and may cancel its stream first).
        self.assertGreaterEqual(self.wait_for_calls("OK", ok_before + 1), ok_before + 1)
        self.assertEqual(self.calls_ended_with("DATA_LOSS"), data_loss_before)

    def test_a_declared_stream_that_ends_without_it_is_data_loss(self):
        hidden, grad, cos, sin = t.random_batch(self.rng, 1, 4)
        batch = self.client._prepare(hidden, grad, cos, sin, mode="accumulate", batch_id=10)
        request = batch.request(0).serialize()
        call = self.client._next_backward(serialized=True)
        responses = call(iter([request]), timeout=60,
                         metadata=client_module._END_MARKER_METADATA)
        answer = next(responses)
        self.assertEqual(answer.batch_id, 10)
        self.assertFalse(answer.HasField("error"))
        with self.assertRaises(grpc.RpcError) as raised:
            next(responses)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.DATA_LOSS)
        self.assertIn("without its end marker", raised.exception.details())
        self.assertIn("after the 1 request(s)", raised.exception.details())


if __name__ == "__main__":
    unittest.main()
