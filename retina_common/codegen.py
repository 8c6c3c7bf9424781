"""Generate the protobuf/gRPC modules from ``proto/`` with grpcio-tools.

Runs only when a ``.proto`` file is newer than its generated module, so a
second run is quick and changes nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "retina_common" / "pb"


def _outputs(proto: Path) -> list[Path]:
    out_dir = ROOT / "retina_common" / "pb"
    stem = proto.stem
    return [out_dir / f"{stem}{suffix}" for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")]


def _stale(proto: Path) -> bool:
    mtime = proto.stat().st_mtime
    return any(not out.exists() or out.stat().st_mtime < mtime for out in _outputs(proto))


def generate(force: bool = False) -> list[Path]:
    """Regenerate stale modules; returns the ``.proto`` files compiled."""
    from grpc_tools import protoc  # deferred: only the build step needs grpcio-tools

    protos = sorted(PROTO_DIR.glob("*.proto"))
    todo = [p for p in protos if force or _stale(p)]
    if not todo:
        return []
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *[str(p) for p in todo],
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed for {', '.join(p.name for p in todo)}")
    return todo


def main() -> None:
    done = generate(force="--force" in sys.argv)
    print(f"codegen: {'generated ' + ', '.join(p.name for p in done) if done else 'up to date'}")


if __name__ == "__main__":
    main()
