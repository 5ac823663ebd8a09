"""Helpers of the Python client's tests: SPEC section 3 inputs, the CPU reference backend through
the C ABI (libattngrad.so via ctypes), SPEC section 4's comparison, and an attngrad-server process
on a loopback port.

Paths come from the environment (ctest sets them from the build):
  ATTNGRAD_SERVER   the attngrad-server binary
  ATTNGRAD_LIBRARY  libattngrad.so
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

import numpy as np

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 3072, 24, 8, 128
SCALING, SOFTCAP, EPS = 1.0 / np.sqrt(128.0), 50.0, 1e-6
WEIGHT_SHAPES = {"q_proj": (3072, 3072), "k_proj": (1024, 3072), "v_proj": (1024, 3072),
                 "o_proj": (3072, 3072), "q_norm": (128,), "k_norm": (128,)}
REPO_ROOT = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(REPO_ROOT / "client" / "python"))


def rotary(batch: int, seq_len: int, theta: float = 10000.0, positions=None):
    """cos, sin [B,S,128] of SPEC section 3 (positions 0..S-1 unless given, [B,S])."""
    if positions is None:
        positions = np.broadcast_to(np.arange(seq_len), (batch, seq_len))
    inv_freq = theta ** (-np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)
    freqs = np.asarray(positions, dtype=np.float64)[..., None] * inv_freq
    embedding = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(embedding).astype(np.float32), np.sin(embedding).astype(np.float32)


def random_weights(rng: np.random.Generator):
    """The six weights drawn as in SPEC section 3."""
    weights = {}
    for name, shape in WEIGHT_SHAPES.items():
        scale = 0.02 if len(shape) == 1 else np.sqrt(2.0 / HIDDEN)
        weights[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))
    return weights


def random_batch(rng: np.random.Generator, batch: int, seq_len: int):
    """hidden_states, grad_output [B,S,3072] and cos, sin [B,S,128] as in SPEC section 3."""
    hidden = (rng.standard_normal((batch, seq_len, HIDDEN), dtype=np.float32)
              / np.float32(np.sqrt(HIDDEN)))
    grad = rng.standard_normal((batch, seq_len, HIDDEN), dtype=np.float32)
    cos, sin = rotary(batch, seq_len)
    return hidden, grad, cos, sin


class Reference:
    """attngrad_backward_host (the CPU reference backend) through the C ABI."""

    def __init__(self, library_path: str):
        self.library = ctypes.CDLL(library_path)
        float_p = ctypes.POINTER(ctypes.c_float)
        self.library.attngrad_backward_host.restype = ctypes.c_int
        self.library.attngrad_backward_host.argtypes = (
            [ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_float,
             ctypes.c_int]
            + [float_p] * 17)
        self.library.attngrad_status_string.restype = ctypes.c_char_p
        self.library.attngrad_status_string.argtypes = [ctypes.c_int]

    def backward(self, hidden, grad, cos, sin, weights, scaling=SCALING, softcap=SOFTCAP, eps=EPS):
        """(grad_hidden_states, {weight name: gradient}) of one batch, fp32."""
        batch, seq_len, _ = hidden.shape
        inputs = [np.ascontiguousarray(a, dtype=np.float32) for a in
                  (grad, hidden, cos, sin, weights["q_proj"], weights["k_proj"], weights["v_proj"],
                   weights["o_proj"], weights["q_norm"], weights["k_norm"])]
        grad_hidden = np.empty_like(inputs[1])
        grads = {name: np.empty(shape, np.float32) for name, shape in WEIGHT_SHAPES.items()}
        outputs = [grad_hidden] + [grads[n] for n in WEIGHT_SHAPES]
        pointer = lambda a: a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))  # noqa: E731
        status = self.library.attngrad_backward_host(
            batch, seq_len, scaling, softcap, eps, 0, *[pointer(a) for a in inputs + outputs])
        if status != 0:
            raise RuntimeError("attngrad_backward_host: "
                               + self.library.attngrad_status_string(status).decode())
        return grad_hidden, grads


def forward_reference(hidden, cos, sin, weights, scaling=SCALING, softcap=SOFTCAP, eps=EPS):
    """The layer's output A·Woᵀ [B,S,3072] of SPEC section 2 in float64 (NumPy): the reference
    of a FORWARD batch."""
    hidden = np.asarray(hidden, np.float64)
    batch, seq_len, _ = hidden.shape
    cos = np.asarray(cos, np.float64).reshape(-1, 1, seq_len, HEAD_DIM)
    sin = np.asarray(sin, np.float64).reshape(-1, 1, seq_len, HEAD_DIM)
    w = {name: np.asarray(value, np.float64) for name, value in weights.items()}

    def heads(x, count):  # [B,count,S,D]
        return x.reshape(batch, seq_len, count, HEAD_DIM).transpose(0, 2, 1, 3)

    def norm_rope(x, weight):
        normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + weight)
        half = HEAD_DIM // 2
        rotated = np.concatenate([-normed[..., half:], normed[..., :half]], axis=-1)
        return normed * cos + rotated * sin

    q = norm_rope(heads(hidden @ w["q_proj"].T, NUM_HEADS), w["q_norm"])
    k = np.repeat(norm_rope(heads(hidden @ w["k_proj"].T, NUM_KV_HEADS), w["k_norm"]),
                  NUM_HEADS // NUM_KV_HEADS, axis=1)
    v = np.repeat(heads(hidden @ w["v_proj"].T, NUM_KV_HEADS), NUM_HEADS // NUM_KV_HEADS, axis=1)
    scores = softcap * np.tanh(q @ k.transpose(0, 1, 3, 2) * scaling / softcap)
    scores = np.where(np.triu(np.ones((seq_len, seq_len), bool), 1), -np.inf, scores)
    probabilities = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probabilities /= probabilities.sum(axis=-1, keepdims=True)
    attention = (probabilities @ v).transpose(0, 2, 1, 3).reshape(batch, seq_len, -1)
    return attention @ w["o_proj"].T


def within_spec(output, reference, atol: float = 0.0067, rtol: float = 1e-3,
                fraction: float = 0.99):
    """(passes, matched fraction) under SPEC section 4: >= FRACTION of elements with
    |out - ref| <= atol + rtol*|ref| and nothing non-finite."""
    output = np.asarray(output, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    if output.shape != reference.shape or not np.all(np.isfinite(output)):
        return False, 0.0
    matched = float(np.mean(np.abs(output - reference) <= atol + rtol * np.abs(reference)))
    return matched >= fraction, matched


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """attngrad-server on 127.0.0.1:<free port> with the CPU backend; its log goes to a temp file
    (printed when start fails)."""

    def __init__(self, binary: str, *extra_flags: str):
        self.binary = binary
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="attngrad-server-", suffix=".log",
                                               delete=False)
        flags = [f"--listen={self.target}", "--metrics_listen=", "--devices=cpu",
                 "--weights=random", "--weights_seed=7", "--cpu_threads=2"] + list(extra_flags)
        self.process = subprocess.Popen([binary] + flags, stdout=self.log, stderr=subprocess.STDOUT)

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def wait_ready(self, client, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"attngrad-server exited with {self.process.returncode}:\n"
                                   + self.log_text())
            try:
                return client.wait_until_serving(timeout=1.0)
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.1)
        raise RuntimeError("attngrad-server did not become SERVING:\n" + self.log_text())

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
        return self.process.returncode


class ServerTestCase(unittest.TestCase):
    """Tests against one attngrad-server process per class (ATTNGRAD_SERVER with the flags
    `server_flags`, CPU backend unless they say otherwise) and an attngrad.Client of it: cls.server,
    cls.client and cls.info (its GetModelInfo). `set_up_class` runs once the server is ready (the
    server is stopped when it fails); the tear-down closes the client and fails when the server does
    not exit 0 on SIGTERM."""

    server_flags: tuple = ()

    @classmethod
    def setUpClass(cls):
        import attngrad
        cls.server = ServerProcess(required_env("ATTNGRAD_SERVER"), *cls.server_flags)
        try:
            cls.client = attngrad.Client(cls.server.target, timeout=120)
            cls.info = cls.server.wait_ready(cls.client)
            cls.set_up_class()
        except BaseException:
            cls.server.stop()
            raise

    @classmethod
    def set_up_class(cls):
        """The class's own set-up that needs the server (override)."""

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        code = cls.server.stop()
        if code != 0:
            raise AssertionError(f"attngrad-server exited with {code} on SIGTERM")


def required_env(name: str) -> str:
    value = os.environ.get(name)
    if not value or not Path(value).exists():
        raise RuntimeError(f"set {name} to the built file (ctest does: "
                           f"tests/python/CMakeLists.txt); "
                           f"got {value!r}")
    return value
