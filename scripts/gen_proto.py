"""Generate the committed ``*_pb2`` modules of ``proto/`` with grpcio-tools.

The .proto files are compiled under the import path ``stalwart/proto/`` so that generated
modules import each other as ``stalwart.proto.*`` and register unique file names in
protobuf's descriptor pool (an etcd client's own ``rpc.proto``/``kv.proto`` live there too).

    python scripts/gen_proto.py            # write into proto/
    python scripts/gen_proto.py --out DIR  # write elsewhere (the staleness test compares)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent.parent / "proto"
GRPC_FILES = {"agent.proto"}  # files that define services


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    from grpc_tools import protoc  # imported here: a build-time tool, not a runtime dependency

    sources = sorted(proto_dir.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pkg = root / "stalwart" / "proto"
        pkg.mkdir(parents=True)
        for src in sources:
            shutil.copy(src, pkg / src.name)
        gen = root / "gen"
        gen.mkdir()
        for src in sources:
            args = ["protoc", f"-I{root}", f"--python_out={gen}", f"--pyi_out={gen}"]
            if src.name in GRPC_FILES:
                args.append(f"--grpc_python_out={gen}")
            args.append(str(pkg / src.name))
            if protoc.main(args) != 0:
                raise SystemExit(f"protoc failed on {src.name}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for f in sorted((gen / "stalwart" / "proto").iterdir()):
            target = out_dir / f.name
            shutil.copy(f, target)
            written.append(target)
    return written


def stale_files(proto_dir: Path = PROTO_DIR) -> list[str]:
    """Generated files in ``proto_dir`` that differ from what grpcio-tools generates now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp), proto_dir)}
    committed = {p.name: p.read_bytes() for p in proto_dir.glob("*_pb2*.py*")}
    return sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed files are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: proto/{name} (run python scripts/gen_proto.py)")
        return 1 if stale else 0
    for path in generate(args.out):
        print(path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
