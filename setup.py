"""Build hook: generate the protobuf/gRPC modules from ``proto/`` while building.

The generated ``*_pb2*.py`` files are not in git (they are build output), so
``pip install .`` from a clean checkout must make them; without this hook the
console scripts fail on ``import retina_common.pb.retina_pb2``. All metadata
lives in pyproject.toml; grpcio-tools is a build requirement there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _codegen() -> ModuleType:
    # Loaded from its file: importing the package would need its runtime dependencies,
    # which a build environment does not have.
    spec = importlib.util.spec_from_file_location("_retina_codegen",
                                                  ROOT / "retina_common" / "codegen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProtos(build_py):
    """``build_py`` that first (re)generates stale gRPC modules in the source tree, so
    regular, editable and sdist-based builds all package them."""

    def run(self) -> None:
        done = _codegen().generate()
        if done:
            print(f"codegen: generated {', '.join(p.name for p in done)}")
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
