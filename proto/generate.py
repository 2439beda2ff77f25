"""Regenerate the committed Python stubs from the .proto files: ``python -m pagedserve.proto.generate``.

Stubs land in ``proto/v1/`` (importable as ``pagedserve.proto.v1``); tests/unit/test_proto.py fails when they are stale.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

PROTO_ROOT = os.path.dirname(os.path.abspath(__file__))
PROTO_FILES = ["pagedserve/v1/generation.proto"]
STUB_DIR = os.path.join(PROTO_ROOT, "v1")


def generate(out_dir: str = STUB_DIR) -> list[str]:
    """Write the stubs into ``out_dir``; return their paths."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={tmp}",
                          f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *PROTO_FILES])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        os.makedirs(out_dir, exist_ok=True)
        for proto in PROTO_FILES:
            src_dir = os.path.join(tmp, os.path.dirname(proto))
            for name in sorted(os.listdir(src_dir)):
                with open(os.path.join(src_dir, name)) as f:
                    text = f.read()
                # protoc writes absolute imports from the proto root; the stubs live inside our package.
                text = text.replace("from pagedserve.v1 import", "from . import")
                path = os.path.join(out_dir, name)
                with open(path, "w") as f:
                    f.write(text)
                written.append(path)
    init = os.path.join(out_dir, "__init__.py")
    if not os.path.exists(init):
        shutil.copyfile(os.devnull, init)
    return written


if __name__ == "__main__":
    for p in generate(sys.argv[1] if len(sys.argv) > 1 else STUB_DIR):
        print(p)
