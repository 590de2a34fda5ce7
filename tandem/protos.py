"""Generates the gRPC stubs in tandem/v1/ from proto/tandem/v1/*.proto (grpcio-tools)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"

# Verifications ahead that a pre-draft may reach (drafter.proto, assumed_ids): it assumes at most
# this many times k + 1 tokens, and the target holds no more.
MAX_PREDRAFT_DEPTH = 8
# Proposals a target holds per sequence: the one under verification, a tree of pre-drafts and a
# fresh one beside them. A drafter keeps its tree of sent pre-drafts smaller, so that none it
# counts on is dropped.
MAX_HELD_PROPOSALS = 64


def proto_files() -> list[Path]:
    return sorted((PROTO_DIR / "tandem" / "v1").glob("*.proto"))


def generate(out_dir: Path = ROOT) -> None:
    """Writes tandem/v1/*_pb2.py, *_pb2.pyi and *_pb2_grpc.py under out_dir."""
    from grpc_tools import protoc

    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}"] + [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    (out_dir / "tandem" / "v1" / "__init__.py").touch()


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
