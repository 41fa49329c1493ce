"""Regenerate the Python stubs of ``dspine/v1/*.proto`` (needs ``grpcio-tools``).

    python -m dspine.protos.generate           # rewrite the committed stubs
    python -m dspine.protos.generate --check   # exit 1 if they are stale

protoc writes ``from dspine.v1 import dspine_pb2`` into the gRPC stubs, an
import that only works with ``protos/`` itself on ``sys.path``. The stubs
live inside the package ``dspine.protos.dspine.v1``, so the import is
rewritten to a relative one (``from . import dspine_pb2``). Likewise the
module name protoc gives the message classes (``dspine.v1.dspine_pb2``) is
rewritten to the importable one, so that messages pickle by reference
(Ray Serve pickles them between its proxy and the replicas).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # holds dspine/v1/*.proto
PROTO_FILES = ("dspine/v1/dspine.proto",)
_ABSOLUTE_IMPORT = re.compile(r"^from dspine\.v1 import (\w+_pb2) as (\w+)$", re.MULTILINE)
_MODULE_NAME = re.compile(r"'dspine\.v1\.(\w+_pb2)'")
_PACKAGE = "dspine.protos.dspine.v1"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every proto into ``out_dir`` (same relative layout); return the written stubs."""
    from grpc_tools import protoc

    try:
        from importlib.resources import files

        include = str(files("grpc_tools") / "_proto")
    except (ImportError, TypeError):  # pragma: no cover - very old importlib
        include = str(Path(protoc.__file__).parent / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *PROTO_FILES]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for proto in PROTO_FILES:
        stem = out_dir / proto[: -len(".proto")]
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = stem.parent / (stem.name + suffix)
            text = _ABSOLUTE_IMPORT.sub(r"from . import \1 as \2", path.read_text())
            path.write_text(_MODULE_NAME.sub(rf"'{_PACKAGE}.\1'", text))
            written.append(path)
    return written


def stale_files(committed_root: Path = PROTO_ROOT) -> list[str]:
    """Stubs under ``committed_root`` that differ from a fresh generation (empty = up to date)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for path in fresh:
            rel = path.relative_to(tmp)
            committed = committed_root / rel
            if not committed.exists() or committed.read_text() != path.read_text():
                stale.append(str(rel))
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale stubs (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for rel in stale:
            print(f"stale: {rel} (run python -m dspine.protos.generate)", file=sys.stderr)
        return 1 if stale else 0
    for path in generate(PROTO_ROOT):
        print(f"wrote {path.relative_to(PROTO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
