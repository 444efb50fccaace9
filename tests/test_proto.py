"""The committed protobuf/gRPC modules must be what proto/generate.py makes from the .proto files."""

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
