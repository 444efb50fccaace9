import pytest

from nodecomm.thresholds import Boundary, DispatchTable, Path, Source, build_table


def table(**values):
    return build_table({n: Boundary(n, v, Source.OVERRIDE) for n, v in values.items()}, Path.NCCL, epoch=3)


def test_cpu_table_oneshot_then_twoshot():
    t = build_table({"oneshot_max_bytes": Boundary("oneshot_max_bytes", 4096, Source.DEFAULT)}, Path.TWOSHOT, 1)
    assert [t.path_for(n) for n in (0, 4096, 4097, 1 << 40)] == [Path.ONESHOT, Path.ONESHOT, Path.TWOSHOT, Path.TWOSHOT]


def test_gpu_table_all_boundaries():
    t = table(oneshot_max_bytes=64 << 10, twoshot_max_bytes=1 << 20, dma_min_bytes=24 << 20)
    assert t.path_for(64 << 10) == Path.ONESHOT
    assert t.path_for((64 << 10) + 1) == Path.TWOSHOT
    assert t.path_for((1 << 20) + 1) == Path.NCCL
    assert t.path_for((24 << 20) - 1) == Path.NCCL
    assert t.path_for(24 << 20) == Path.DMA


def test_off_paths_never_chosen():
    t = table(oneshot_max_bytes=None, twoshot_max_bytes=1 << 20, dma_min_bytes=None)
    assert Path.ONESHOT not in t.paths() and Path.DMA not in t.paths()
    assert t.path_for(0) == Path.TWOSHOT


def test_dma_below_other_boundaries_wins():
    t = table(oneshot_max_bytes=1 << 20, dma_min_bytes=4096)
    assert t.path_for(4095) == Path.ONESHOT and t.path_for(4096) == Path.DMA


@pytest.mark.parametrize("values", [{}, {"oneshot_max_bytes": 0}, {"oneshot_max_bytes": 7, "dma_min_bytes": 8}])
def test_proto_round_trip(values):
    t = table(**values)
    assert DispatchTable.from_proto(t.to_proto()) == t


def test_rows_cover_every_size():
    t = table(oneshot_max_bytes=1024, twoshot_max_bytes=1 << 20, dma_min_bytes=6 << 20)
    assert [r[2] for r in t.rows()] == [Path.ONESHOT, Path.TWOSHOT, Path.NCCL, Path.DMA]
    assert t.rows()[0][0] == 0 and t.rows()[-1][1] is None
    assert [label for label, _ in t.labels()] == ["<=1KiB", ">1KiB and <=1MiB", ">1MiB and <6MiB", ">=6MiB"]
