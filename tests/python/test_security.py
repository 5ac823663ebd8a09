"""The Python client against attngrad-server with mutual TLS and bearer tokens:
attngrad.tls_credentials (a CA, a client certificate and key) and token=...; a trainer computes and
fetches its own window, cannot load weights (PERMISSION_DENIED); no token is UNAUTHENTICATED; an
admin fetches-and-zeroes the trainer's window with for_client=...; a client without a certificate
gets no connection. Certificates are made here with the openssl CLI."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import unittest
from pathlib import Path

import grpc
import numpy as np

import attngrad_testing as t

import attngrad  # noqa: E402  (attngrad_testing puts client/python on sys.path)

TRAINER_TOKEN = "py-trainer-token-0123456789"
ADMIN_TOKEN = "py-admin-token-0123456789abc"

MAKE_CERTIFICATES = """set -e
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1"; }
key ca.key; openssl req -x509 -new -key ca.key -out ca.pem -days 2 -subj /CN=attngrad-test-ca
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext
key server.key; openssl req -new -key server.key -out server.csr -subj /CN=localhost
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 \\
  -extfile server.ext
printf 'extendedKeyUsage=clientAuth\\n' > client.ext
key client.key; openssl req -new -key client.key -out client.csr -subj /CN=trainer
openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 2 \\
  -extfile client.ext
"""


class SecureServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.directory = Path(tempfile.mkdtemp(prefix="attngrad-py-tls-"))
        subprocess.run(["/bin/sh", "-c", MAKE_CERTIFICATES], cwd=cls.directory, check=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        (cls.directory / "tokens.txt").write_text(
            f"{TRAINER_TOKEN} trainer trainer-py\n{ADMIN_TOKEN} admin ops\n")
        (cls.directory / "trainer.token").write_text(TRAINER_TOKEN + "\n")
        d = cls.directory
        cls.server = t.ServerProcess(t.required_env("ATTNGRAD_SERVER"),
                                     f"--tls_cert={d / 'server.pem'}",
                                     f"--tls_key={d / 'server.key'}",
                                     f"--tls_client_ca={d / 'ca.pem'}",
                                     f"--tokens_file={d / 'tokens.txt'}")
        try:
            cls.trainer = cls.client(token=attngrad.read_token_file(str(d / "trainer.token")))
            cls.server.wait_ready(cls.trainer)
        except BaseException:
            cls.server.stop()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.trainer.close()
        cls.server.stop()
        shutil.rmtree(cls.directory, ignore_errors=True)

    @classmethod
    def client(cls, certificate: bool = True, **kwargs) -> attngrad.Client:
        d = cls.directory
        credentials = attngrad.tls_credentials(
            ca=str(d / "ca.pem"), cert=str(d / "client.pem") if certificate else None,
            key=str(d / "client.key") if certificate else None)
        kwargs.setdefault("timeout", 60)
        return attngrad.Client(cls.server.target, credentials=credentials,
                               tls_server_name="localhost", **kwargs)

    def test_roles_and_windows(self):
        rng = np.random.default_rng(14)
        hidden, grad, cos, sin = t.random_batch(rng, 1, 4)
        self.trainer.info()
        self.trainer.backward(hidden, grad, cos, sin, mode="accumulate", batch_id=5)
        own = self.trainer.fetch_gradients()
        self.assertEqual(own.state.batches, 1)
        with self.assertRaises(attngrad.AttngradError) as denied:
            self.trainer.load_weights(t.random_weights(rng))
        self.assertEqual(denied.exception.code, grpc.StatusCode.PERMISSION_DENIED)
        with self.assertRaises(attngrad.AttngradError) as denied:
            self.trainer.zero_gradients()
        self.assertEqual(denied.exception.code, grpc.StatusCode.PERMISSION_DENIED)

        with self.client() as anonymous:
            with self.assertRaises(attngrad.AttngradError) as refused:
                anonymous.info()
            self.assertEqual(refused.exception.code, grpc.StatusCode.UNAUTHENTICATED)

        with self.client(token=ADMIN_TOKEN, for_client="trainer-py") as admin:
            taken = admin.fetch_gradients(zero_after_fetch=True)
            self.assertEqual(taken.state.batches, 1)
            np.testing.assert_array_equal(taken["o_proj"], own["o_proj"])
        self.assertEqual(self.trainer.fetch_gradients().state.batches, 0)

    def test_no_client_certificate_no_connection(self):
        with self.client(certificate=False, token=TRAINER_TOKEN, timeout=5) as stranger:
            with self.assertRaises(attngrad.AttngradError) as refused:
                stranger.info(timeout=5)
            self.assertEqual(refused.exception.code, grpc.StatusCode.UNAVAILABLE)


if __name__ == "__main__":
    unittest.main()
