"""attngrad.Client: the gradient service (proto attngrad.v1.AttentionGradient) for Python trainers.

    import attngrad
    with attngrad.Client("localhost:50051") as client:
        print(client.info())
        result = client.backward(hidden_states, grad_output, cos, sin)          # mode="return"
        result.grad_hidden_states, result.weight_gradients["q_proj"]
        client.backward(hidden_states, grad_output, cos, sin, mode="accumulate")
        grads = client.fetch_gradients(zero_after_fetch=True)                   # grads["o_proj"]

Inputs are NumPy arrays or PyTorch tensors (any device; answers come back as tensors on the device
of `hidden_states`). Batches larger than the server's max_batch_tokens / max_message_bytes are split
along B (sequences are independent, so this is exact) and sent pipelined over one stream; their
weight gradients are summed. Failures raise attngrad.AttngradError (with .code, a grpc.StatusCode,
and .message, the server's text), including a batch answered with an in-band BackwardResponse.error.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
import os
import queue
import random
import threading
import time
import warnings
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import grpc
import numpy as np

from . import _proto, cuda_regions, errors, host_regions, stream_ordered, tensors

tensor_pb2, pb, pb_grpc = _proto.load()

WEIGHT_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_WEIGHT_ENUM = {
    "q_proj": pb.WEIGHT_NAME_Q_PROJ, "k_proj": pb.WEIGHT_NAME_K_PROJ,
    "v_proj": pb.WEIGHT_NAME_V_PROJ, "o_proj": pb.WEIGHT_NAME_O_PROJ,
    "q_norm": pb.WEIGHT_NAME_Q_NORM, "k_norm": pb.WEIGHT_NAME_K_NORM,
}
_WEIGHT_BY_ENUM = {v: k for k, v in _WEIGHT_ENUM.items()}
_DTYPE_ENUM = {"float32": tensor_pb2.DTYPE_FLOAT32, "float16": tensor_pb2.DTYPE_FLOAT16,
               "bfloat16": tensor_pb2.DTYPE_BFLOAT16}
_DTYPE_BY_ENUM = {v: k for k, v in _DTYPE_ENUM.items()}
_DTYPE_BY_ENUM[tensor_pb2.DTYPE_UNSPECIFIED] = "float32"
_PRECISION_ENUM = {"auto": pb.PRECISION_AUTO, "fp32": pb.PRECISION_FP32, "tf32": pb.PRECISION_TF32,
                   "fp16": pb.PRECISION_FP16}
_PRECISION_BY_ENUM = {v: k for k, v in _PRECISION_ENUM.items()}
_MODE_ENUM = {"return": pb.GRADIENT_MODE_RETURN, "accumulate": pb.GRADIENT_MODE_ACCUMULATE}
# Field paths of a BackwardRequest's tensors and Tensor.raw_data, whose bytes _WireRequest appends
# to the serialised head itself.
_HIDDEN_STATES_PATH = (pb.BackwardRequest.HIDDEN_STATES_FIELD_NUMBER,)
_GRAD_OUTPUT_PATH = (pb.BackwardRequest.GRAD_OUTPUT_FIELD_NUMBER,)
_COS_PATH = (pb.BackwardRequest.ROTARY_TABLES_FIELD_NUMBER, pb.RotaryTables.COS_FIELD_NUMBER)
_SIN_PATH = (pb.BackwardRequest.ROTARY_TABLES_FIELD_NUMBER, pb.RotaryTables.SIN_FIELD_NUMBER)
_RAW_DATA_FIELD = tensor_pb2.Tensor.RAW_DATA_FIELD_NUMBER
TRANSPORTS = ("auto", "cuda_ipc", "shm", "bytes")
# RegisterRegion's answers that mean "not this server" (another host, another user, a server on
# the CPU, regions turned off), after which transport="auto" sends bytes.
_REGION_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED)

DEFAULT_TIMEOUT_SECONDS = 600.0
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
_REQUEST_OVERHEAD_BYTES = 64 * 1024  # protobuf framing, scalars and position ids of one request
_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
_MASK64 = (1 << 64) - 1


def canonical_weight_name(name: str) -> str:
    """'q_proj' for 'q_proj', 'q_proj.weight' or 'model.layers.3.self_attn.q_proj.weight'."""
    stem = name[:-len(".weight")] if name.endswith(".weight") else name
    stem = stem.rsplit(".", 1)[-1]
    if stem not in _WEIGHT_ENUM:
        raise ValueError(f"unknown weight {name!r}: expected one of {', '.join(WEIGHT_NAMES)} "
                         "(optionally with a Hugging Face prefix and a .weight suffix)")
    return stem


def _enum(table: Mapping[str, int], value, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    key = str(value).lower()
    if key not in table:
        raise ValueError(f"unknown {what} {value!r}: expected one of {', '.join(table)}")
    return table[key]


def _derive_batch_id(batch_id: int, part: int) -> int:
    """The id of part PART of a batch split along B: a splitmix64 mix of (batch_id, part), so a
    retry of the same batch_id maps its parts to the same ids (the server's dedup key)."""
    z = (batch_id + 0x9E3779B97F4A7C15 * (part + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) or 1


# ------------------------------------------------------------------------------------------------
# Results


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    backend: str
    memory_total_bytes: int
    memory_used_bytes: int
    # The server orders batches on this GPU by the caller's CUDA stream (stream_order).
    stream_ordered_batches: bool = False


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """GetModelInfoResponse as Python values."""
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    weights_version: int
    weights_source: str
    server_instance_id: str
    devices: Tuple[DeviceInfo, ...]
    supported_precisions: Tuple[str, ...]
    supported_wire_dtypes: Tuple[str, ...]
    max_message_bytes: int
    max_batch_tokens: int
    accumulation_window_id: int
    server_version: str
    default_scaling: float
    default_softcap: float
    default_eps: float
    # Every decoder layer the server holds (one for a single-layer server); the fields above
    # describe the first of them.
    layers: Tuple["LayerInfo", ...] = ()
    model_name: str = ""
    num_hidden_layers: int = 1
    # The server checks the end marker of Backward streams that declare it (BackwardRequest.end).
    backward_end_marker: bool = False

    @classmethod
    def from_proto(cls, message) -> "ModelInfo":
        return cls(
            hidden_size=message.config.hidden_size, num_heads=message.config.num_heads,
            num_kv_heads=message.config.num_kv_heads, head_dim=message.config.head_dim,
            weights_version=message.weights_version, weights_source=message.weights_source,
            server_instance_id=message.server_instance_id,
            devices=tuple(DeviceInfo(d.index, d.name, d.backend, d.memory_total_bytes,
                                     d.memory_used_bytes, d.stream_ordered_batches)
                          for d in message.devices),
            supported_precisions=tuple(_PRECISION_BY_ENUM.get(p, str(p))
                                       for p in message.supported_precisions),
            supported_wire_dtypes=tuple(_DTYPE_BY_ENUM.get(d, str(d))
                                        for d in message.supported_wire_dtypes),
            max_message_bytes=message.max_message_bytes, max_batch_tokens=message.max_batch_tokens,
            accumulation_window_id=message.accumulation_window_id,
            server_version=message.server_version, default_scaling=message.default_scaling,
            default_softcap=message.default_softcap, default_eps=message.default_eps,
            layers=tuple(LayerInfo.from_proto(layer) for layer in message.layers),
            model_name=message.model_name, num_hidden_layers=message.num_hidden_layers,
            backward_end_marker=message.backward_end_marker)


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """One decoder layer a server holds: its shape, attention type and request defaults."""
    index: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    type: str               # "full" or "sliding"
    sliding_window: int     # 0 = none
    rope_theta: float
    rope_scaling_factor: float
    scaling: float
    softcap: float          # <= 0: no soft-capping
    eps: float
    weights_version: int

    @classmethod
    def from_proto(cls, message) -> "LayerInfo":
        kind = {pb.ATTENTION_TYPE_FULL: "full", pb.ATTENTION_TYPE_SLIDING: "sliding"}.get(
            message.type, "unspecified")
        return cls(message.index, message.config.hidden_size, message.config.num_heads,
                   message.config.num_kv_heads, message.config.head_dim, kind,
                   message.sliding_window, message.rope_theta, message.rope_scaling_factor,
                   message.scaling, message.softcap, message.eps, message.weights_version)


@dataclasses.dataclass(frozen=True)
class AccumulationState:
    server_instance_id: str
    window_id: int
    weights_version: int
    batches: int
    tokens: int
    layer: int = 0  # windows are per (client, layer)

    @classmethod
    def from_proto(cls, message) -> "AccumulationState":
        return cls(message.server_instance_id, message.window_id, message.weights_version,
                   message.batches, message.tokens, message.layer)


@dataclasses.dataclass(frozen=True)
class StageTimings:
    """The server's timings of one request (seconds)."""
    queue: float
    copy_in: float
    compute: float
    copy_out: float
    total: float

    @classmethod
    def from_proto(cls, message) -> "StageTimings":
        return cls(message.queue_seconds, message.copy_in_seconds, message.compute_seconds,
                   message.copy_out_seconds, message.total_seconds)


@dataclasses.dataclass
class BackwardResult:
    """The answer to one (possibly split) batch.

    grad_hidden_states: [B,S,hidden] (NumPy, read-only when it is a zero-copy view of the response;
      a torch tensor on hidden_states' device when hidden_states was a torch tensor).
    weight_gradients: RETURN mode: {"q_proj": ..., ..., "k_norm": ...} summed over the parts; None
      in ACCUMULATE mode.
    duplicate: ACCUMULATE mode: every part had already been accumulated in this window (a retry).
    batch_ids / devices / timings: one entry per request the batch was split into.
    client_phases: Client(phase_timings=True): the seconds this client spent in each phase of the
      call: "prepare" (checks, host copies of the inputs), "register" (regions),
      "encode" (requests serialised), "send" (queued for gRPC's sender), "wait" (until the answers
      arrived), "decode" (the result assembled); None otherwise.
    transport: what carried the activations: "cuda_ipc" (the server computed straight from this
      process's GPU memory), "shm" (a shared-memory region) or "bytes" (the connection).
    ordering: a submit_backward() call queued on the trainer's CUDA stream: "gpu" (the server's
      GPU waited for the stream's inputs: stream_ordered.GpuOrderedCalls) or "host" (this
      process's sender thread did: stream_ordered.StreamOrderedCalls); "" otherwise.
    output: the answer of a forward() / submit_forward() call: the layer's output [B,S,hidden]
      (grad_hidden_states and weight_gradients are None then); None for a backward."""
    batch_id: int
    grad_hidden_states: Any
    weight_gradients: Optional[Dict[str, Any]]
    weights_version: int
    server_instance_id: str
    accumulation_window_id: int
    duplicate: bool
    batch_ids: Tuple[int, ...]
    devices: Tuple[str, ...]
    timings: Tuple[StageTimings, ...]
    client_phases: Optional[Dict[str, float]] = None
    transport: str = "bytes"
    ordering: str = ""
    output: Any = None


@dataclasses.dataclass
class Gradients:
    """The accumulated weight gradients of a window (fp32 NumPy arrays) and what they cover."""
    state: AccumulationState
    tensors: Dict[str, np.ndarray]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensors[canonical_weight_name(name)]

    def items(self):
        return self.tensors.items()


# ------------------------------------------------------------------------------------------------
# One logical batch, split into parts along B


class _Batch:
    """A caller's batch: its inputs as NumPy arrays, its parts and the assembly of their answers."""

    def __init__(self, *, batch_id: int, hidden_states, grad_output, cos, sin, position_ids,
                 rope_theta, mode: int, precision: int, scaling, softcap, eps,
                 expected_weights_version: int, accumulation_window_id: int, wire_dtype: str,
                 response_dtype: str, sequences_per_part: int, like, layer=None,
                 sliding_window=None, input_dtype: Optional[str] = None,
                 computation: int = pb.COMPUTATION_BACKWARD):
        self.batch_id = batch_id
        # FORWARD: the layer's output from hidden_states alone (grad_output is None).
        self.computation = computation
        self.forward = computation == pb.COMPUTATION_FORWARD
        self.hidden_states = hidden_states
        self.grad_output = grad_output
        self.cos, self.sin = cos, sin
        self.position_ids = position_ids
        self.rope_theta = rope_theta
        self.mode = mode
        self.precision = precision
        self.scaling, self.softcap, self.eps = scaling, softcap, eps
        self.layer, self.sliding_window = layer, sliding_window
        self.expected_weights_version = expected_weights_version
        self.accumulation_window_id = accumulation_window_id
        self.wire_dtype = wire_dtype
        self.input_dtype = input_dtype or wire_dtype
        self.response_dtype = response_dtype
        self.like = like
        batch, seq_len = hidden_states.shape[:2]
        self.shape = tuple(hidden_states.shape)
        bounds = [(b, min(batch, b + sequences_per_part))
                  for b in range(0, batch, sequences_per_part)]
        ids = [batch_id] if len(bounds) == 1 else [
            _derive_batch_id(batch_id, i) for i in range(len(bounds))]
        self.parts = list(zip(ids, bounds))
        self.tokens = batch * seq_len
        self._responses: Dict[int, Any] = {}
        # zero_copy: where each part's bytes are (_RegionLayout, or _CudaLayout for CUDA IPC).
        self.region: Optional[Any] = None

    def request(self, part_index: int) -> "_WireRequest":
        part_id, (b0, b1) = self.parts[part_index]
        wire = _WireRequest()
        message = wire.head = pb.BackwardRequest(
            batch_id=part_id, mode=self.mode, precision=self.precision,
            expected_weights_version=self.expected_weights_version,
            accumulation_window_id=self.accumulation_window_id,
            response_dtype=_DTYPE_ENUM[self.response_dtype], computation=self.computation)
        if self.region is not None:
            self._name_slices(wire, part_index)
        else:
            wire.add(message.hidden_states, _HIDDEN_STATES_PATH, self.hidden_states[b0:b1],
                     self.input_dtype)
            if not self.forward:
                wire.add(message.grad_output, _GRAD_OUTPUT_PATH, self.grad_output[b0:b1],
                         self.input_dtype)
        rotary = self.region.rotary_slices(part_index) if self.region is not None else None
        if rotary is not None:
            # CUDA IPC: the tables are in the caller's GPU memory too (float32).
            wire.describe(message.rotary_tables.cos, self.cos[b0:b1], "float32")
            wire.describe(message.rotary_tables.sin, self.sin[b0:b1], "float32")
            message.cos_region.CopyFrom(rotary[0])
            message.sin_region.CopyFrom(rotary[1])
        elif self.cos is not None:
            wire.add(message.rotary_tables.cos, _COS_PATH, self.cos[b0:b1], self.wire_dtype)
            wire.add(message.rotary_tables.sin, _SIN_PATH, self.sin[b0:b1], self.wire_dtype)
        else:
            ids = self.position_ids if self.position_ids.ndim == 1 else self.position_ids[b0:b1]
            message.positions.position_ids.extend(int(i) for i in ids.reshape(-1))
            message.positions.rope_theta = float(self.rope_theta or 0.0)
        if self.scaling is not None:
            message.scaling = float(self.scaling)
        if self.softcap is not None:
            message.softcap = float(self.softcap)
        if self.eps is not None:
            message.eps = float(self.eps)
        if self.layer is not None:
            message.layer = int(self.layer)
        if self.sliding_window is not None:
            message.sliding_window = int(self.sliding_window)
        return wire

    def _name_slices(self, wire: "_WireRequest", part_index: int) -> None:
        """Same-host zero-copy: the activations are in the region (written by _RegionLayout, or
        the caller's CUDA tensors), the answer goes there too; the request names them."""
        message = wire.head
        _, (b0, b1) = self.parts[part_index]
        hidden_slice, grad_slice, answer_slice = self.region.slices(part_index)
        wire.describe(message.hidden_states, self.hidden_states[b0:b1], self.input_dtype)
        message.hidden_states_region.CopyFrom(hidden_slice)
        if self.forward:
            message.output_region.CopyFrom(answer_slice)
            return
        wire.describe(message.grad_output, self.grad_output[b0:b1], self.input_dtype)
        message.grad_output_region.CopyFrom(grad_slice)
        message.grad_hidden_states_region.CopyFrom(answer_slice)
        weights_slice = self.region.weights_slice(part_index) if self.region.on_device else None
        if weights_slice is not None:
            message.weight_gradients_region.CopyFrom(weights_slice)

    def add(self, response) -> None:
        self._responses[response.batch_id] = response

    @property
    def complete(self) -> bool:
        return len(self._responses) == len(self.parts)

    def _answer(self, responses) -> Any:
        """The [B,S,hidden] answer: grad_hidden_states, or a FORWARD batch's output."""
        if self.region is not None and self.region.on_device:
            # CUDA IPC: the server wrote the answer into the client's tensor.
            return self.region.grad_hidden_states
        field = "output" if self.forward else "grad_hidden_states"
        answers = [_decode(getattr(r, field), field,
                           self.region.answer(index) if self.region is not None
                           else _raw_of(r, field))
                   for index, r in enumerate(responses)]
        for (part_id, (b0, b1)), answer in zip(self.parts, answers):
            expected = (b1 - b0,) + self.shape[1:]
            if answer.shape != expected:
                raise errors.AttngradError(
                    grpc.StatusCode.INTERNAL,
                    f"{field} has shape {list(answer.shape)}, expected {list(expected)}",
                    batch_id=part_id, method="Backward")
        return answers[0] if len(answers) == 1 else np.concatenate(answers, axis=0)

    def _weight_gradients(self, responses) -> Optional[Dict[str, Any]]:
        """RETURN: the six weight gradients summed over the parts; None otherwise."""
        if self.forward:
            return None
        if self.region is not None and self.region.on_device:
            return self.region.weight_gradients()  # CUDA IPC RETURN: summed on the GPU
        if self.mode == pb.GRADIENT_MODE_ACCUMULATE:
            return None
        weight_gradients = {}
        for name in WEIGHT_NAMES:
            parts = [_decode(getattr(r.weight_gradients, name), f"weight_gradients.{name}",
                             _raw_of(r, name)) for r in responses]
            total = parts[0]
            for extra in parts[1:]:
                total = total + extra  # float32 sums, in part order
            weight_gradients[name] = total
        return weight_gradients

    def result(self) -> BackwardResult:
        responses = [self._responses[part_id] for part_id, _ in self.parts]
        answer = self._answer(responses)
        weight_gradients = self._weight_gradients(responses)
        versions = {r.weights_version for r in responses}
        if len(versions) != 1:  # only possible when weights changed mid-batch without a pin
            raise errors.FailedPreconditionError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the parts of batch {self.batch_id} were computed against different weights "
                f"versions {sorted(versions)}; pass expected_weights_version to pin one",
                batch_id=self.batch_id, method="Backward")
        result = BackwardResult(
            batch_id=self.batch_id, grad_hidden_states=None if self.forward else answer,
            output=answer if self.forward else None,
            weight_gradients=weight_gradients, weights_version=versions.pop(),
            server_instance_id=responses[0].server_instance_id,
            accumulation_window_id=responses[0].accumulation_window_id,
            duplicate=all(r.duplicate for r in responses),
            batch_ids=tuple(r.batch_id for r in responses),
            devices=tuple(r.device for r in responses),
            timings=tuple(StageTimings.from_proto(r.timings) for r in responses))
        if self.like is not None:
            _to_torch_like(result, self.like)
        return result


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _length_delimited_header(field_number: int, length: int) -> bytes:
    return _varint((field_number << 3) | 2) + _varint(length)


class _WireRequest:
    """A BackwardRequest serialised with one copy of the tensors' bytes.

    `head` is the message with every field but the tensors' raw_data (their dtype and shape are in
    it); each raw_data is appended as a further occurrence of its enclosing message fields, which
    protobuf parsers merge into the same sub-message (the wire format's rule for a message field
    that appears more than once). serialize() joins the head and the arrays' buffers directly,
    instead of tobytes() + a copy into the message + a copy when serialising."""

    def __init__(self):
        self.head = None
        self._tensors = []  # (field path, contiguous array)

    def add(self, message, path: Tuple[int, ...], array: np.ndarray, dtype_name: str) -> None:
        contiguous = tensors.contiguous(array, dtype_name)
        message.dtype = _DTYPE_ENUM[dtype_name]
        message.shape.extend(int(d) for d in array.shape)
        self._tensors.append((path, contiguous))

    def describe(self, message, array: np.ndarray, dtype_name: str) -> None:
        """The tensor's dtype and shape only (its bytes are in a shared-memory region)."""
        message.dtype = _DTYPE_ENUM[dtype_name]
        message.shape.extend(int(d) for d in array.shape)

    def serialize(self) -> bytes:
        pieces = [self.head.SerializeToString()]
        for path, array in self._tensors:
            raw = memoryview(array).cast("B")
            headers = []
            length = len(raw)
            inner = _length_delimited_header(_RAW_DATA_FIELD, length)
            headers.append(inner)
            length += len(inner)
            for field_number in reversed(path):
                header = _length_delimited_header(field_number, length)
                headers.append(header)
                length += len(header)
            pieces.extend(reversed(headers))
            pieces.append(raw)
        return b"".join(pieces)

    def to_message(self):
        """The equivalent parsed message (for tests)."""
        return pb.BackwardRequest.FromString(self.serialize())


class _SharedRegion:
    """A sealed memfd this client created and registered with the server (zero_copy; see
    host_regions.py); reused by later batches that fit."""

    def __init__(self, client: "Client", size: int):
        self.memory = host_regions.SealedMemory(size)
        self.size = size
        try:
            self.region_id = client.register_region(self.memory, size)
        except BaseException:
            self.destroy(None)
            raise

    def destroy(self, client: Optional["Client"]) -> None:
        if client is not None:
            try:
                client.unregister_region(self.region_id)
            except errors.AttngradError:
                pass  # the server is gone or restarted: nothing of it is mapped there any more
        self.memory.close()


class _CudaIpcRefused(Exception):
    """RegisterRegion refused this process's GPU memory: the server cannot open it (another host,
    or a server on the CPU)."""


def _part_slice(located, bounds: Tuple[int, int]):
    """The RegionSlice of sequences [b0, b1) of a tensor LOCATED at ((region, offset, size),
    bytes per sequence) in a CUDA IPC region; None for None (a tensor the batch has not)."""
    if located is None:
        return None
    (region, offset, _), per_sequence = located
    b0, b1 = bounds
    return pb.RegionSlice(region_id=region, offset=offset + b0 * per_sequence,
                          byte_size=(b1 - b0) * per_sequence)


class _CudaLayout:
    """Where each part of a zero_copy batch of CUDA tensors lies (CUDA IPC regions,
    cuda_regions.py): the caller's hidden_states and grad_output, and the answer tensor the server
    writes grad_hidden_states into, each registered through its storage."""

    on_device = True

    def __init__(self, parts, cache, hidden, grad, answer, weights=None, shapes=None, rotary=None):
        # The parts' bounds, not the batch: the batch holds this layout (batch.region), and a
        # reference back would make a cycle that keeps every call's tensors alive until the
        # garbage collector runs (torch's allocator could not reuse their memory meanwhile).
        self._parts = parts
        self.grad_hidden_states = answer  # or a FORWARD batch's output
        # GRAD None: a FORWARD batch (its slice is None too).
        self._tensors = [None if tensor is None else
                         (cache.slice_of(tensor), tensor[0].numel() * tensor.element_size())
                         for tensor in (hidden, grad, answer)]
        # ROTARY: (cos, sin), contiguous float32 [B,S,head_dim] CUDA tensors, or None (bytes).
        self._rotary = None if rotary is None else [
            (cache.slice_of(tensor), tensor[0].numel() * tensor.element_size())
            for tensor in rotary]
        # RETURN: each part's six weight gradients, packed in WEIGHT_NAMES order (a row of
        # `weights` per part; SHAPES: the six shapes).
        self._weights, self._shapes = weights, shapes
        self._weight_totals = None
        self._weights_slice = cache.slice_of(weights) if weights is not None else None

    def slices(self, part_index: int):
        _, bounds = self._parts[part_index]
        return tuple(_part_slice(located, bounds) for located in self._tensors)

    def rotary_slices(self, part_index: int):
        """(cos slice, sin slice) of a part, or None when the tables go as bytes."""
        if self._rotary is None:
            return None
        _, bounds = self._parts[part_index]
        return tuple(_part_slice(located, bounds) for located in self._rotary)

    def weights_slice(self, part_index: int):
        if self._weights_slice is None:
            return None
        region, offset, _ = self._weights_slice
        row = self._weights[0].numel() * self._weights.element_size()
        return pb.RegionSlice(region_id=region, offset=offset + part_index * row, byte_size=row)

    def weight_gradients(self):
        """The six weight gradients summed over the parts (in part order, in the dtype the bytes
        path decodes to: bfloat16 widened to float32), or None. Made once (on the GPU, in the
        caller's stream order) and kept: later calls return the same tensors."""
        if self._weights is None:
            return None
        if self._weight_totals is None:
            self._weight_totals = self._sum_weight_gradients()
        return self._weight_totals

    def _sum_weight_gradients(self):
        import torch

        totals = {}
        for row in self._weights:
            if row.dtype == torch.bfloat16:
                row = row.float()
            start = 0
            for name, shape in zip(WEIGHT_NAMES, self._shapes):
                count = int(np.prod(shape))
                value = row[start:start + count].view(shape)
                totals[name] = value if name not in totals else totals[name] + value
                start += count
        return totals


class _RegionLayout:
    """Where each part of a zero_copy batch lies in its region: [hidden | grad_output | answer] per
    part, each aligned to 64 bytes. write_inputs() copies the caller's arrays in (the one copy the
    host path makes); answer() copies a part's grad_hidden_states out."""

    _ALIGN = 64
    on_device = False

    def __init__(self, batch: "_Batch"):
        # No reference to BATCH is kept (it holds this layout: see _CudaLayout).
        in_size = tensors.itemsize(batch.input_dtype)
        out_size = tensors.itemsize(batch.response_dtype)
        per_sequence = int(np.prod(batch.shape[1:]))
        self.parts = []  # (hidden offset, grad offset, answer offset, input bytes, answer bytes)
        offset = 0

        def take(size):
            nonlocal offset
            start = offset
            offset += -(-size // self._ALIGN) * self._ALIGN
            return start

        for _, (b0, b1) in batch.parts:
            in_bytes = (b1 - b0) * per_sequence * in_size
            out_bytes = (b1 - b0) * per_sequence * out_size
            self.parts.append((take(in_bytes), take(in_bytes), take(out_bytes), in_bytes,
                               out_bytes))
        self.size = max(offset, self._ALIGN)
        self.shared: Optional[_SharedRegion] = None

    def _slice(self, offset: int, size: int):
        return pb.RegionSlice(region_id=self.shared.region_id, offset=offset, byte_size=size)

    def rotary_slices(self, part_index: int):
        return None  # the tables go as bytes

    def write_inputs(self, shared: _SharedRegion, batch: "_Batch") -> None:
        self.shared = shared
        buffer = shared.memory.buf
        for (_, (b0, b1)), (hidden, grad, _, in_bytes, _) in zip(batch.parts, self.parts):
            for offset, array in ((hidden, batch.hidden_states), (grad, batch.grad_output)):
                raw = memoryview(tensors.contiguous(array[b0:b1], batch.input_dtype)).cast("B")
                buffer[offset:offset + in_bytes] = raw

    def slices(self, part_index: int):
        hidden, grad, answer, in_bytes, out_bytes = self.parts[part_index]
        return (self._slice(hidden, in_bytes), self._slice(grad, in_bytes),
                self._slice(answer, out_bytes))

    def answer(self, part_index: int) -> bytes:
        _, _, answer, _, out_bytes = self.parts[part_index]
        return bytes(self.shared.memory.buf[answer:answer + out_bytes])


class _WireChunk:
    """A LoadWeightsRequest whose `data` (field 5) is appended from a view of the weight's bytes
    (one copy when serialised); DATA None: the head alone (a weight named by its region)."""

    _DATA_FIELD = pb.LoadWeightsRequest.DATA_FIELD_NUMBER

    def __init__(self, head, data: Optional[memoryview]):
        self.head = head
        self.data = data

    def serialize(self) -> bytes:
        if self.data is None:
            return self.head.SerializeToString()
        return b"".join([self.head.SerializeToString(),
                         _length_delimited_header(self._DATA_FIELD, len(self.data)), self.data])


def _fill_tensor(message, array: np.ndarray, dtype_name: str) -> None:
    raw, shape = tensors.encode(array, dtype_name)
    message.dtype = _DTYPE_ENUM[dtype_name]
    message.shape.extend(shape)
    message.raw_data = raw


def _decode(message, field: str, raw=None) -> np.ndarray:
    dtype_name = _DTYPE_BY_ENUM.get(message.dtype)
    if dtype_name is None:
        raise errors.AttngradError(grpc.StatusCode.INTERNAL,
                                   f"{field}: the server sent unknown dtype {message.dtype}")
    return tensors.decode(message.raw_data if raw is None else raw, dtype_name, message.shape,
                          field=field)


# Field numbers of the response's tensors, whose raw_data _parse_backward_response keeps as views.
_RESPONSE_TENSOR_FIELDS = {
    pb.BackwardResponse.GRAD_HIDDEN_STATES_FIELD_NUMBER: "grad_hidden_states",
    pb.BackwardResponse.OUTPUT_FIELD_NUMBER: "output"}
_RESPONSE_WEIGHTS_FIELD = pb.BackwardResponse.WEIGHT_GRADIENTS_FIELD_NUMBER
_WEIGHT_BY_FIELD = {getattr(pb.WeightGradients, f"{name.upper()}_FIELD_NUMBER"): name
                    for name in WEIGHT_NAMES}
_TENSOR_RAW_FIELD = _RAW_DATA_FIELD


def _fields(view: memoryview):
    """(field number, wire type, start of the field, start of its value, end) of each field."""
    position, end = 0, len(view)
    while position < end:
        start = position
        key, position = _read_varint(view, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, position = _read_varint(view, position)
            value_start = position
        elif wire_type == 1:
            value_start, position = position, position + 8
        elif wire_type == 2:
            length, value_start = _read_varint(view, position)
            position = value_start + length
        elif wire_type == 5:
            value_start, position = position, position + 4
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        if position > end:
            raise ValueError("truncated message")
        yield number, wire_type, start, value_start, position


def _strip_raw(view: memoryview):
    """(a Tensor's bytes without raw_data, memoryview of raw_data or None)."""
    kept, raw = [], None
    for number, wire_type, start, value_start, end in _fields(view):
        if number == _TENSOR_RAW_FIELD and wire_type == 2:
            raw = view[value_start:end]  # the last occurrence wins, as in protobuf
        else:
            kept.append(view[start:end])
    return b"".join(kept), raw


class _ParsedResponse:
    """A BackwardResponse whose tensors' raw_data stay views of the received bytes (zero-copy):
    attributes are the message's; raw[name] is the raw_data of grad_hidden_states, output or a
    weight gradient (q_proj ... k_norm)."""

    __slots__ = ("message", "raw")

    def __init__(self, message, raw: Dict[str, memoryview]):
        self.message = message
        self.raw = raw

    def __getattr__(self, name):
        return getattr(self.message, name)


def _parse_backward_response(data: bytes) -> _ParsedResponse:
    view = memoryview(data)
    pieces, raw = [], {}
    for number, wire_type, start, value_start, end in _fields(view):
        if number in _RESPONSE_TENSOR_FIELDS and wire_type == 2:
            tensor, raw_data = _strip_raw(view[value_start:end])
            if raw_data is not None:
                raw[_RESPONSE_TENSOR_FIELDS[number]] = raw_data
            pieces += [_length_delimited_header(number, len(tensor)), tensor]
        elif number == _RESPONSE_WEIGHTS_FIELD and wire_type == 2:
            weights = []
            weights_view = view[value_start:end]
            for inner, inner_type, inner_start, inner_value, inner_end in _fields(weights_view):
                name = _WEIGHT_BY_FIELD.get(inner)
                if name is None or inner_type != 2:
                    weights.append(view[value_start:end][inner_start:inner_end])
                    continue
                tensor, raw_data = _strip_raw(view[value_start:end][inner_value:inner_end])
                if raw_data is not None:
                    raw[name] = raw_data
                weights += [_length_delimited_header(inner, len(tensor)), tensor]
            body = b"".join(weights)
            pieces += [_length_delimited_header(number, len(body)), body]
        else:
            pieces.append(view[start:end])
    return _ParsedResponse(pb.BackwardResponse.FromString(b"".join(pieces)), raw)


def _raw_of(response, name: str):
    raw = getattr(response, "raw", None)
    return raw.get(name) if isinstance(raw, dict) else None


def _torch_from_numpy(array: np.ndarray, device, dtype):
    import torch  # only reached when the caller passed torch tensors

    if device.type == "cpu" or not array.flags.writeable:
        if device.type == "cpu":
            array = np.array(array, copy=True)  # the response's bytes are immutable: own a copy
        with warnings.catch_warnings():
            # A read-only view, copied to the device next.
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array)
    else:
        tensor = torch.from_numpy(array)
    return tensor.to(device=device, dtype=dtype if dtype is not None else tensor.dtype)


def _to_torch_like(result: BackwardResult, like) -> None:
    name = "output" if result.output is not None else "grad_hidden_states"
    answer = getattr(result, name)
    if tensors.is_torch_tensor(answer):  # CUDA IPC: already the caller's kind
        setattr(result, name, answer.to(like.dtype))
        return
    setattr(result, name, _torch_from_numpy(answer, like.device, like.dtype))
    if result.weight_gradients is not None:
        result.weight_gradients = {name: _torch_from_numpy(value, like.device, None)
                                   for name, value in result.weight_gradients.items()}


def _answered_on_gpu(result: BackwardResult, on_result) -> None:
    result.transport = "cuda_ipc"
    if on_result is not None:
        on_result(result)


def _encode_health_request(service: str) -> bytes:
    data = service.encode()
    length, header = len(data), bytearray(b"\x0a")
    while True:  # varint length
        byte = length & 0x7F
        length >>= 7
        header.append(byte | (0x80 if length else 0))
        if not length:
            break
    return bytes(header) + data if data else b""


def _decode_health_response(data: bytes) -> int:
    """grpc.health.v1.HealthCheckResponse.status (field 1, varint); 0 when absent."""
    position, status = 0, 0
    while position < len(data):
        key, position = _read_varint(data, position)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, position = _read_varint(data, position)
            if field == 1:
                status = value
        elif wire_type == 2:
            length, position = _read_varint(data, position)
            position += length
        elif wire_type == 5:
            position += 4
        elif wire_type == 1:
            position += 8
        else:
            raise ValueError("malformed HealthCheckResponse")
    return status


def _read_varint(data: bytes, position: int) -> Tuple[int, int]:
    result, shift = 0, 0
    while True:
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7


_END = object()

# The request metadata that declares, at a Backward stream's start, that the stream ends with an
# end marker (BackwardRequest.end); sent only to servers that check it
# (GetModelInfoResponse.backward_end_marker).
_END_MARKER_METADATA = (("attngrad-end-marker", "1"),)


def _outbox_requests(outbox: "queue.Queue", end_marker: bool, serialize: bool):
    """A Backward stream's request iterator (gRPC's sending thread consumes it): the requests put
    into OUTBOX until _END. With END_MARKER, then the stream's end marker: a last request with only
    BackwardRequest.end, counting the requests before it, so that the server tells a stream cut
    inside its last message (which gRPC reports to it as a clean end) from a whole one. SERIALIZE:
    the marker as bytes, like the requests it follows; else a _WireRequest."""
    sent = 0
    while True:
        item = outbox.get()
        if item is _END:
            break
        sent += 1
        yield item
    if end_marker:
        marker = _WireRequest()
        marker.head = pb.BackwardRequest(end=pb.StreamEnd(requests=sent))
        yield marker.serialize() if serialize else marker


def ordered_fan_out(items: Iterable[Any], lane_of, run_lane, *, limit: int) -> Iterator[Any]:
    """Yields, in input order, one result per item of ITEMS, computed on lanes: item i goes to lane
    lane_of(i, item); each lane runs run_lane(lane, its items) (an iterator yielding one result per
    item, in order) in a thread of its own, fed as the items come. At most LIMIT items are
    outstanding. A lane's exception is raised in the caller's thread; leaving early ends the
    lanes' inputs."""
    inboxes: Dict[Any, "queue.Queue"] = {}
    results: Dict[int, Any] = {}
    failures: List[BaseException] = []
    changed = threading.Condition()
    end = object()

    def work(lane, inbox: "queue.Queue"):
        order: "collections.deque" = collections.deque()

        def feed():
            while True:
                item = inbox.get()
                if item is end:
                    return
                order.append(item[0])
                yield item[1]

        try:
            for result in run_lane(lane, feed()):
                with changed:
                    results[order.popleft()] = result
                    changed.notify_all()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            with changed:
                failures.append(error)
                changed.notify_all()

    def take(index: int, block: bool):
        """(True, result of item INDEX) once it is there; (False, None) when not blocking and it is
        not. Raises a lane's failure."""
        with changed:
            while block and index not in results and not failures:
                changed.wait()
            if failures:
                raise failures[0]
            if index in results:
                return True, results.pop(index)
            return False, None

    sent = yielded = 0
    try:
        for item in items:
            lane = lane_of(sent, item)
            if lane not in inboxes:
                inboxes[lane] = queue.Queue()
                threading.Thread(target=work, args=(lane, inboxes[lane]), daemon=True).start()
            inboxes[lane].put((sent, item))
            sent += 1
            while yielded < sent:
                ready, result = take(yielded, block=sent - yielded >= limit)
                if not ready:
                    break
                yielded += 1
                yield result
        for inbox in inboxes.values():
            inbox.put(end)
        while yielded < sent:
            _, result = take(yielded, block=True)
            yielded += 1
            yield result
    finally:
        for inbox in inboxes.values():
            inbox.put(end)
# ------------------------------------------------------------------------------------------------
# backward(): one Backward stream kept open across calls


class _Phases:
    """The client-side phases of one backward() (Client(phase_timings=True)): mark(NAME) adds the
    time since the previous mark to NAME's seconds."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + (now - self._last)
        self._last = now


class _NoPhases:
    """_Phases when phase timings are off: nothing is measured."""

    seconds = None

    def mark(self, name: str) -> None:
        pass


_NO_PHASES = _NoPhases()


class _StreamBroken(Exception):
    """The Backward stream ended or failed under a call (ERROR: the AttngradError to raise when it
    is not retried; RETRYABLE: a new stream may carry the call's unanswered parts again)."""

    def __init__(self, error: errors.AttngradError, retryable: bool):
        super().__init__(str(error))
        self.error = error
        self.retryable = retryable


class _BackwardStream:
    """One Backward call kept open: send() queues a serialised request for gRPC's sending thread,
    receive() reads the next response. Used by one backward() at a time (_StreamPool); returned to
    the pool only with no request outstanding, so the next user reads only its own answers."""

    def __init__(self, multi_callable, end_marker: bool = False):
        self._outbox: "queue.Queue" = queue.Queue()
        # Each item a serialised request (bytes): no caller's array.
        self._responses = multi_callable(
            _outbox_requests(self._outbox, end_marker, serialize=True), timeout=None,
            metadata=_END_MARKER_METADATA if end_marker else None)
        self.outstanding = 0
        self.broken = False
        self.expired = False  # the watchdog cancelled it: a call's deadline passed

    def usable(self) -> bool:
        return not (self.broken or self.expired or self.outstanding or self._responses.done())

    def send(self, payload: bytes) -> None:
        self.outstanding += 1
        self._outbox.put(payload)

    def receive(self):
        try:
            response = next(self._responses)
        except StopIteration:
            self.broken = True
            raise _StreamBroken(errors.AttngradError(
                grpc.StatusCode.INTERNAL, "the server closed the stream without answering "
                f"{self.outstanding} outstanding request(s)", method="Backward"),
                retryable=True) from None
        except grpc.RpcError as error:
            self.broken = True
            if self.expired:
                raise errors.DeadlineExceededError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "no answer within the call's timeout",
                    method="Backward") from None
            # The stream has no gRPC deadline: DEADLINE_EXCEEDED is the server ending it as idle
            # (--stream_idle_timeout_seconds) after a pause longer than that, which this client
            # may learn only now; the server computes no batch that arrives then, so the call's
            # parts go again on a new stream, like those of a dropped connection.
            retryable = (error.code() in _RETRYABLE
                         or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
            raise _StreamBroken(errors.from_rpc_error(error, "Backward"),
                                retryable=retryable) from None
        self.outstanding -= 1
        return response

    def expire(self) -> None:
        """The watchdog's: a call's deadline passed; the call's receive() raises
        DeadlineExceededError."""
        self.expired = True
        self._responses.cancel()

    def close(self, wait: float = 5.0) -> None:
        """Half-closes the stream (the server ends it with OK) and waits up to WAIT seconds for
        that; cancels it when it does not end (requests outstanding, or no answer)."""
        self._outbox.put(_END)
        if self.outstanding == 0 and not self.broken and not self.expired:
            ended = threading.Event()
            self._responses.add_done_callback(lambda *_: ended.set())
            if ended.wait(wait):
                return
        self._responses.cancel()


class _StreamPool:
    """The Backward streams of a client's backward() calls: a call takes an idle stream (or opens
    one on the next channel) and gives it back when it is done, so that a training loop's calls
    share one stream and concurrent calls each have their own. At most IDLE_LIMIT idle streams are
    kept open (each counts against the server's streams per client)."""

    def __init__(self, open_stream, idle_limit: int, end_marker=lambda: False):
        self._open = open_stream
        self._end_marker = end_marker  # () -> whether a new stream declares the end marker
        self._idle_limit = max(1, int(idle_limit))
        self._idle: List[_BackwardStream] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self) -> _BackwardStream:
        while True:
            with self._lock:
                if self._closed:
                    raise ValueError("the client is closed")
                stream = self._idle.pop() if self._idle else None
            if stream is None:
                return _BackwardStream(self._open(), self._end_marker())
            if stream.usable():
                return stream
            stream.close(wait=0)  # ended meanwhile (e.g. the server restarted): a new one

    def give_back(self, stream: _BackwardStream) -> None:
        if stream.usable():
            with self._lock:
                if not self._closed and len(self._idle) < self._idle_limit:
                    self._idle.append(stream)
                    return
        stream.close(wait=0 if not stream.usable() else 5.0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            streams, self._idle = self._idle, []
        for stream in streams:
            stream.close()


class _Watchdog:
    """One thread per client (started by the first call with a deadline): expires the stream of a
    backward() whose deadline has passed (_BackwardStream.expire), instead of a thread per call."""

    def __init__(self):
        self._changed = threading.Condition()
        self._heap: List[list] = []  # [deadline (monotonic), sequence, stream or None when done]
        self._sequence = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def watch(self, deadline: float, stream: _BackwardStream) -> list:
        entry = [deadline, next(self._sequence), stream]
        with self._changed:
            if len(self._heap) > 1024:  # done entries are dropped lazily: drop them now
                self._heap = [e for e in self._heap if e[2] is not None]
                heapq.heapify(self._heap)
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="attngrad-watchdog",
                                                daemon=True)
                self._thread.start()
            if self._heap[0] is entry:
                self._changed.notify()
        return entry

    def done(self, entry: list) -> None:
        with self._changed:
            entry[2] = None

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()

    def _run(self) -> None:
        with self._changed:
            while not self._closed:
                while self._heap and self._heap[0][2] is None:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._changed.wait()
                    continue
                delay = self._heap[0][0] - time.monotonic()
                if delay > 0:
                    self._changed.wait(delay)
                    continue
                heapq.heappop(self._heap)[2].expire()


def _raise_in_band_error(batch: _Batch, response) -> None:
    """Raises the AttngradError of a part answered with BackwardResponse.error."""
    if not response.HasField("error") or response.error.code == 0:
        return
    message = response.error.message
    if len(batch.parts) > 1:
        message += (f" (part of batch {batch.batch_id}, split into {len(batch.parts)} requests "
                    f"along B; a retry with the same batch_id is not double-counted)")
    raise errors.make_error(errors.status_code_from_number(response.error.code), message,
                            batch_id=response.batch_id, method="Backward")


_FLAG_WORD_BYTES = 4  # StreamOrder's ready and done words are 32-bit


class _GpuOrderedBatch:
    """A prepared CUDA IPC batch as stream_ordered.GpuOrderedCalls sends it: each part's request
    with its stream_order, the parts' answers checked as they come, the result once all are in."""

    def __init__(self, batch: _Batch, phases):
        self._batch = batch
        self._phases = phases
        self.part_ids = [part_id for part_id, _ in batch.parts]

    def encode(self, part_index: int, order: stream_ordered.StreamOrder) -> bytes:
        wire = self._batch.request(part_index)
        wire.head.stream_order.CopyFrom(pb.StreamOrder(
            ready=pb.RegionSlice(region_id=order.region_id, offset=order.ready_offset,
                                 byte_size=_FLAG_WORD_BYTES),
            done=pb.RegionSlice(region_id=order.region_id, offset=order.done_offset,
                                byte_size=_FLAG_WORD_BYTES),
            value=order.value))
        payload = wire.serialize()
        self._phases.mark("encode")
        return payload

    def add(self, response) -> None:
        """Takes a part's answer; raises its in-band error."""
        self._phases.mark("wait")
        _raise_in_band_error(self._batch, response)
        self._batch.add(response)

    def result(self) -> BackwardResult:
        result = self._batch.result()
        self._phases.mark("decode")
        result.client_phases = self._phases.seconds
        stream_ordered.clear_answer(result)  # in the PendingBackward
        result.ordering = "gpu"
        return result


_SERVICE = pb.DESCRIPTOR.services_by_name["AttentionGradient"].full_name


def _rotary_inputs(cos, sin, position_ids, batch: int, seq_len: int, wire: str,
                   keep_on_device: bool):
    """(cos, sin, position ids, request bytes per sequence) of a batch: the checked tables
    ([B,S,head_dim], broadcast over B; CUDA tensors stay where they are with KEEP_ON_DEVICE) and
    None, or None, None and the checked position ids."""
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither (and position_ids)")
    if cos is None:
        if position_ids is None:
            raise ValueError("pass cos and sin, or position_ids (with rope_theta)")
        ids = np.asarray(tensors.to_numpy(position_ids), dtype=np.int64)
        if ids.shape not in ((seq_len,), (batch, seq_len)):
            raise ValueError(f"position_ids must be [S] or [B,S] = [{batch},{seq_len}], got "
                             f"{list(ids.shape)}")
        return None, None, ids, 10 * seq_len
    if position_ids is not None:
        raise ValueError("pass either cos/sin or position_ids, not both")
    if keep_on_device and cuda_regions.is_cuda_tensor(cos):
        cos_array, sin_array = cos, sin  # registered where they are (_CudaLayout)
    else:
        cos_array, sin_array = tensors.to_numpy(cos), tensors.to_numpy(sin)
    if cos_array.ndim == 2:
        cos_array, sin_array = cos_array[None], sin_array[None]
    for name, table in (("cos", cos_array), ("sin", sin_array)):
        if table.ndim != 3 or table.shape[1] != seq_len or table.shape[0] not in (1, batch):
            raise ValueError(f"{name} must be [B,S,head_dim] = [{batch},{seq_len},head_dim] (or "
                             f"[S,head_dim]), got {list(table.shape)}")
    if cos_array.shape[0] != batch and isinstance(cos_array, np.ndarray):
        cos_array = np.broadcast_to(cos_array, (batch,) + cos_array.shape[1:])
        sin_array = np.broadcast_to(sin_array, (batch,) + sin_array.shape[1:])
    elif cos_array.shape[0] != batch:
        cos_array = cos_array.expand(batch, -1, -1)
        sin_array = sin_array.expand(batch, -1, -1)
    return cos_array, sin_array, None, 2 * seq_len * cos_array.shape[2] * tensors.itemsize(wire)


def _weight_gradient_bytes(hidden_size: int, info: "ModelInfo", dtype_name: str) -> int:
    """Bytes of the six weight gradients of a RETURN answer."""
    q_out = info.num_heads * info.head_dim
    kv_out = info.num_kv_heads * info.head_dim
    elements = 2 * q_out * hidden_size + 2 * kv_out * hidden_size + 2 * info.head_dim
    return elements * tensors.itemsize(dtype_name)


def _weight_shapes(info: "ModelInfo") -> List[Tuple[int, ...]]:
    """The six weights' shapes in WEIGHT_NAMES order."""
    q_out = info.num_heads * info.head_dim
    kv_out = info.num_kv_heads * info.head_dim
    hidden = info.hidden_size
    return [(q_out, hidden), (kv_out, hidden), (kv_out, hidden), (hidden, q_out),
            (info.head_dim,), (info.head_dim,)]


def sequences_per_part(limits: "ModelInfo", batch: int, seq_len: int, request_per_sequence: int,
                       response_per_sequence: int = 0, response_fixed: int = 0) -> int:
    """How many sequences one request may carry under the server's max_batch_tokens and
    max_message_bytes (which bounds requests and answers alike). At least 1: a single sequence
    over the limits is sent as is, and the server's refusal says why."""
    most = batch
    if limits.max_batch_tokens > 0:
        most = min(most, limits.max_batch_tokens // seq_len)
    if limits.max_message_bytes > 0:
        room = limits.max_message_bytes - _REQUEST_OVERHEAD_BYTES
        most = min(most, room // max(1, request_per_sequence))
        if response_per_sequence:
            most = min(most, (room - response_fixed) // response_per_sequence)
    return max(1, most)


# ------------------------------------------------------------------------------------------------
# TLS, tokens and client ids


def tls_credentials(ca: Optional[str] = None, cert: Optional[str] = None,
                    key: Optional[str] = None) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files: the server is verified against the CA bundle CA
    (None: the system's roots); with CERT and KEY the client presents that certificate (mutual
    TLS, servers started with --tls_client_ca)."""
    if (cert is None) != (key is None):
        raise ValueError("tls_credentials: cert and key go together")

    def read(path):
        if path is None:
            return None
        with open(path, "rb") as file:
            return file.read()

    return grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key),
                                        certificate_chain=read(cert))


def read_token_file(path: str) -> str:
    """The bearer token in PATH: its first line, without surrounding whitespace."""
    with open(path, "r", encoding="ascii") as file:
        token = file.readline().strip()
    if not token:
        raise ValueError(f"token file {path}: empty")
    return token


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class _MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                           grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the same metadata (token, client id) to every call of a channel."""

    def __init__(self, metadata: Sequence[Tuple[str, str]]):
        self._metadata = tuple(metadata)

    def _details(self, details):
        metadata = tuple(details.metadata or ()) + self._metadata
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


# ------------------------------------------------------------------------------------------------
# The client


def _torch_float32():
    import torch  # only reached with torch tensors

    return torch.float32


def _forced_transport_refused(transport: str, what: str, reason: str) -> errors.AttngradError:
    """The error of a call that forced TRANSPORT when the server cannot WHAT (REASON)."""
    return errors.FailedPreconditionError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"transport='{transport}': the server cannot {what} ({reason})", method="RegisterRegion")


def _names_an_unknown_region(error: errors.AttngradError) -> bool:
    """Whether the server refused a request because a region it names is not the client's: the
    client's registrations are gone (the server restarted)."""
    return "is not a region of this client" in error.message


def _weight_chunk_head(name: str, expected_weights_version: int, layer: Optional[int],
                       offset: int):
    """A LoadWeightsRequest for weight NAME at element OFFSET, without dtype, shape or bytes."""
    message = pb.LoadWeightsRequest(name=_WEIGHT_ENUM[name], offset=offset,
                                    expected_weights_version=expected_weights_version)
    if layer is not None:
        message.layer = int(layer)
    return message


class Client:
    """A connection to an attngrad server.

    Args:
      target: "host:port".
      credentials: grpc.ChannelCredentials for TLS (tls_credentials(ca=..., cert=..., key=...) for a
        CA and, with mutual TLS, a client certificate); None for a plaintext channel.
      token: the bearer token (servers started with --tokens_file; read_token_file(path) reads
        one), sent with every call as "authorization: Bearer <token>".
      client_id: servers without authentication scope accumulation windows, batch ids and stream
        limits to this id (metadata attngrad-client-id; None: the server's "default").
      for_client: admins only: fetch_gradients and zero_gradients address this client's window.
      tls_server_name: the name the server's certificate carries, when the target's host differs.
      timeout: the deadline of every call in seconds (per call; overridable per method; None, 0 or
        inf: no deadline).
      max_in_flight: requests one backward stream keeps outstanding (pipelining split batches).
      channels: connections to the server (gRPC channels with distinct arguments, so that gRPC
        does not share one TCP connection between them). Each backward stream (one backward() or
        backward_many() call) takes the next channel in turn; the other calls use the first. A
        channel is opened on first use, so unused ones cost nothing. Default 8: up to 8 threads
        streaming at once each get a connection of their own (on one H200 host a bare gRPC stream
        moved 4x more over 8 connections than over one); 1 = one connection.
      options: extra grpc channel options.
      phase_timings: each BackwardResult of backward() gets client_phases (seconds per
        client-side phase of the call).

    backward() keeps its Backward stream open between calls (one per concurrent caller, at most
    `channels` of them idle): a training loop's calls share one stream on one connection, with no
    stream set-up per call. A stream that broke (the server restarted, the connection dropped) is
    replaced, and the call's unanswered requests are sent again once with the same batch ids
    (ACCUMULATE counts each batch id once per window). A call's deadline is kept by one watchdog
    thread per client, which cancels the stream of a call that ran past it.
    """

    def __init__(self, target: str, *, credentials: Optional[grpc.ChannelCredentials] = None,
                 timeout: Optional[float] = DEFAULT_TIMEOUT_SECONDS, max_in_flight: int = 4,
                 options: Sequence[Tuple[str, Any]] = (), token: Optional[str] = None,
                 client_id: Optional[str] = None, for_client: Optional[str] = None,
                 tls_server_name: Optional[str] = None, channels: int = 8,
                 phase_timings: bool = False, region_socket: Optional[str] = None):
        if int(channels) < 1:
            raise ValueError(f"channels must be >= 1, got {channels}")
        channel_options = [("grpc.max_send_message_length", -1),
                           ("grpc.max_receive_message_length", -1)] + list(options)
        if tls_server_name:
            channel_options.append(("grpc.ssl_target_name_override", tls_server_name))
        metadata = []
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        if client_id:
            metadata.append(("attngrad-client-id", client_id))
        if for_client:
            metadata.append(("attngrad-for-client", for_client))
        self._credentials = credentials
        # Shared memory (register_region): the server's region socket and who registers there.
        self.region_socket = (region_socket or os.environ.get("ATTNGRAD_REGION_SOCKET")
                              or host_regions.default_socket_path(target))
        self._region_token, self._region_client_id = token, client_id
        self._channel_options = channel_options
        self._metadata = metadata
        self._raw_channels: List[Optional[grpc.Channel]] = [None] * int(channels)
        self._backward_calls: Dict[Tuple[int, bool], Any] = {}
        self._next_channel = itertools.count()
        self.target = target
        self._channel = self._open_channel(0)
        self.timeout = timeout
        self.max_in_flight = max(1, int(max_in_flight))
        self._stub = pb_grpc.AttentionGradientStub(self._channel)
        self._load_weights = self._channel.stream_unary(
            f"/{_SERVICE}/LoadWeights", request_serializer=_WireChunk.serialize,
            response_deserializer=pb.LoadWeightsResponse.FromString)
        self._health = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=_encode_health_request,
            response_deserializer=_decode_health_response)
        self._limits: Optional[ModelInfo] = None
        self._regions_lock = threading.Lock()
        self._free_regions: List[_SharedRegion] = []  # zero_copy regions not in use
        self._cuda_regions: Optional[cuda_regions.CudaRegionCache] = None  # zero_copy, CUDA
        # CUDA IPC: register every segment torch's allocator holds at the first GPU backward
        # (True), or each allocation when a call first names it (False).
        self.register_existing_segments = True
        # submit_backward()'s queue and sender thread, and whether the driver allows them.
        self._stream_ordered: Optional[stream_ordered.StreamOrderedCalls] = None
        self._stream_ordered_supported: Optional[bool] = None
        # submit_backward()'s calls ordered on the GPU by the server, started at first use.
        self._gpu_ordered: Optional[stream_ordered.GpuOrderedCalls] = None
        # Why the server cannot open CUDA IPC regions (it is elsewhere or on the CPU), once seen.
        self._cuda_ipc_refused: Optional[str] = None
        # Why the server cannot map this host's shared memory (it is elsewhere), once seen.
        self._shm_refused: Optional[str] = None
        self._batch_ids = itertools.count(random.SystemRandom().getrandbits(62) + 1)
        self.phase_timings = bool(phase_timings)
        # backward()'s streams, kept open across calls, and the watchdog of their deadlines.
        self._streams = _StreamPool(lambda: self._next_backward(serialized=True),
                                    idle_limit=int(channels), end_marker=self._end_marker_declared)
        self._watchdog = _Watchdog()

    @property
    def channels(self) -> int:
        """How many connections the client spreads its backward streams over."""
        return len(self._raw_channels)

    def _open_channel(self, index: int):
        """Channel INDEX (opened now if it was not), with the token/id interceptor. Its arguments
        differ from the others' by grpc.attngrad_channel_index, so it has a connection of its
        own."""
        raw = self._raw_channels[index]
        if raw is None:
            options = self._channel_options + [("grpc.attngrad_channel_index", index),
                                               ("grpc.use_local_subchannel_pool", 1)]
            if self._credentials is not None:
                raw = grpc.secure_channel(self.target, self._credentials, options=options)
            else:
                raw = grpc.insecure_channel(self.target, options=options)
            self._raw_channels[index] = raw
        return (grpc.intercept_channel(raw, _MetadataInterceptor(self._metadata))
                if self._metadata else raw)

    def _end_marker_declared(self) -> bool:
        """Whether this client's Backward streams declare and send the end marker: to servers that
        check it (an older server would answer the marker as a bad batch)."""
        return (self._limits or self.info()).backward_end_marker

    def _next_backward(self, serialized: bool = False):
        """The Backward call of the next channel in turn: requests are _WireRequests (one-copy
        serialisation by gRPC's sender) or, SERIALIZED, their bytes."""
        index = next(self._next_channel) % len(self._raw_channels)
        call = self._backward_calls.get((index, serialized))
        if call is None:
            channel = self._channel if index == 0 else self._open_channel(index)
            call = channel.stream_stream(
                f"/{_SERVICE}/Backward",
                request_serializer=None if serialized else _WireRequest.serialize,
                response_deserializer=_parse_backward_response)
            self._backward_calls[(index, serialized)] = call
        return call

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        if self._gpu_ordered is not None:
            self._gpu_ordered.close()  # waits for the calls in flight first
        if self._stream_ordered is not None:
            self._stream_ordered.close()  # answers what is queued first
        self._streams.close()  # half-closed: the server ends them with OK
        self._watchdog.close()
        with self._regions_lock:
            regions, self._free_regions = self._free_regions, []
            cuda_cache, self._cuda_regions = self._cuda_regions, None
        for shared in regions:
            shared.destroy(self)
        if cuda_cache is not None:
            try:
                cuda_cache.close()
            except errors.AttngradError:
                pass  # the server is gone or restarted: nothing of it is open there any more
        for raw in self._raw_channels:
            if raw is not None:
                raw.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _timeout(self, timeout):
        """The deadline of one call: TIMEOUT, else the client's; 0 or inf = none (a long stream)."""
        value = self.timeout if timeout is None else timeout
        if value is None or value <= 0 or math.isinf(value):
            return None
        return value

    def _unary(self, method: str, call, request, timeout, *, retries: int = 0):
        attempt = 0
        while True:
            try:
                return call(request, timeout=self._timeout(timeout))
            except grpc.RpcError as error:
                if attempt < retries and error.code() in _RETRYABLE:
                    attempt += 1
                    time.sleep(0.1 * 2 ** attempt)
                    continue
                raise errors.from_rpc_error(error, method) from None

    # -- info and health -------------------------------------------------------------------------

    def info(self, *, timeout: Optional[float] = None) -> ModelInfo:
        """The layer configuration, weights version, devices, limits and defaults of the server."""
        info = ModelInfo.from_proto(self._unary("GetModelInfo", self._stub.GetModelInfo,
                                                pb.GetModelInfoRequest(), timeout, retries=2))
        self._limits = info
        return info

    def health(self, service: str = "", *, timeout: Optional[float] = None) -> str:
        """grpc.health.v1 status of SERVICE ("" = the server): "SERVING", "NOT_SERVING", ..."""
        status = self._unary("Health.Check", self._health, service, timeout, retries=2)
        return _HEALTH_STATUS.get(status, str(status))

    def wait_until_serving(self, timeout: float = 30.0) -> ModelInfo:
        """Polls health until SERVING (e.g. right after starting a server); returns info()."""
        deadline = time.monotonic() + timeout
        last: Optional[BaseException] = None
        while time.monotonic() < deadline:
            try:
                left = deadline - time.monotonic()
                if self.health(timeout=min(2.0, max(0.1, left))) == "SERVING":
                    return self.info()
            except errors.AttngradError as error:
                last = error
            time.sleep(0.05)
        raise errors.DeadlineExceededError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"{self.target} was not SERVING within {timeout} s (last: {last})",
            method="Health.Check")

    # -- backward --------------------------------------------------------------------------------

    def backward(self, hidden_states, grad_output, cos=None, sin=None, **kwargs) -> BackwardResult:
        """The backward pass of one batch (split along B when it is larger than the server takes).

        Args:
          hidden_states, grad_output: [B,S,hidden] arrays or tensors.
          cos, sin: [B,S,head_dim] (or [S,head_dim] / [1,S,head_dim], broadcast over B); or leave
            them None and pass position_ids ([S] or [B,S]) and rope_theta for the server to build
            them.
          mode: "return" (weight gradients in the result) or "accumulate" (added on the server).
          precision: "auto", "fp32", "tf32" or "fp16".
          scaling, softcap, eps: None = the layer's defaults (the SPEC layer: 1/sqrt(head_dim), 50,
            1e-6; a model: its config.json); softcap <= 0 = no soft-capping.
          layer: the decoder layer (None = the server's first); sliding_window: overrides the
            layer's window (0 = full causal).
          expected_weights_version: 0 = any; else refused with FailedPreconditionError if different.
          accumulation_window_id: ACCUMULATE: 0 = the current window; else that window or refused.
          batch_id: the dedup key of ACCUMULATE (a retry with the same id is not added twice); a new
            one is drawn when None. Split parts get ids derived from it.
          input_dtype: the wire dtype of hidden_states and grad_output: "float32", "float16" or
            "bfloat16" (half the bytes; the server computes from the rounded values, a different
            input: compare with the reference of the rounded input). None: wire_dtype.
          wire_dtype: the wire dtype of every input tensor (cos/sin too) unless input_dtype says
            otherwise; response_dtype: the answer's. "float32" (default), "float16" or "bfloat16".
          timeout: the deadline of the call in seconds (kept by the client's watchdog thread; the
            stream of a call past it is cancelled and DeadlineExceededError raised).
          transport: how the activations travel to a server on this host. "auto" (default): CUDA
            tensors over CUDA IPC when the server can open this process's GPU memory, other inputs
            through a shared-memory region when it can map one, else as bytes on the connection;
            it probes once per client, remembers the answer and warns once when it falls back.
            "cuda_ipc": CUDA tensors' own memory is registered (register_cuda_region, one region
            per GPU allocation, remembered across calls: cuda_regions.py; unregistered by close())
            and the server computes straight from it and writes grad_hidden_states (and, RETURN,
            the weight gradients) into new CUDA tensors of this process, with no copy at all
            (inputs in float32, float16 or bfloat16: their dtype unless input_dtype says
            otherwise, then converted on the GPU); the client synchronises the tensors' current
            stream before sending; do not change the inputs until backward() has returned.
            "shm": the inputs are written into a POSIX shared-memory region this client registers
            (kept for later calls, removed by close()) and the server writes grad_hidden_states
            back into it; the results equal the bytes path's bit for bit. "bytes": everything on
            the connection (a server on another host). A forced transport the server refuses
            raises; BackwardResult.transport says which one carried the batch.
          zero_copy: the former switch: True = "auto", False = "bytes".
        """
        return self._compute(hidden_states, grad_output, cos, sin, kwargs)

    def forward(self, hidden_states, cos=None, sin=None, **kwargs) -> BackwardResult:
        """The layer's forward output A·Woᵀ ([B,S,hidden], SPEC.md section 2 steps 1-4 and the
        o_proj product) computed by the server with its resident weights: BackwardResult.output
        (a tensor on hidden_states' device for a tensor; else NumPy). Nothing is accumulated.
        Same arguments as backward() without grad_output, mode, accumulation_window_id and
        batch_id; transport "shm" is not offered (CPU inputs go as bytes)."""
        if kwargs.get("transport") == "shm":
            raise ValueError("forward() takes transport 'auto', 'cuda_ipc' or 'bytes', not 'shm'")
        return self._compute(hidden_states, None, cos, sin, kwargs, pb.COMPUTATION_FORWARD)

    def _compute(self, hidden_states, grad_output, cos, sin, kwargs,
                 computation: int = pb.COMPUTATION_BACKWARD) -> BackwardResult:
        """backward() or forward(): one batch over the transport KWARGS ask for."""
        kwargs = dict(kwargs, computation=computation)
        timeout = kwargs.pop("timeout", None)
        transport = self._requested_transport(kwargs.pop("transport", "auto"),
                                              kwargs.pop("zero_copy", None))
        phases = _Phases() if self.phase_timings else _NO_PHASES
        on_gpu = cuda_regions.is_cuda_tensor(hidden_states)
        if transport == "cuda_ipc" and not on_gpu:
            raise ValueError("transport='cuda_ipc' needs CUDA tensors; hidden_states is not one")
        if on_gpu and transport in ("auto", "cuda_ipc"):
            result = self._try_cuda_ipc(transport, lambda: self._backward_on_gpu(
                hidden_states, grad_output, cos, sin, timeout, dict(kwargs), phases))
            if result is not None:
                result.transport = "cuda_ipc"
                return result
            transport = "bytes"
        batch = self._prepare(hidden_states, grad_output, cos, sin, **kwargs)
        phases.mark("prepare")
        if transport in ("auto", "shm") and not batch.forward:
            result = self._backward_in_shared_memory(batch, transport, timeout, phases)
            if result is not None:
                return result
        return self._exchange(batch, timeout, phases)

    def submit_backward(self, hidden_states, grad_output, cos=None, sin=None, *,
                        on_result=None, **kwargs) -> stream_ordered.PendingBackward:
        """backward() queued on the current CUDA stream of hidden_states' device, without
        waiting (stream_ordered.py): for CUDA tensors over CUDA IPC, the call returns at once a
        PendingBackward whose grad_hidden_states (and, RETURN, weight_gradients) are tensors that
        kernels launched afterwards on that stream see answered; the stream itself waits for the
        server. Its result() (or wait_submitted()) gives the BackwardResult or raises the call's
        error; ON_RESULT(result) runs there. Any other case (CPU tensors, another transport, a
        driver without stream memory operations) runs backward() now and returns it answered.
        Where the server orders batches on the tensors' GPU (orders_on_gpu()), the request
        leaves at once and the server's GPU waits for the inputs (PendingBackward.ordering
        "gpu"); otherwise a sender thread sends it once the stream has written them ("host").
        Same arguments as backward(), except that expected_weights_version may be a callable
        VERSION(ordered) -> int, called right before the request goes. Host-ordered: in the
        sender thread once the stream reached the call (ORDERED True: what the stream launched
        before is done). GPU-ordered: in this thread, once the tasks submit_after_stream() queued
        before (weight uploads) have run (ORDERED True: they all succeeded, so what the stream
        launched before each of them is done; the stream's later work may still be running).
        Answered-now calls: in this thread (False). Do not change the inputs until the call is
        answered."""
        return self._submit(hidden_states, grad_output, cos, sin, on_result, kwargs)

    def submit_forward(self, hidden_states, cos=None, sin=None, *,
                       on_result=None, **kwargs) -> stream_ordered.PendingBackward:
        """forward() queued on the current CUDA stream of hidden_states' device, as
        submit_backward() queues a backward: the PendingBackward's `output` is a tensor that
        kernels launched afterwards on that stream see written by the server. Same arguments as
        forward() (expected_weights_version may be a callable, as for submit_backward)."""
        if kwargs.get("transport") == "shm":
            raise ValueError("submit_forward() takes transport 'auto', 'cuda_ipc' or 'bytes'")
        return self._submit(hidden_states, None, cos, sin, on_result, kwargs,
                            pb.COMPUTATION_FORWARD)

    def _submit(self, hidden_states, grad_output, cos, sin, on_result, kwargs,
                computation: int = pb.COMPUTATION_BACKWARD) -> stream_ordered.PendingBackward:
        """submit_backward() or submit_forward()."""
        kwargs = dict(kwargs)
        timeout = kwargs.pop("timeout", None)
        transport = self._requested_transport(kwargs.get("transport", "auto"),
                                              kwargs.get("zero_copy"))
        version = kwargs.pop("expected_weights_version", 0)
        calls = self._stream_ordered_calls() \
            if cuda_regions.is_cuda_tensor(hidden_states) and transport in ("auto", "cuda_ipc") \
            and self._cuda_ipc_refused is None else None
        prepared = None
        if calls is not None:
            phases = _Phases() if self.phase_timings else _NO_PHASES
            arguments = {k: v for k, v in kwargs.items() if k not in ("transport", "zero_copy")}
            prepared = self._try_cuda_ipc(transport, lambda: self._prepare_on_gpu(
                hidden_states, grad_output, cos, sin, dict(arguments, computation=computation),
                phases))
            if prepared is None:  # refused: auto goes as bytes from now on
                kwargs["transport"] = "bytes"
        if prepared is None:
            kwargs["expected_weights_version"] = version(False) if callable(version) else version
            result = self._compute(hidden_states, grad_output, cos, sin,
                                   dict(kwargs, timeout=timeout), computation)
            return stream_ordered.PendingBackward.completed(result, on_result)
        batch, kept = prepared
        if callable(version):
            def before_send(ordered):
                batch.expected_weights_version = int(version(ordered))
        else:
            batch.expected_weights_version, before_send = int(version), None
        return self._queue_prepared(calls, batch, kept, hidden_states, timeout, phases,
                                    on_result, before_send)

    def _queue_prepared(self, calls, batch, kept, hidden_states, timeout, phases, on_result,
                        before_send) -> stream_ordered.PendingBackward:
        """Queues a prepared CUDA IPC batch on the current stream of hidden_states' device:
        GPU-ordered where the server orders batches on that device, else by CALLS' sender."""
        import torch

        def on_queued(pending):
            # After the stream's wait: the kernels these launch see the answer. The answer is
            # assembled in another thread, which must launch nothing on the GPU (no `like`).
            answer = batch.region.grad_hidden_states.to(hidden_states.dtype)
            if batch.forward:
                pending.output, pending.grad_hidden_states = answer, None
            else:
                pending.grad_hidden_states = answer
                pending.weight_gradients = batch.region.weight_gradients()
            batch.like = None

        def answered(result):
            _answered_on_gpu(result, on_result)

        device = hidden_states.device
        stream = stream_ordered.stream_handle_of(hidden_states)
        with torch.cuda.device(device):
            gpu_calls = self._gpu_ordered_calls(device.index)
            if gpu_calls is not None:
                return gpu_calls.submit(_GpuOrderedBatch(batch, phases), device.index, stream,
                                        kept, self._timeout(timeout), on_result=answered,
                                        before_send=before_send, on_queued=on_queued)
            return calls.submit(batch, stream, batch.region.grad_hidden_states, None, kept,
                                self._timeout(timeout), phases, on_result=answered,
                                before_send=before_send, on_queued=on_queued)

    def submit_after_stream(self, tensor, task, *, timeout: Optional[float] = None,
                            layer: Optional[int] = None):
        """Runs TASK() in the thread of submit_backward()'s calls, in order with them, once the
        current stream of TENSOR's CUDA device has done what was launched on it so far (the
        stream does not wait for the task; a GPU-ordered call waits, before it is sent, for the
        tasks queued before it). Returns a stream_ordered.PendingCall, or None when
        calls cannot be ordered by the stream (the caller then runs the task itself). LAYER: the
        layer the task is for (a ShardedClient picks its server by it)."""
        if not cuda_regions.is_cuda_tensor(tensor) or self._cuda_ipc_refused is not None:
            return None
        calls = self._stream_ordered_calls()
        if calls is None:
            return None
        import torch

        with torch.cuda.device(tensor.device):
            return calls.submit_task(stream_ordered.stream_handle_of(tensor), task,
                                     self._timeout(timeout))

    def wait_submitted(self) -> None:
        """Waits for every submit_backward() call and submit_after_stream() task of this client
        so far, host- and GPU-ordered; raises the first one's error. A queued call refused for a
        region the server does not know (it restarted) makes the next calls register anew."""
        first_error = None
        for calls in (self._stream_ordered, self._gpu_ordered):
            if calls is None:
                continue
            try:
                calls.wait_all()
            except BaseException as error:  # noqa: B902 - raised below, after the others
                first_error = first_error or error
        if isinstance(first_error, errors.InvalidArgumentError) and \
                _names_an_unknown_region(first_error):
            with self._regions_lock:
                self._cuda_regions = None  # its registrations died with the old server
        if first_error is not None:
            raise first_error

    def orders_on_gpu(self, device: Optional[int] = None, *, layer: Optional[int] = None) -> bool:
        """Whether submit_backward() has the server's GPU order its calls on CUDA device DEVICE
        (None: on any GPU of the server) by the trainer's stream (stream_ordered.GpuOrderedCalls):
        where the CUDA driver has stream memory operations, the server reports
        DeviceInfo.stream_ordered_batches for that GPU, it can open this process's GPU memory
        (as far as known) and $ATTNGRAD_GPU_ORDERED is "1". Otherwise calls on the stream are
        ordered by this process's sender thread. Off unless asked for: it has not yet been run on
        a GPU. LAYER: for a ShardedClient, the layer whose server is asked."""
        if os.environ.get("ATTNGRAD_GPU_ORDERED") != "1" or self._cuda_ipc_refused is not None:
            return False
        if self._stream_ordered_calls() is None:
            return False
        info = self._limits or self.info()
        # The server numbers its GPUs as RegisterRegion's cuda_ipc.device does (cuda_regions:
        # the device ordinal of this process's driver, which is torch's device index).
        return any(known.stream_ordered_batches and (device is None or known.index == device)
                   for known in info.devices)

    def _gpu_ordered_calls(self, device: int) -> Optional[stream_ordered.GpuOrderedCalls]:
        """The GPU-ordered calls of submit_backward() for CUDA device DEVICE, started at first
        use; None where calls on it are host-ordered (orders_on_gpu)."""
        if not self.orders_on_gpu(device):
            return None
        with self._regions_lock:
            if self._gpu_ordered is None:
                self._gpu_ordered = stream_ordered.GpuOrderedCalls(
                    lambda: _BackwardStream(self._next_backward(serialized=True),
                                            self._end_marker_declared()),
                    self._stream_ordered.driver,
                    lambda memory: self._cuda_region_cache().slice_of(memory),
                    watchdog=self._watchdog, tasks=self._stream_ordered)
            return self._gpu_ordered

    def _stream_ordered_calls(self) -> Optional[stream_ordered.StreamOrderedCalls]:
        """The queue of submit_backward(), started at its first use; None when the CUDA driver
        has no stream memory operations."""
        with self._regions_lock:
            if self._stream_ordered is None and self._stream_ordered_supported is None:
                driver = cuda_regions.default_driver()
                self._stream_ordered_supported = stream_ordered.is_supported(driver)
                if self._stream_ordered_supported:
                    self._stream_ordered = stream_ordered.StreamOrderedCalls(
                        self._exchange, driver)
            return self._stream_ordered

    def _requested_transport(self, transport: str, zero_copy: Optional[bool]) -> str:
        if zero_copy is not None:
            transport = "auto" if zero_copy else "bytes"
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        return transport

    def _fall_back(self, what: str, reason: str) -> None:
        """Warns once per client and transport that `auto` no longer tries WHAT."""
        warnings.warn(f"transport='auto': the server cannot use {what} ({reason}); batches go as "
                      "bytes on the connection from now on", RuntimeWarning, stacklevel=4)

    def _try_cuda_ipc(self, transport: str, run):
        """RUN's result over CUDA IPC, or None when the server refused it and TRANSPORT is auto
        (remembered: later calls do not ask again). A server that no longer knows the client's
        registrations (it restarted) gets them anew, once."""
        if self._cuda_ipc_refused is None:
            try:
                try:
                    return run()
                except errors.InvalidArgumentError as error:
                    if not _names_an_unknown_region(error):
                        raise
                    with self._regions_lock:
                        self._cuda_regions = None  # its registrations died with the old server
                    return run()
            except _CudaIpcRefused as refused:
                self._cuda_ipc_refused = str(refused)
                if transport == "auto":
                    self._fall_back("this process's GPU memory (transport cuda_ipc)",
                                    str(refused))
        if transport == "cuda_ipc":
            raise _forced_transport_refused(transport, "open this process's GPU memory",
                                            self._cuda_ipc_refused)
        return None

    def _take_region_for(self, size: int, transport: str) -> Optional[_SharedRegion]:
        """A shared-memory region of at least SIZE bytes registered with the server, or None when
        the server cannot map this host's shared memory and TRANSPORT is auto (remembered: later
        calls do not ask again; a forced "shm" raises)."""
        if self._shm_refused is None:
            try:
                return self._take_region(size)
            except (errors.AttngradError, OSError) as error:
                if isinstance(error, errors.AttngradError) and (
                        error.method != "RegisterRegion" or error.code not in _REGION_REFUSALS):
                    raise
                self._shm_refused = str(error)
                if transport == "auto":
                    self._fall_back("shared memory of this host", self._shm_refused)
        if transport == "shm":
            raise _forced_transport_refused(transport, "map this host's shared memory",
                                            self._shm_refused)
        return None

    def _in_shared_memory(self, size: int, transport: str, use):
        """USE(region)'s result, with a registered shared-memory region of at least SIZE bytes;
        None when the server cannot map one and TRANSPORT is auto (see _take_region_for). A
        server that no longer knows the client's regions (it restarted) gets a new one, once."""
        for attempt in range(2):
            shared = self._take_region_for(size, transport)
            if shared is None:
                return None
            try:
                return use(shared)
            except errors.InvalidArgumentError as error:
                if attempt or not _names_an_unknown_region(error):
                    raise
                shared.destroy(None)  # the server does not know it: nothing to unregister
                shared = None
                self._forget_regions()
            finally:
                if shared is not None:
                    self._give_back_region(shared)
        return None  # not reached: the second attempt returns or raises

    def _backward_in_shared_memory(self, batch: _Batch, transport: str, timeout, phases):
        """BATCH through a shared-memory region, or None (see _in_shared_memory)."""
        layout = _RegionLayout(batch)

        def exchange(shared):
            layout.write_inputs(shared, batch)
            batch.region = layout
            phases.mark("register")
            result = self._exchange(batch, timeout, phases)
            result.transport = "shm"
            return result

        return self._in_shared_memory(layout.size, transport, exchange)

    def _forget_regions(self) -> None:
        """Drops the shared-memory regions kept for later calls without unregistering them (a
        restarted server no longer has them)."""
        with self._regions_lock:
            regions, self._free_regions = self._free_regions, []
        for shared in regions:
            shared.destroy(None)

    def _exchange(self, batch: _Batch, timeout, phases) -> BackwardResult:
        """Sends BATCH's parts over a stream of the pool (max_in_flight outstanding) and returns its
        result. A stream that breaks is replaced once, and the parts it had not answered are sent
        again with the same batch ids."""
        seconds = self._timeout(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        answered: Dict[int, Any] = {}
        for attempt in range(2):
            stream = self._streams.take()
            entry = self._watchdog.watch(deadline, stream) if deadline is not None else None
            try:
                self._send_parts(stream, batch, answered, phases)
            except _StreamBroken as broken:
                if attempt or not broken.retryable:
                    raise broken.error from None
                continue
            finally:
                if entry is not None:
                    self._watchdog.done(entry)
                self._streams.give_back(stream)  # or closes it: broken, expired, answers due
            break
        for part_id, _ in batch.parts:
            batch.add(answered[part_id])
        result = batch.result()
        phases.mark("decode")
        result.client_phases = phases.seconds
        return result

    def _send_parts(self, stream: _BackwardStream, batch: _Batch, answered: Dict[int, Any],
                    phases) -> None:
        """The parts of BATCH not in ANSWERED, over STREAM: their responses go into ANSWERED."""
        unsent = collections.deque(index for index, (part_id, _) in enumerate(batch.parts)
                                   if part_id not in answered)
        due = {batch.parts[index][0] for index in unsent}
        while due:
            while unsent and stream.outstanding < self.max_in_flight:
                payload = batch.request(unsent.popleft()).serialize()
                phases.mark("encode")
                stream.send(payload)
                phases.mark("send")
            response = stream.receive()
            phases.mark("wait")
            if response.batch_id not in due:
                stream.broken = True  # out of step: no later call may read from it
                raise errors.AttngradError(
                    grpc.StatusCode.INTERNAL,
                    f"the server answered unknown batch id {response.batch_id}", method="Backward")
            _raise_in_band_error(batch, response)
            due.discard(response.batch_id)
            answered[response.batch_id] = response

    def _backward_on_gpu(self, hidden_states, grad_output, cos, sin, timeout, kwargs, phases):
        """backward(zero_copy=True) of CUDA tensors: CUDA IPC regions (cuda_regions.py)."""
        import torch

        batch, _ = self._prepare_on_gpu(hidden_states, grad_output, cos, sin, kwargs, phases)
        # The server reads the inputs as soon as the request arrives: their writes must be done.
        torch.cuda.current_stream(hidden_states.device).synchronize()
        phases.mark("synchronize")
        return self._exchange(batch, timeout, phases)

    def _prepare_on_gpu(self, hidden_states, grad_output, cos, sin, kwargs, phases):
        """The batch of a CUDA IPC backward, its tensors registered (regions), and the tensors
        the server reads or writes, to keep alive until it has answered."""
        import torch

        forward = kwargs.get("computation") == pb.COMPUTATION_FORWARD
        if not forward and (not cuda_regions.is_cuda_tensor(grad_output)
                            or grad_output.device != hidden_states.device):
            raise ValueError("zero_copy with CUDA tensors: grad_output must be on hidden_states' "
                             f"device {hidden_states.device}, got {grad_output.device}")
        input_dtype = kwargs.pop("input_dtype", None)
        if input_dtype is None:
            input_dtype = cuda_regions.torch_wire_dtype(hidden_states) or "float32"
        inputs = tensors.wire_dtype_name(input_dtype)
        answer_dtype = tensors.wire_dtype_name(kwargs.pop("response_dtype", "float32"))
        # Converted (and made contiguous) on the GPU when they are not already.
        hidden = hidden_states.to(cuda_regions.torch_dtype(inputs)).contiguous()
        grad = None if forward else \
            grad_output.to(cuda_regions.torch_dtype(inputs)).contiguous()
        answer = torch.empty(tuple(hidden.shape), dtype=cuda_regions.torch_dtype(answer_dtype),
                             device=hidden.device)
        batch = self._prepare(hidden, grad, cos, sin, input_dtype=inputs,
                              response_dtype=answer_dtype, keep_on_device=True, **kwargs)
        batch.like = hidden_states
        phases.mark("prepare")
        weights = shapes = None
        if batch.mode != pb.GRADIENT_MODE_ACCUMULATE and not forward:
            # The weight gradients go into this process's GPU memory too: one row per part.
            shapes = _weight_shapes(self._limits or self.info())
            weights = torch.empty((len(batch.parts), sum(int(np.prod(s)) for s in shapes)),
                                  dtype=cuda_regions.torch_dtype(answer_dtype),
                                  device=hidden.device)
        rotary = None
        if cuda_regions.is_cuda_tensor(batch.cos) and batch.cos.device == hidden.device:
            rotary = (batch.cos.float().contiguous(), batch.sin.float().contiguous())
            batch.cos, batch.sin = rotary  # kept alive by the batch until the call returns
        elif cuda_regions.is_cuda_tensor(batch.cos):  # on another GPU: as bytes
            batch.cos, batch.sin = tensors.to_numpy(batch.cos), tensors.to_numpy(batch.sin)
        try:
            cache = self._cuda_region_cache()
            if self.register_existing_segments:
                cache.register_segments_once(
                    hidden.device.index,
                    lambda: cuda_regions.torch_segment_addresses(hidden.device.index))
            batch.region = _CudaLayout(batch.parts, cache, hidden, grad, answer, weights, shapes,
                                       rotary)
        except (errors.FailedPreconditionError, errors.InvalidArgumentError) as error:
            if error.method != "RegisterRegion":
                raise
            raise _CudaIpcRefused(str(error)) from None
        phases.mark("register")
        return batch, (hidden, grad, answer, weights, rotary)

    def _cuda_region_cache(self) -> cuda_regions.CudaRegionCache:
        with self._regions_lock:
            if self._cuda_regions is None:
                self._cuda_regions = cuda_regions.CudaRegionCache(
                    lambda handle, device, offset, size: self.register_cuda_region(
                        handle, device, size, offset=offset),
                    self.unregister_region)
            return self._cuda_regions

    def cuda_region_counts(self) -> Dict[str, int]:
        """{"live", "registered", "unregistered"}: the CUDA IPC regions this client holds now and
        the RegisterRegion / UnregisterRegion calls its cache has made (a steady training loop
        registers a handful once; a count that grows with the steps means re-registrations)."""
        with self._regions_lock:
            cache = self._cuda_regions
        if cache is None:
            return {"live": 0, "registered": 0, "unregistered": 0}
        return {"live": len(cache), "registered": cache.registered,
                "unregistered": cache.unregistered}

    def register_cuda_region(self, handle: bytes, device: int, size: int, *, offset: int = 0,
                             owner_pid: Optional[int] = None,
                             timeout: Optional[float] = None) -> int:
        """Opens GPU memory of this process in the server (same host, a server computing on that
        GPU): HANDLE, the 64 bytes of a cudaIpcMemHandle_t of an allocation on CUDA device DEVICE
        (as the server numbers its GPUs), and the region's SIZE bytes from OFFSET in it; returns the
        region id (unregister_region closes it; so does the server once OWNER_PID, this process
        unless given, 0 for none, has exited)."""
        request = pb.RegisterRegionRequest(
            byte_size=int(size), owner_pid=os.getpid() if owner_pid is None else int(owner_pid))
        request.cuda_ipc.handle = bytes(handle)
        request.cuda_ipc.device = int(device)
        request.cuda_ipc.offset = int(offset)
        response = self._unary("RegisterRegion", self._stub.RegisterRegion, request, timeout)
        return response.region_id

    # -- shared-memory regions (same host) -------------------------------------------------------

    def register_region(self, memory, size: Optional[int] = None, *,
                        timeout: Optional[float] = None) -> int:
        """Shares MEMORY (its first SIZE bytes, default all of it) with the server for batches to
        name tensors in; returns the region id. MEMORY is an attngrad.SealedMemory, or the
        descriptor of a memfd sealed against shrinking (F_SEAL_SHRINK). Its descriptor goes over
        the server's region socket (self.region_socket: the region_socket argument,
        $ATTNGRAD_REGION_SOCKET, or the default path of the target's port), so only a server on
        this host can; the region belongs to this client's id and is removed once this process
        has exited. Shared-memory objects are not registered by name (FAILED_PRECONDITION): a name
        does not show that the caller holds the object, and such an object can shrink under the
        server."""
        if isinstance(memory, (str, bytes)):
            raise errors.make_error(
                grpc.StatusCode.FAILED_PRECONDITION,
                "name: shared memory is registered by descriptor, not by name; pass an "
                "attngrad.SealedMemory (or a memfd sealed with F_SEAL_SHRINK)",
                method="RegisterRegion")
        fd = memory.fileno() if hasattr(memory, "fileno") else int(memory)
        if size is None:
            size = getattr(memory, "size", None) or os.fstat(fd).st_size
        if not self.region_socket:
            raise errors.make_error(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"region_socket: the target {self.target} names no port to find the server's "
                "region socket by; pass Client(..., region_socket=PATH)", method="RegisterRegion")
        return host_regions.register(self.region_socket, fd, int(size), token=self._region_token,
                                     client_id=self._region_client_id,
                                     timeout=self._timeout(timeout))

    def unregister_region(self, region_id: int, *, timeout: Optional[float] = None) -> None:
        """Unmaps a region of this client from the server."""
        self._unary("UnregisterRegion", self._stub.UnregisterRegion,
                    pb.UnregisterRegionRequest(region_id=int(region_id)), timeout)

    def _take_region(self, size: int) -> _SharedRegion:
        """A free region of at least SIZE bytes: a cached one, or a new one."""
        with self._regions_lock:
            for index, shared in enumerate(self._free_regions):
                if shared.size >= size:
                    return self._free_regions.pop(index)
        return _SharedRegion(self, size)

    def _give_back_region(self, shared: _SharedRegion) -> None:
        with self._regions_lock:
            self._free_regions.append(shared)
            while len(self._free_regions) > 2:  # keep the newest two
                self._free_regions.pop(0).destroy(self)

    def backward_many(self, batches: Iterable[Mapping[str, Any]], *,
                      timeout: Optional[float] = None,
                      streams: int = 1) -> Iterator[BackwardResult]:
        """Streams many batches over one Backward stream, pipelined (max_in_flight requests
        outstanding). Each item is a dict of backward()'s arguments; results come in input order.
        TIMEOUT bounds the whole stream (float("inf") for none). STREAMS > 1 deals the batches in
        turn to that many streams, each fed and read by a thread of its own and each on the next
        channel (so on a connection of its own while streams <= channels): bulk work limited by
        one connection's throughput."""
        if int(streams) < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        prepared = (self._prepare(**dict(kwargs)) for kwargs in batches)
        if int(streams) == 1:
            return self._run(prepared, timeout=timeout)
        count = int(streams)
        return ordered_fan_out(prepared, lambda index, _: index % count,
                               lambda _, lane_batches: self._run(lane_batches, timeout=timeout),
                               limit=count * self.max_in_flight)

    def _prepare(self, hidden_states, grad_output, cos=None, sin=None, *, position_ids=None,
                 rope_theta: Optional[float] = None, mode="return", precision="auto",
                 scaling: Optional[float] = None, softcap: Optional[float] = None,
                 eps: Optional[float] = None, expected_weights_version: int = 0,
                 accumulation_window_id: int = 0, batch_id: Optional[int] = None,
                 wire_dtype="float32", response_dtype="float32", layer: Optional[int] = None,
                 sliding_window: Optional[int] = None, input_dtype=None,
                 keep_on_device: bool = False,
                 computation: int = pb.COMPUTATION_BACKWARD) -> _Batch:
        """The checked _Batch of a call. COMPUTATION FORWARD: GRAD_OUTPUT is None."""
        like = hidden_states if tensors.is_torch_tensor(hidden_states) else None
        forward = computation == pb.COMPUTATION_FORWARD
        if keep_on_device:  # CUDA IPC: the tensors stay where they are (_CudaLayout)
            hidden, grad = hidden_states, grad_output
        else:
            hidden = tensors.to_numpy(hidden_states)
            grad = None if forward else tensors.to_numpy(grad_output)
        if hidden.ndim != 3:
            raise ValueError(f"hidden_states must be [B,S,hidden_size], got shape "
                             f"{list(hidden.shape)}")
        if not forward and grad.shape != hidden.shape:
            raise ValueError(f"grad_output must have hidden_states' shape {list(hidden.shape)}, "
                             f"got {list(grad.shape)}")
        batch, seq_len = hidden.shape[:2]
        if batch < 1 or seq_len < 1:
            raise ValueError(f"hidden_states must have B >= 1 and S >= 1, got {list(hidden.shape)}")
        wire = tensors.wire_dtype_name(wire_dtype)
        inputs_wire = wire if input_dtype is None else tensors.wire_dtype_name(input_dtype)
        answer = tensors.wire_dtype_name(response_dtype)
        inputs_per_sequence = 1 if forward else 2
        per_sequence_bytes = inputs_per_sequence * seq_len * hidden.shape[2] * \
            tensors.itemsize(inputs_wire)
        response_per_sequence = seq_len * hidden.shape[2] * tensors.itemsize(answer)
        cos_array, sin_array, ids, rotary_bytes = _rotary_inputs(
            cos, sin, position_ids, batch, seq_len, wire, keep_on_device)
        mode_value = _enum(_MODE_ENUM, mode, "mode")
        if forward and mode_value != pb.GRADIENT_MODE_RETURN:
            raise ValueError("forward(): nothing is accumulated; leave mode unset")
        # RETURN answers carry the six weight gradients too: a fixed ~100 MB at the real config.
        response_fixed = 0 if mode_value == pb.GRADIENT_MODE_ACCUMULATE or forward else \
            _weight_gradient_bytes(hidden.shape[2], self._limits or self.info(), answer)
        return _Batch(
            batch_id=int(batch_id) if batch_id is not None else next(self._batch_ids),
            hidden_states=hidden, grad_output=grad, cos=cos_array, sin=sin_array, position_ids=ids,
            rope_theta=rope_theta, mode=mode_value,
            precision=_enum(_PRECISION_ENUM, precision, "precision"), scaling=scaling,
            softcap=softcap, eps=eps, expected_weights_version=int(expected_weights_version),
            accumulation_window_id=int(accumulation_window_id), wire_dtype=wire,
            input_dtype=inputs_wire,
            response_dtype=answer,
            sequences_per_part=sequences_per_part(
                self._limits or self.info(), batch, seq_len, per_sequence_bytes + rotary_bytes,
                response_per_sequence, response_fixed),
            like=like, layer=layer, sliding_window=sliding_window, computation=computation)

    def _run(self, batches: Iterable[_Batch], *,
             timeout: Optional[float]) -> Iterator[BackwardResult]:
        """Sends the parts of BATCHES over one stream with at most max_in_flight outstanding and
        yields each batch's result once all its parts are answered, in input order."""
        outbox: "queue.Queue" = queue.Queue()

        end_marker = self._end_marker_declared()
        call = self._next_backward()(_outbox_requests(outbox, end_marker, serialize=False),
                                     timeout=self._timeout(timeout),
                                     metadata=_END_MARKER_METADATA if end_marker else None)
        finished = False
        try:
            source = iter(batches)
            waiting: "collections.deque" = collections.deque()  # (batch, part index) not sent yet
            order: "collections.deque" = collections.deque()    # batches not yet yielded
            owner: Dict[int, _Batch] = {}                        # part id -> its batch
            in_flight = 0
            exhausted = False
            while True:
                while in_flight < self.max_in_flight and not (exhausted and not waiting):
                    if not waiting:
                        try:
                            batch = next(source)
                        except StopIteration:
                            exhausted = True
                            outbox.put(_END)  # half-close: the server answers what it has
                            break
                        order.append(batch)
                        for index, (part_id, _) in enumerate(batch.parts):
                            if part_id in owner:
                                raise ValueError(f"batch id {part_id} is used twice in one stream")
                            owner[part_id] = batch
                            waiting.append((batch, index))
                        continue
                    batch, index = waiting.popleft()
                    outbox.put(batch.request(index))
                    in_flight += 1
                while order and order[0].complete:
                    yield order.popleft().result()
                if exhausted and not waiting and not order:
                    break
                try:
                    response = next(call)
                except StopIteration:
                    missing = sorted(owner)
                    raise errors.AttngradError(
                        grpc.StatusCode.INTERNAL,
                        f"the server closed the stream without answering batches {missing[:8]}",
                        method="Backward") from None
                except grpc.RpcError as error:
                    raise errors.from_rpc_error(error, "Backward") from None
                in_flight -= 1
                batch = owner.pop(response.batch_id, None)
                if batch is None:
                    raise errors.AttngradError(
                        grpc.StatusCode.INTERNAL,
                        f"the server answered unknown batch id {response.batch_id}",
                        method="Backward")
                _raise_in_band_error(batch, response)
                batch.add(response)
            finished = True
        finally:
            outbox.put(_END)
            if not finished:
                call.cancel()

    # -- accumulated gradients -------------------------------------------------------------------

    def fetch_gradients(self, *, zero_after_fetch: bool = False, dtype: str = "float32",
                        chunk_bytes: int = 0, expected_window_id: int = 0,
                        layer: Optional[int] = None, timeout: Optional[float] = None) -> Gradients:
        """The accumulated weight gradients of the current window (fp32 arrays), and the state they
        cover. zero_after_fetch=True zeroes them atomically and starts a new window. Windows are
        per layer: layer=None is the server's first layer."""
        return self._fetch(zero_after_fetch, dtype, chunk_bytes, expected_window_id,
                           [] if layer is None else [int(layer)], timeout)[0]

    def fetch_layers(self, layers: Sequence[int], *, zero_after_fetch: bool = False,
                     dtype: str = "float32", chunk_bytes: int = 0,
                     timeout: Optional[float] = None, into=None,
                     destinations=None) -> Dict[int, Gradients]:
        """Several layers' accumulated gradients in one call: {layer: Gradients}. INTO: None, or
        into(layer, name, element_count) -> a writable contiguous float32 NumPy array of that
        many elements (or None) that the chunks of that weight are decoded straight into (e.g.
        a view of page-locked memory the caller copies to its GPU), instead of new arrays.
        DESTINATIONS (same host): {layer: {name: where}} for all six weights of a layer, where is
        a contiguous float32 CUDA tensor of the weight's shape (registered over CUDA IPC like
        backward()'s) or a RegionSlice of a region this client registered: the server writes the
        layer's sums there and streams only its state; that layer's Gradients hold WHERE."""
        references = self._fetch_destinations(destinations or {})
        fetched = self._fetch(zero_after_fetch, dtype, chunk_bytes, 0,
                              [int(layer) for layer in layers], timeout, into, references)
        for gradients in fetched:
            if gradients.state.layer in (destinations or {}):
                gradients.tensors = {canonical_weight_name(name): where for name, where
                                     in destinations[gradients.state.layer].items()}
        return {gradients.state.layer: gradients for gradients in fetched}

    def _fetch_destinations(self, destinations) -> List[Any]:
        """GradientDestination messages for fetch_layers' DESTINATIONS; CUDA tensors registered
        (their device's current stream synchronised: the server writes them when it fetches)."""
        messages, devices = [], set()
        for layer, weights in destinations.items():
            for name, where in weights.items():
                if cuda_regions.is_cuda_tensor(where):
                    if not where.is_contiguous() or where.dtype != _torch_float32():
                        raise ValueError(f"destinations[{layer}][{name!r}]: a contiguous float32 "
                                         "CUDA tensor, or a RegionSlice")
                    try:
                        region, offset, size = self._cuda_region_cache().slice_of(where)
                    except (errors.FailedPreconditionError, errors.InvalidArgumentError) as error:
                        if error.method != "RegisterRegion":
                            raise
                        raise _CudaIpcRefused(str(error)) from None
                    where = pb.RegionSlice(region_id=region, offset=offset, byte_size=size)
                    devices.add(weights[name].device)
                messages.append(pb.GradientDestination(
                    layer=int(layer), name=_WEIGHT_ENUM[canonical_weight_name(name)],
                    region=where))
        for device in devices:
            import torch

            torch.cuda.current_stream(device).synchronize()
        return messages

    def _fetch(self, zero_after_fetch, dtype, chunk_bytes, expected_window_id, layers,
               timeout, into=None, destinations=()) -> List[Gradients]:
        request = pb.FetchGradientsRequest(
            zero_after_fetch=zero_after_fetch, dtype=_DTYPE_ENUM[tensors.wire_dtype_name(dtype)],
            chunk_bytes=chunk_bytes, expected_window_id=expected_window_id, layers=layers,
            destinations=list(destinations))
        attempts = 0 if zero_after_fetch else 2  # a plain fetch is idempotent
        while True:
            try:
                fetched = self._fetch_all(request, timeout, into)
                if len(fetched) != max(1, len(layers)):
                    raise errors.AttngradError(
                        grpc.StatusCode.INTERNAL,
                        f"the server sent {len(fetched)} layers, expected {max(1, len(layers))}",
                        method="FetchGradients")
                return fetched
            except grpc.RpcError as error:
                if attempts > 0 and error.code() in _RETRYABLE:
                    attempts -= 1
                    time.sleep(0.2)
                    continue
                raise errors.from_rpc_error(error, "FetchGradients") from None

    def _fetch_all(self, request, timeout, into=None) -> List[Gradients]:
        """Every layer of one FetchGradients stream (a chunk with a state starts the next)."""
        done: List[Gradients] = []
        state = None
        buffers: Dict[str, np.ndarray] = {}
        shapes: Dict[str, Tuple[int, ...]] = {}
        dtypes: Dict[str, str] = {}
        filled: Dict[str, int] = collections.Counter()

        by_reference = {destination.layer for destination in request.destinations}

        def finish_layer():
            if state is not None and state.layer in by_reference and not buffers:
                done.append(Gradients(state, {}))  # the sums are in the caller's destinations
                return
            missing = [n for n in WEIGHT_NAMES if n not in buffers or filled[n] != buffers[n].size]
            if state is None or missing:
                raise errors.AttngradError(
                    grpc.StatusCode.INTERNAL,
                    f"incomplete gradient stream (state {'present' if state else 'missing'}, "
                    f"incomplete weights {missing})", method="FetchGradients")
            done.append(Gradients(state, {n: buffers[n].reshape(shapes[n]) for n in WEIGHT_NAMES}))

        for chunk in self._stub.FetchGradients(request, timeout=self._timeout(timeout)):
            if chunk.HasField("state"):
                if state is not None:
                    finish_layer()
                    buffers, shapes, dtypes, filled = {}, {}, {}, collections.Counter()
                state = AccumulationState.from_proto(chunk.state)
            if chunk.name == pb.WEIGHT_NAME_UNSPECIFIED and not chunk.data:
                continue
            name = _WEIGHT_BY_ENUM.get(chunk.name)
            if name is None:
                raise errors.AttngradError(
                    grpc.StatusCode.INTERNAL,
                    f"the server sent a chunk of unknown weight {chunk.name}",
                    method="FetchGradients")
            if len(chunk.shape) > 0 and name not in buffers:
                shapes[name] = tuple(int(d) for d in chunk.shape)
                dtypes[name] = _DTYPE_BY_ENUM.get(chunk.dtype, "float32")
                count = int(np.prod(shapes[name], dtype=np.int64))
                given = into(state.layer, name, count) if into is not None and \
                    state is not None else None
                if given is not None and (given.size != count or given.dtype != np.float32):
                    raise ValueError(f"into({state.layer}, {name!r}, {count}) gave "
                                     f"{given.size} {given.dtype} elements")
                buffers[name] = given if given is not None else np.empty(count, np.float32)
            if name not in buffers:
                raise errors.AttngradError(
                    grpc.StatusCode.INTERNAL,
                    f"the first chunk of {name} carried no shape", method="FetchGradients")
            size = tensors.itemsize(dtypes[name])
            count = len(chunk.data) // size
            values = tensors.decode(chunk.data, dtypes[name], (count,), field=f"gradients.{name}")
            end = chunk.offset + count
            if chunk.offset < 0 or end > buffers[name].size:
                raise errors.AttngradError(
                    grpc.StatusCode.INTERNAL,
                    f"chunk of {name} at offset {chunk.offset} with {count} elements exceeds "
                    f"{buffers[name].size}", method="FetchGradients")
            buffers[name][chunk.offset:end] = values
            filled[name] += count
        finish_layer()
        return done

    def zero_gradients(self, *, expected_window_id: int = 0, layer: Optional[int] = None,
                       timeout: Optional[float] = None
                       ) -> Tuple[AccumulationState, AccumulationState]:
        """Zeroes a layer's accumulators (layer=None: the server's first layer); returns (the
        discarded window's state, the new window's)."""
        request = pb.ZeroGradientsRequest(expected_window_id=expected_window_id)
        if layer is not None:
            request.layer = int(layer)
        response = self._unary("ZeroGradients", self._stub.ZeroGradients, request, timeout)
        return (AccumulationState.from_proto(response.previous),
                AccumulationState.from_proto(response.current))

    # -- weights ---------------------------------------------------------------------------------

    def load_weights(self, weights: Mapping[str, Any], *, expected_weights_version: int = 0,
                     dtype: str = "float32", chunk_bytes: int = 4 << 20,
                     layer: Optional[int] = None, timeout: Optional[float] = None,
                     transport: str = "bytes", synchronize: bool = True) -> int:
        """Replaces a layer's weights (all six: q_proj, k_proj, v_proj, o_proj, q_norm, k_norm,
        Hugging Face names accepted; layer=None: the server's first layer). Returns the layer's new
        weights version.

        transport: "bytes" (default): streamed in chunks of DTYPE on the connection. By reference,
        for a server on this host: "cuda_ipc" names CUDA tensors' own memory (their dtype:
        float32, float16 or bfloat16), which the server copies on the GPU; "shm" writes them into
        a shared-memory region the server reads; "auto" takes the first of these the server
        accepts (as backward() does). The server has its own copy once this returns: the
        tensors may change right after. synchronize=False: CUDA tensors' writes are known to be
        done (the current streams are not synchronised first)."""
        named = {}
        for key, value in weights.items():
            name = canonical_weight_name(key)
            if name in named:
                raise ValueError(f"weight {name} given twice")
            named[name] = value
        missing = [n for n in WEIGHT_NAMES if n not in named]
        if missing:
            raise ValueError(f"load_weights needs all six weights; missing {missing}")
        transport = self._requested_transport(transport, None)
        arguments = (expected_weights_version, layer, timeout)
        on_gpu = all(cuda_regions.is_cuda_tensor(named[n]) for n in WEIGHT_NAMES)
        if transport == "cuda_ipc" and not on_gpu:
            raise ValueError("transport='cuda_ipc' needs the six weights as CUDA tensors")
        if on_gpu and transport in ("auto", "cuda_ipc"):
            version = self._try_cuda_ipc(
                transport, lambda: self._load_weights_on_gpu(named, *arguments, synchronize))
            if version is not None:
                return version
            transport = "bytes"
        if transport in ("auto", "shm"):
            version = self._load_weights_in_shared_memory(named, dtype, transport, *arguments)
            if version is not None:
                return version
        return self._load_weights_as_bytes(named, dtype, chunk_bytes, *arguments)

    def _load_weights_as_bytes(self, named, dtype, chunk_bytes, expected_weights_version, layer,
                               timeout) -> int:
        wire = tensors.wire_dtype_name(dtype)
        size = tensors.itemsize(wire)
        limits = self._limits or self.info()
        if limits.max_message_bytes > 0:
            chunk_bytes = min(chunk_bytes, limits.max_message_bytes - _REQUEST_OVERHEAD_BYTES)
        chunk_elements = max(1, chunk_bytes // size)

        def requests():
            for name in WEIGHT_NAMES:
                array = tensors.to_numpy(named[name])
                view = memoryview(tensors.contiguous(array, wire)).cast("B")
                count = len(view) // size
                for offset in range(0, max(count, 1), chunk_elements):
                    message = _weight_chunk_head(name, expected_weights_version, layer, offset)
                    if offset == 0:
                        message.dtype = _DTYPE_ENUM[wire]
                        message.shape.extend(int(d) for d in array.shape)
                    end = min(count, offset + chunk_elements)
                    yield _WireChunk(message, view[offset * size:end * size])

        response = self._unary("LoadWeights", self._load_weights, requests(), timeout)
        return response.weights_version

    def _load_weights_by_reference(self, heads, timeout) -> int:
        """LoadWeights of chunks that each name a whole weight in a region (HEADS: the messages)."""
        response = self._unary("LoadWeights", self._load_weights,
                               (_WireChunk(head, None) for head in heads), timeout)
        return response.weights_version

    def _load_weights_on_gpu(self, named, expected_weights_version, layer, timeout,
                             synchronize: bool = True) -> int:
        """load_weights(transport="cuda_ipc"): the weights' own GPU memory, registered like
        backward()'s tensors (one region per allocation, remembered)."""
        import torch

        cache = self._cuda_region_cache()
        kept, heads = [], []
        for name in WEIGHT_NAMES:
            tensor = named[name].detach()
            usable = cuda_regions.torch_wire_dtype(tensor) is not None and \
                tensor.is_contiguous() and tensor.data_ptr() % cuda_regions.ALIGNMENT == 0
            if not usable and not synchronize:
                raise ValueError(f"load_weights(synchronize=False): {name} must be a contiguous, "
                                 "16-byte aligned float32/float16/bfloat16 tensor (a converted "
                                 "copy would need a synchronisation)")
            if cuda_regions.torch_wire_dtype(tensor) is None:
                tensor = tensor.float()
            if not tensor.is_contiguous() or tensor.data_ptr() % cuda_regions.ALIGNMENT:
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            kept.append(tensor)  # alive until the server has copied it
            try:
                region, offset, size = cache.slice_of(tensor)
            except (errors.FailedPreconditionError, errors.InvalidArgumentError) as error:
                if error.method != "RegisterRegion":
                    raise
                raise _CudaIpcRefused(str(error)) from None
            head = _weight_chunk_head(name, expected_weights_version, layer, 0)
            head.dtype = _DTYPE_ENUM[cuda_regions.torch_wire_dtype(tensor)]
            head.shape.extend(int(d) for d in tensor.shape)
            head.region.CopyFrom(pb.RegionSlice(region_id=region, offset=offset, byte_size=size))
            heads.append(head)
        # The server reads the weights when the upload arrives: the writes to them must be done.
        for device in {tensor.device for tensor in kept} if synchronize else ():
            torch.cuda.current_stream(device).synchronize()
        return self._load_weights_by_reference(heads, timeout)

    def _load_weights_in_shared_memory(self, named, dtype, transport, expected_weights_version,
                                       layer, timeout) -> Optional[int]:
        """load_weights(transport="shm"): the six weights (in DTYPE) written one after the other
        into a region; None when the server cannot map one and TRANSPORT is auto."""
        wire = tensors.wire_dtype_name(dtype)
        arrays = [tensors.contiguous(tensors.to_numpy(named[n]), wire) for n in WEIGHT_NAMES]
        offsets = np.cumsum([0] + [-(-a.nbytes // 64) * 64 for a in arrays])

        def upload(shared):
            heads = []
            for name, array, offset in zip(WEIGHT_NAMES, arrays, offsets):
                shared.memory.buf[offset:offset + array.nbytes] = memoryview(array).cast("B")
                head = _weight_chunk_head(name, expected_weights_version, layer, 0)
                head.dtype = _DTYPE_ENUM[wire]
                head.shape.extend(int(d) for d in array.shape)
                head.region.CopyFrom(pb.RegionSlice(region_id=shared.region_id,
                                                    offset=int(offset), byte_size=array.nbytes))
                heads.append(head)
            return self._load_weights_by_reference(heads, timeout)

        return self._in_shared_memory(max(int(offsets[-1]), 64), transport, upload)
