"""Hypothesis strategies for the control plane's requests: edge values, wild text, and Joins,
timings and counts a real rank would send with some fields replaced (tests/reliability/test_fuzz_rpc.py)."""

from __future__ import annotations

import os

from hypothesis import strategies as st

from nodecomm import _native
from nodecomm.thresholds import BOUNDARY_NAMES
from nodecomm.v1 import control_pb2 as pb

MAX_WORLD = _native.MAX_RANKS
PID = os.getpid()
NAN, INF = float("nan"), float("inf")

# -- strategies ------------------------------------------------------------------------------------


def edges_or(low: int, high: int, *edges: int) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([v for v in (low, high, *edges) if low <= v <= high]), st.integers(low, high))


INT32 = edges_or(-(2**31), 2**31 - 1, -1, 0, 1, 2, 3, 8, MAX_WORLD, MAX_WORLD + 1)
UINT32 = edges_or(0, 2**32 - 1, 1, 2, 2**31, 2**31 - 1)
UINT64 = edges_or(0, 2**64 - 1, 1, 2, 63, 64, 4096, 2**31, 2**32, 2**62, 2**63, 2**63 - 1)
ODD_FLOATS = st.sampled_from([0.0, -0.0, -1.0, NAN, INF, -INF, 1e300, 5e-324, 2.0**63])
ANY_FLOAT = st.one_of(ODD_FLOATS, st.floats())
# Short positive waits or odd values (a request that waits for absent peers costs what it asks for).
WAIT = st.one_of(st.floats(0.005, 0.05), ODD_FLOATS, st.floats())
# Long strings of one character: a valid one past the 128-character limit, NUL, multi-byte.
LONG_TEXT = st.builds(
    lambda char, count: char * count,
    st.sampled_from(["g", "\x00", "é", "日", "\U0001f980", "a/", "%s", "{}"]),
    st.sampled_from([128, 129, 2000, 100_000, 1_500_000]),
)
# Any characters, up to a few hundred (a short random text repeated: cheap to generate).
MEDIUM_TEXT = st.builds(lambda text, count: text * count, st.text(min_size=1, max_size=12), st.integers(10, 40))
TEXT = st.one_of(st.text(max_size=40), MEDIUM_TEXT, LONG_TEXT)
GROUP_NAMES = st.one_of(st.sampled_from(["fz", "fz-a", "fz.b", "Z9._:/-", "fz-solo", "fz-pair", "a" * 128]), TEXT)
DTYPE = st.one_of(st.sampled_from(list(pb.DType.values())), INT32)
OP = st.one_of(st.sampled_from(list(pb.Op.values())), INT32)
PATH = st.one_of(st.sampled_from(list(pb.Path.values())), INT32)


@st.composite
def boundaries(draw, names: st.SearchStrategy[str] = TEXT) -> pb.Boundary:
    name = draw(st.one_of(st.sampled_from(BOUNDARY_NAMES), names))
    boundary = pb.Boundary(name=name, source=draw(INT32))
    value = draw(st.one_of(st.none(), UINT64))
    if value is not None:
        boundary.value_bytes = value
    return boundary


# Long lists, made from one number (drawing each item would make most of the test's time).
MANY_DTYPES = st.integers(500, 3000).map(lambda n: [(i * 2654435761) % 2**32 - 2**31 for i in range(n)])
MANY_OVERRIDES = st.integers(200, 3000).map(
    lambda n: [pb.Boundary(name=f"{BOUNDARY_NAMES[i % 4]}{'x' * (i % 3)}", value_bytes=i) for i in range(n)]
)


# What a wild value may replace in a Join that a real rank would send.
JOIN_MUTATIONS: dict[str, st.SearchStrategy] = {
    "group": GROUP_NAMES,
    "rank": INT32,
    "world_size": INT32,
    "device": st.one_of(st.sampled_from(["cuda", "cuda:0", "GPU-00000000-0000-0000-0000-000000000000"]), TEXT),
    "capacity_bytes": edges_or(0, 2**64 - 1, 63, 64, 16 << 20, (16 << 20) + 1),
    "dtypes": st.lists(DTYPE, max_size=4) | MANY_DTYPES,
    "pid": INT32,
    "join_timeout_seconds": ANY_FLOAT,
    "nccl_fallback": st.just(True),
    "overrides": st.lists(boundaries(), max_size=3) | MANY_OVERRIDES,
    "wire": st.one_of(st.sampled_from(list(pb.Wire.values())), INT32),
}
CPU_BOUNDARIES = ["oneshot_max_bytes", "service_min_bytes"]


@st.composite
def join_requests(draw, group: str | None = None, world_size: int | None = None) -> pb.JoinRequest:
    """A Join a real rank would send, with up to four of its fields replaced by wild values."""
    world_size = world_size or draw(st.sampled_from([1, 1, 1, 2, 3]))
    request = pb.JoinRequest(
        group=group or draw(st.sampled_from([f"fz-j{i}" for i in range(64)])),
        rank=draw(st.integers(0, world_size - 1)),
        world_size=world_size,
        device="cpu",
        geometry=pb.Geometry(
            capacity_bytes=draw(st.sampled_from([64, 4096, 65536])),
            dtypes=draw(st.lists(st.sampled_from([pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16]), min_size=1, max_size=3)),
        ),
        pid=PID,
        join_timeout_seconds=draw(st.floats(0.005, 0.05)),
    )
    for name in draw(st.lists(st.sampled_from(CPU_BOUNDARIES), max_size=2, unique=True)):
        request.overrides.add(name=name, value_bytes=draw(st.integers(0, 1 << 20)))
    mutable = sorted(set(JOIN_MUTATIONS) - ({"group"} if group else set()))
    for name in draw(st.lists(st.sampled_from(mutable), max_size=4, unique=True)):
        value = draw(JOIN_MUTATIONS[name])
        if name in ("capacity_bytes", "dtypes", "overrides", "wire"):
            target = request.geometry if name != "overrides" else request
            target.ClearField(name)
            if isinstance(value, list):
                getattr(target, name).extend(value)
            else:
                setattr(target, name, value)
        else:
            setattr(request, name, value)
    return request


def timings() -> st.SearchStrategy[pb.TimingBatch]:
    timing = st.builds(
        pb.Timing,
        path=PATH,
        bytes=UINT64,
        seconds=st.one_of(st.floats(1e-6, 1e-2), ANY_FLOAT),
    )
    count = st.builds(
        pb.OperationCount,
        op=OP,
        path=PATH,
        operations=UINT64,
        bytes=UINT64,
        wire=st.one_of(st.sampled_from(list(pb.Wire.values())), INT32),
        wire_bytes=UINT64,
    )
    return st.builds(pb.TimingBatch, timings=st.lists(timing, max_size=40), counts=st.lists(count, max_size=6))


def evidence() -> st.SearchStrategy[pb.TimingBatch]:
    """Many timings of oneshot and twoshot in a few sizes: enough for live recalibration to move
    the group's boundary (and push a table down every session), with odd seconds now and then."""
    timing = st.builds(
        pb.Timing,
        path=st.sampled_from([pb.ONESHOT, pb.TWOSHOT]),
        bytes=st.sampled_from([0, 1, 4096, 32 << 10, (32 << 10) + 1, 1 << 20, 1 << 40, 2**64 - 1]),
        seconds=st.one_of(st.floats(1e-6, 1e-3), st.sampled_from([0.0, 5e-324, 3599.999, 1e-300])),
    )
    return st.builds(pb.TimingBatch, timings=st.lists(timing, min_size=20, max_size=80))
