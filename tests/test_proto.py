"""The committed protobuf/gRPC modules must be what proto/generate.py makes from the .proto files, and
the native module's codes the values they define."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools is a test dependency")
def test_generated_code_is_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    fresh = generate.generate(tmp_path)
    assert fresh, "protoc produced nothing"
    for path in fresh:
        committed = ROOT / "proto" / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is not committed; run python proto/generate.py"
        assert committed.read_text() == path.read_text(), f"{committed} is stale; run python proto/generate.py"


def test_native_codes_are_the_contracts_values():
    """The native module takes nodecomm.v1's values as ints; its enums name the same numbers."""
    from nodecomm import _native
    from nodecomm.v1 import control_pb2 as pb

    for native, proto in ((_native.DType, pb.DType), (_native.Path, pb.Path)):
        for member in native:
            assert proto.Value(member.name) == member.value, (native.__name__, member.name)
    assert {m.name for m in _native.DType} == {n for n in pb.DType.keys() if not n.endswith("UNSPECIFIED")}
