"""Generate the Python protobuf and gRPC modules from proto/ into phalanx/api/.

Used by `setup.py` (so `pip install .` ships generated code) and by scripts/setup for a development checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path


def generate(root: Path, out: Path | None = None) -> list[Path]:
    """Compile every .proto under root/proto into out (default: root). Returns the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    out = out or root
    proto_dir = root / "proto"
    protos = sorted(proto_dir.rglob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {proto_dir}")
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    generated = []
    for proto in protos:
        rel = proto.relative_to(proto_dir).with_suffix("")
        package_dir = out / rel.parent
        for parent in [package_dir, *package_dir.parents]:
            if parent == out or out not in parent.parents:
                break
            init = parent / "__init__.py"
            if not init.exists():
                init.write_text("")
        generated += [out / f"{rel}_pb2.py", out / f"{rel}_pb2_grpc.py"]
    return generated


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    files = generate(root)
    print(f"generated {len(files)} modules", file=sys.stderr)
