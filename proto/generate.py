"""Regenerate the checked-in gRPC modules from the .proto sources.

Run from anywhere: ``python proto/generate.py`` writes
``monitoring/generated/monitor_pb2.py``, ``monitor_pb2.pyi`` and
``monitor_pb2_grpc.py``. ``tests/monitoring/test_generated.py`` calls
:func:`generate` into a temporary folder and fails if the result differs from
what is checked in, so edit the .proto, run this, and commit both.

protoc names the generated imports after the .proto's path
(``bytecp/monitor/v1/...``); the modules live flat in
``bytecp.monitoring.generated``, so the one cross-module import is rewritten
to a relative one.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
SOURCES = {"bytecp/monitor/v1/monitor.proto": "monitor"}
DEFAULT_OUT = ROOT / "monitoring" / "generated"

_IMPORT = re.compile(r"^from bytecp\.monitor\.v1 import (\w+) as (\w+)$", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Compile every source into ``out_dir``; returns the files written."""
    from grpc_tools import protoc  # test/dev dependency only

    include = Path(protoc.__file__).parent / "_proto"
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        for source, stem in SOURCES.items():
            args = [
                "protoc",
                f"-I{PROTO_ROOT}",
                f"-I{include}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                source,
            ]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {source}")
            gen_dir = Path(tmp) / Path(source).parent
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                src = gen_dir / f"{stem}{suffix}"
                text = _IMPORT.sub(r"from . import \1 as \2", src.read_text())
                dst = out_dir / src.name
                dst.write_text(text)
                written.append(dst)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in generate(args.out):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["generate", "main"]
