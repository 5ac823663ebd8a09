"""The generated Python stubs of proto/attngrad/v1/*.proto, and how they are made.

Nothing generated is committed. The stubs live in the subpackage ``attngrad.v1`` (the proto package
``attngrad.v1`` maps onto it, so the generated ``from attngrad.v1 import tensor_pb2`` resolves
here):

* ``pip install client/python`` (setup.py) or ``client/python/generate_stubs.sh`` write them into
  the package's own ``attngrad/v1/`` directory, with a stamp of the .proto files they came from;
* otherwise (running from the source tree, or the stamp is stale because proto/ changed) they are
  generated on first import into a cache directory (``$ATTNGRAD_STUB_CACHE`` or
  ``~/.cache/attngrad/stubs/<hash>``), which is appended to the package's ``__path__``.

Generators, in order: ``grpc_tools.protoc`` (grpcio-tools) when importable, else Debian's ``protoc``
with ``grpc_python_plugin`` (packages protobuf-compiler and protobuf-compiler-grpc).

Next to the stubs the generator also writes the protos' serialized FileDescriptorSet
(``attngrad_v1.fds``). Should the generated modules fail to import under another protobuf runtime
than the one they were generated for (stubs carried to a machine with no generator), the message
classes and the service stub are built from that descriptor set with the runtime's own API instead
(with a warning). ``ATTNGRAD_STUBS=descriptors`` forces that path (for tests).

Run as a script (``python attngrad/_proto.py OUT_DIR``) it generates into OUT_DIR/attngrad/v1.
This module imports nothing from the rest of the package.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Optional, Tuple

PROTO_FILES = ("attngrad/v1/tensor.proto", "attngrad/v1/attngrad.proto")
GENERATED_MODULES = ("tensor_pb2", "attngrad_pb2", "attngrad_pb2_grpc")
STAMP_NAME = "_source_hash"
DESCRIPTOR_SET_NAME = "attngrad_v1.fds"

_PACKAGE_DIR = Path(__file__).resolve().parent


class StubGenerationError(RuntimeError):
    """The gRPC stubs could not be found or generated (no .proto files, or no generator)."""


def find_proto_root() -> Optional[Path]:
    """The directory holding attngrad/v1/*.proto: $ATTNGRAD_PROTO_DIR, a copy shipped inside the
    installed package (attngrad/_proto_src), or the repository's proto/ next to client/python."""
    candidates = []
    if os.environ.get("ATTNGRAD_PROTO_DIR"):
        candidates.append(Path(os.environ["ATTNGRAD_PROTO_DIR"]))
    candidates.append(_PACKAGE_DIR / "_proto_src")
    candidates.append(_PACKAGE_DIR.parent.parent.parent / "proto")  # <repo>/client/python/attngrad
    for root in candidates:
        if all((root / name).is_file() for name in PROTO_FILES):
            return root
    return None


def _generator() -> Tuple[str, list]:
    """(a name that identifies the generator, the command prefix that runs it)."""
    try:
        import grpc_tools  # noqa: F401  (grpcio-tools: matches the installed grpcio/protobuf)
        return "grpc_tools", [sys.executable, "-m", "grpc_tools.protoc"]
    except ImportError:
        pass
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if not protoc or not plugin:
        raise StubGenerationError(
            "cannot generate the attngrad gRPC stubs: neither grpcio-tools (pip install "
            "grpcio-tools) nor Debian's protoc + grpc_python_plugin (apt install protobuf-compiler "
            "protobuf-compiler-grpc) is available")
    return "protoc", [protoc, f"--plugin=protoc-gen-grpc_python={plugin}"]


def source_hash(proto_root: Path) -> str:
    """A hash of the .proto files (the stamp of generated stubs: stale when proto/ changed)."""
    digest = hashlib.sha256()
    for name in PROTO_FILES:
        digest.update(name.encode())
        digest.update((proto_root / name).read_bytes())
    return digest.hexdigest()[:20]


def cache_key(proto_root: Path) -> str:
    """The cache directory's name: the protos, the generator kind and the protobuf runtime."""
    digest = hashlib.sha256(source_hash(proto_root).encode())
    try:
        from google.protobuf import __version__ as protobuf_version
    except ImportError:  # pragma: no cover - grpc needs protobuf anyway
        protobuf_version = "none"
    digest.update(protobuf_version.encode())
    try:
        generator_name = _generator()[0]
    except StubGenerationError:
        generator_name = "none"
    digest.update(generator_name.encode())
    return digest.hexdigest()[:20]


def generate(out_dir, proto_root: Optional[Path] = None) -> Path:
    """Generates the stubs into OUT_DIR/attngrad/v1 (atomically: a reader never sees half a set).
    Returns that directory."""
    proto_root = Path(proto_root) if proto_root else find_proto_root()
    if proto_root is None:
        raise StubGenerationError(
            "cannot find proto/attngrad/v1/*.proto: set ATTNGRAD_PROTO_DIR to the repository's "
            "proto/ directory")
    out_dir = Path(out_dir)
    target = out_dir / "attngrad" / "v1"
    target.mkdir(parents=True, exist_ok=True)
    _, command = _generator()
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".attngrad-stubs-") as scratch:
        generated = Path(scratch) / "attngrad" / "v1"
        generated.mkdir(parents=True)
        result = subprocess.run(
            command + [f"--proto_path={proto_root}", f"--python_out={scratch}",
                       f"--grpc_python_out={scratch}", "--include_imports",
                       f"--descriptor_set_out={generated / DESCRIPTOR_SET_NAME}"]
            + [str(proto_root / n) for n in PROTO_FILES],
            capture_output=True, text=True)
        if result.returncode != 0:
            raise StubGenerationError(
                f"generating the attngrad stubs failed ({' '.join(command)}): "
                f"{result.stderr.strip()}")
        for module in GENERATED_MODULES:
            if not (generated / f"{module}.py").is_file():
                raise StubGenerationError(f"the stub generator did not write {module}.py")
        (generated / "__init__.py").write_text(
            '"""Generated from proto/attngrad/v1 (not committed)."""\n')
        (generated / STAMP_NAME).write_text(source_hash(proto_root) + "\n")
        # Modules first, the stamp last: a stamp means a complete set.
        for path in sorted(generated.iterdir(), key=lambda p: p.name == STAMP_NAME):
            os.replace(path, target / path.name)
    return target


def _stamp_matches(directory: Path, proto_root: Optional[Path]) -> bool:
    stamp = directory / STAMP_NAME
    if not all((directory / f"{m}.py").is_file() for m in GENERATED_MODULES) \
            or not stamp.is_file() \
            or not (directory / DESCRIPTOR_SET_NAME).is_file():
        return False
    if proto_root is None:  # an installed package without the sources: trust what was built
        return True
    return stamp.read_text().strip() == source_hash(proto_root)


def _cache_root() -> Path:
    if os.environ.get("ATTNGRAD_STUB_CACHE"):
        return Path(os.environ["ATTNGRAD_STUB_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attngrad" / "stubs"


def load() -> Tuple[ModuleType, ModuleType, ModuleType]:
    """(tensor_pb2, attngrad_pb2, attngrad_pb2_grpc), generating them first when needed."""
    package = importlib.import_module("attngrad")
    proto_root = find_proto_root()
    in_package = _PACKAGE_DIR / "v1"
    if not _stamp_matches(in_package, proto_root):
        if proto_root is None:
            raise StubGenerationError(
                "the attngrad gRPC stubs were not generated and the .proto files are not found: "
                "run client/python/generate_stubs.sh, pip install client/python, or set "
                "ATTNGRAD_PROTO_DIR")
        cache_dir = _cache_root() / cache_key(proto_root)
        if not _stamp_matches(cache_dir / "attngrad" / "v1", proto_root):
            cache_dir.mkdir(parents=True, exist_ok=True)
            generate(cache_dir, proto_root)
        extra = str(cache_dir / "attngrad")
        if in_package.exists():
            # A stale in-package attngrad/v1 would shadow the fresh one: put the cache first.
            package.__path__.insert(0, extra)
        elif extra not in package.__path__:
            package.__path__.append(extra)
    v1 = importlib.import_module("attngrad.v1")
    if os.environ.get("ATTNGRAD_STUBS") == "descriptors":
        return _from_descriptor_set(Path(v1.__path__[0]) / DESCRIPTOR_SET_NAME)
    try:
        tensor_pb2 = importlib.import_module("attngrad.v1.tensor_pb2")
        attngrad_pb2 = importlib.import_module("attngrad.v1.attngrad_pb2")
        attngrad_pb2_grpc = importlib.import_module("attngrad.v1.attngrad_pb2_grpc")
    except Exception as error:  # noqa: BLE001 - gencode of another protobuf generation
        import warnings
        warnings.warn(f"the generated attngrad stubs do not import under protobuf "
                      f"{_protobuf_version()} ({error!r}); building them from "
                      f"{DESCRIPTOR_SET_NAME}")
        return _from_descriptor_set(Path(v1.__path__[0]) / DESCRIPTOR_SET_NAME)
    return tensor_pb2, attngrad_pb2, attngrad_pb2_grpc


def _protobuf_version() -> str:
    try:
        from google.protobuf import __version__
        return __version__
    except ImportError:  # pragma: no cover
        return "none"


def _from_descriptor_set(path: Path) -> Tuple[ModuleType, ModuleType, ModuleType]:
    """Module-like namespaces equivalent to the generated ones (messages, enum values, the service
    stub), built from the serialized FileDescriptorSet with the runtime protobuf's own API."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    files = descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file_proto in files.file:
        pool.Add(file_proto)

    def message_class(descriptor):
        if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
            return message_factory.GetMessageClass(descriptor)
        return message_factory.MessageFactory(pool).GetPrototype(descriptor)

    modules = {}
    for file_proto in files.file:
        file_descriptor = pool.FindFileByName(file_proto.name)
        module = ModuleType(file_proto.name.replace("/", ".").replace(".proto", "_pb2"))
        module.DESCRIPTOR = file_descriptor
        for name, message in file_descriptor.message_types_by_name.items():
            setattr(module, name, message_class(message))
        for name, enum in file_descriptor.enum_types_by_name.items():
            for value in enum.values:
                setattr(module, value.name, value.number)
            setattr(module, name, enum)
        modules[file_proto.name] = module
    tensor_pb2 = modules["attngrad/v1/tensor.proto"]
    attngrad_pb2 = modules["attngrad/v1/attngrad.proto"]
    service = attngrad_pb2.DESCRIPTOR.services_by_name["AttentionGradient"]

    class AttentionGradientStub:
        """The AttentionGradient service's stub, as grpc_python_plugin would write it."""

        def __init__(self, channel):
            for method in service.methods:
                kind = _kind_from_proto(files, method.name, channel)
                setattr(self, method.name, kind(
                    f"/{service.full_name}/{method.name}",
                    request_serializer=lambda message: message.SerializeToString(),
                    response_deserializer=message_class(method.output_type).FromString))

    grpc_module = ModuleType("attngrad.v1.attngrad_pb2_grpc")
    grpc_module.AttentionGradientStub = AttentionGradientStub
    return tensor_pb2, attngrad_pb2, grpc_module


def _kind_from_proto(files, method_name: str, channel):
    for file_proto in files.file:
        for service in file_proto.service:
            for method in service.method:
                if method.name == method_name:
                    return {(False, False): channel.unary_unary,
                            (True, False): channel.stream_unary,
                            (False, True): channel.unary_stream,
                            (True, True): channel.stream_stream}[
                        (method.client_streaming, method.server_streaming)]
    raise StubGenerationError(f"method {method_name} not in the descriptor set")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR   (writes OUT_DIR/attngrad/v1/*_pb2*.py)")
    print(generate(sys.argv[1]))
