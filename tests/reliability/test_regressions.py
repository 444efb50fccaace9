"""One test per bug the fuzzers found, each with the input that found it, against one daemon."""

from __future__ import annotations

import grpc
import pytest

from conftest import join_request

from .harness import Checked


def refused(checked: Checked, method: str, request: object, timeout: float = 5.0) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        getattr(checked.stub, method)(request, timeout=timeout)
    checked.assert_alive()
    return raised.value


def test_an_override_named_twice_once_without_a_value_is_invalid_not_unknown(checked):
    # Found by test_join: sorting the overrides compared None (off) with an int -> UNKNOWN.
    request = join_request("twice", 0, 1, capacity=4096)
    request.overrides.add(name="oneshot_max_bytes")
    request.overrides.add(name="oneshot_max_bytes", value_bytes=1)
    error = refused(checked, "Join", request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "overrides ['oneshot_max_bytes', 'oneshot_max_bytes']: expected each of" in error.details()
