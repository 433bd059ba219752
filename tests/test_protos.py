"""The checked-in generated code must match what `make protos` produces from the .proto files."""

from __future__ import annotations

import shutil
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def test_generated_code_matches_proto_files(tmp_path: Path) -> None:
    # Prepare: a copy of the .proto files at the same import path
    (tmp_path / "protos").mkdir()
    protos = sorted((ROOT / "protos").glob("*.proto"))
    for proto in protos:
        shutil.copy(proto, tmp_path / "protos" / proto.name)

    # Execute: the same command as `make protos`
    args = ["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}", *[str(tmp_path / "protos" / p.name) for p in protos]]
    assert protoc.main(args) == 0

    # Assert
    fresh = sorted(p.name for p in (tmp_path / "protos").iterdir() if p.name.endswith(GENERATED_SUFFIXES))
    checked_in = sorted(p.name for p in (ROOT / "protos").iterdir() if p.name.endswith(GENERATED_SUFFIXES))
    assert fresh == checked_in, "generated files differ from the checked-in set: run `make protos`"
    for name in fresh:
        assert (tmp_path / "protos" / name).read_text() == (ROOT / "protos" / name).read_text(), (
            f"protos/{name} is stale: run `make protos`")
