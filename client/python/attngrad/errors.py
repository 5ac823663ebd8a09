"""Exceptions of the attngrad client: every failed call raises an AttngradError that carries the
gRPC status code and the server's message (whether the whole RPC failed or one batch of a stream was
answered with BackwardResponse.error)."""
from __future__ import annotations

from typing import Optional

import grpc

_CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code_from_number(number: int) -> grpc.StatusCode:
    """grpc.StatusCode for a google.rpc.Code number (UNKNOWN for numbers gRPC does not define)."""
    return _CODE_BY_NUMBER.get(int(number), grpc.StatusCode.UNKNOWN)


class AttngradError(Exception):
    """A call to the attngrad service failed.

    Attributes:
      code: the grpc.StatusCode (e.g. grpc.StatusCode.INVALID_ARGUMENT).
      message: the server's message (it names the field and what was expected).
      batch_id: for a backward batch answered with an in-band error, its batch id; else None.
      method: the RPC's name, e.g. "Backward".
    """

    def __init__(self, code: grpc.StatusCode, message: str, *, batch_id: Optional[int] = None,
                 method: Optional[str] = None):
        self.code = code
        self.message = message
        self.batch_id = batch_id
        self.method = method
        where = []
        if method:
            where.append(method)
        if batch_id is not None:
            where.append(f"batch {batch_id}")
        prefix = f"[{', '.join(where)}] " if where else ""
        super().__init__(f"{prefix}{code.name}: {message}")


class InvalidArgumentError(AttngradError):
    """INVALID_ARGUMENT: a field has the wrong shape, byte count, dtype or value."""


class FailedPreconditionError(AttngradError):
    """FAILED_PRECONDITION: the weights version or accumulation window differs from the expected
    one."""


class ResourceExhaustedError(AttngradError):
    """RESOURCE_EXHAUSTED: the batch (or message) is larger than the server accepts."""


class UnavailableError(AttngradError):
    """UNAVAILABLE: the server cannot be reached or is shutting down."""


class DeadlineExceededError(AttngradError):
    """DEADLINE_EXCEEDED: the call took longer than its timeout."""


_CLASS_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


def make_error(code: grpc.StatusCode, message: str, **kwargs) -> AttngradError:
    """The most specific AttngradError subclass for CODE."""
    return _CLASS_BY_CODE.get(code, AttngradError)(code, message, **kwargs)


def from_rpc_error(error: grpc.RpcError, method: str) -> AttngradError:
    """Converts a grpc.RpcError (which is also a grpc.Call) into an AttngradError."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return make_error(code or grpc.StatusCode.UNKNOWN, details or "", method=method)
