"""Regenerates the gRPC stubs in specdec/v1/ from protos/specdec/v1/*.proto.

Run `python -m specdec.codegen` after editing a .proto. The output depends only on the
pinned grpcio-tools version, so tests/test_protos.py can regenerate into a temporary
directory and fail when the committed stubs are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_PACKAGE = "specdec/v1"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PROTO_PACKAGE).glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto under out_dir."""
    from grpc_tools import protoc  # a build-time dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / PROTO_PACKAGE).glob("*_pb2*.py*"))


def main() -> int:
    written = generate(REPO_ROOT)
    for path in written:
        print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
