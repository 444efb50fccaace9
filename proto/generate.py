"""Regenerate the Python protobuf and gRPC modules next to the .proto files.

    python proto/generate.py            # rewrite proto/nodecomm/v1/*_pb2*.py
    python proto/generate.py --out DIR  # write elsewhere (the staleness test compares the two)

Needs grpcio-tools (a test dependency); the generated files are committed so that machines without
it, such as the GPU hosts, can still import the package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent


def generate(out_dir: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc  # imported here: only this script needs grpcio-tools

    protos = sorted(PROTO_ROOT.glob("nodecomm/v1/*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(out_dir.glob("nodecomm/v1/*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
