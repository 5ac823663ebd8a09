"""Builds the attngrad package; the gRPC stubs are generated from proto/attngrad/v1/*.proto into the
built package (attngrad/v1/) by attngrad/_proto.py (grpcio-tools, else Debian's protoc +
grpc_python_plugin). Metadata is in pyproject.toml. From the repository root:
    pip install --no-build-isolation client/python          (ATTNGRAD_PROTO_DIR overrides
    ../../proto)
"""
import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _load_proto_module():
    spec = importlib.util.spec_from_file_location("attngrad_proto_build",
                                                  HERE / "attngrad" / "_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    """build_py, then the stubs into <build_lib>/attngrad/v1 (stamped with the protos' hash)."""

    def run(self):
        super().run()
        proto_root = Path(os.environ.get("ATTNGRAD_PROTO_DIR", HERE.parent.parent / "proto"))
        target = _load_proto_module().generate(self.build_lib, proto_root)
        print(f"attngrad: generated gRPC stubs in {target}")


setup(cmdclass={"build_py": BuildPyWithStubs})
