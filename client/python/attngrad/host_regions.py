"""Host memory shared with a server on this host (shared-memory regions).

The memory is a memfd sealed against shrinking and growing (SealedMemory): the server maps it, and
nothing its owner does afterwards can make the server's reads fault. register() passes its
descriptor over the server's region socket (a Unix socket: SOCK_SEQPACKET, SCM_RIGHTS), which
proves that the caller holds the memory; the server answers the region id. The protocol is
proto/include/attngrad/wire/region_socket.h's."""
from __future__ import annotations

import fcntl
import mmap
import os
import socket
from typing import Optional

import grpc

from . import errors

PROTOCOL_LINE = "attngrad-region-v1"
MAX_MESSAGE_BYTES = 4096


class SealedMemory:
    """SIZE bytes (zeros) of a memfd sealed with F_SEAL_SHRINK, F_SEAL_GROW and F_SEAL_SEAL, mapped
    here: `buf` is a writable memoryview of it, `fd` its descriptor. Client.register_region(memory)
    shares it with the server, which keeps its own mapping until the region is unregistered or this
    process has exited. close() releases this process's mapping and descriptor."""

    def __init__(self, size: int):
        size = int(size)
        if size <= 0:
            raise ValueError(f"size must be > 0 bytes, got {size}")
        fd = os.memfd_create("attngrad-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.size = size
        self.buf: Optional[memoryview] = memoryview(self._map)

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        """Releases this process's mapping and descriptor (idempotent). The mapping is dropped, not
        closed: arrays made on `buf` (NumPy keeps a reference to it but no buffer export) keep it
        mapped until they are collected, where an explicit close would leave them pointing at
        unmapped memory."""
        self.buf = None
        self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def unlink(self) -> None:
        """Nothing to remove: a memfd has no name (kept for code written for
        multiprocessing.shared_memory.SharedMemory)."""

    def __enter__(self) -> "SealedMemory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def default_socket_path(target: str) -> Optional[str]:
    """The region socket of a server reached at TARGET ("host:port") started without
    --region_socket: $XDG_RUNTIME_DIR/attngrad/regions-<port>.sock, or
    /tmp/attngrad-<uid>/regions-<port>.sock without XDG_RUNTIME_DIR; None when TARGET names no
    port (a unix: target)."""
    if target.startswith(("unix:", "unix-abstract:")):
        return None
    _, _, port = target.rpartition(":")
    if not port.isdigit() or not 0 < int(port) <= 65535:
        return None
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    directory = (os.path.join(runtime, "attngrad") if runtime.startswith("/")
                 else f"/tmp/attngrad-{os.geteuid()}")
    return f"{directory}/regions-{int(port)}.sock"


def format_request(size: int, token: Optional[str], client_id: Optional[str]) -> bytes:
    lines = [PROTOCOL_LINE, f"byte_size {int(size)}"]
    if token:
        lines.append(f"token {token}")
    if client_id:
        lines.append(f"client_id {client_id}")
    return ("\n".join(lines) + "\n").encode("ascii")


def parse_reply(reply: bytes) -> int:
    """The region id of the server's reply; its error as an AttngradError (method
    RegisterRegion)."""
    text = reply.decode("ascii", errors="replace")
    lines = text[:-1].split("\n") if text.endswith("\n") else []
    if len(lines) == 2 and lines[0] == PROTOCOL_LINE:
        kind, _, rest = lines[1].partition(" ")
        if kind == "ok" and rest.isdigit() and int(rest) > 0:
            return int(rest)
        code, _, message = rest.partition(" ")
        if kind == "error" and code.isdigit() and 1 <= int(code) <= 16:
            raise errors.make_error(errors.status_code_from_number(int(code)), message,
                                    method="RegisterRegion")
    raise errors.make_error(grpc.StatusCode.DATA_LOSS,
                            "the region socket's reply is not one", method="RegisterRegion")


def register(socket_path: str, fd: int, size: int, *, token: Optional[str] = None,
             client_id: Optional[str] = None, timeout: Optional[float] = 30.0) -> int:
    """Passes descriptor FD (a sealed memfd) to the server's region socket SOCKET_PATH for its first
    SIZE bytes; the region id. The server's refusal is an AttngradError; a socket no server
    answers on is FAILED_PRECONDITION (the server is elsewhere, or its --region_socket differs)."""
    message = format_request(size, token, client_id)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
            connection.settimeout(timeout)
            connection.connect(socket_path)
            socket.send_fds(connection, [message], [int(fd)])
            reply = connection.recv(MAX_MESSAGE_BYTES)
    except OSError as error:
        raise errors.make_error(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"region_socket: no server answers on {socket_path} ({error}); shared memory needs a "
            "server on this host, and its --region_socket path when it was given one",
            method="RegisterRegion") from None
    return parse_reply(reply)
