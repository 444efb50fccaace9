"""The across-nodes table's decisions and moves (client/across_nodes_forms.py), from given timings;
tests/test_across_nodes.py drives them through real ranks and daemons."""

import pytest

from nodecomm.client.across_nodes_forms import AcrossNodesForms, AcrossNodesTable, Form, probe_boundary
from nodecomm.evidence import LivePolicy, bucket_index, bucket_range

KiB, MiB = 1 << 10, 1 << 20


def test_buckets_are_powers_of_four_from_one_kib_as_the_daemons():
    sizes = (0, 1, KiB, KiB + 1, 4 * KiB, 64 * KiB, 64 * KiB + 1, 256 * MiB, 256 * MiB + 1)
    assert [bucket_index(n) for n in sizes] == [0, 0, 0, 1, 1, 3, 4, 9, 10]
    assert [bucket_range(b) for b in (0, 1, 4)] == [(0, KiB), (KiB + 1, 4 * KiB), (64 * KiB + 1, 256 * KiB)]
    for nbytes in [*range(0, 5000), *(4**k + d for k in range(5, 16) for d in (-1, 0, 1))]:
        low, high = bucket_range(bucket_index(nbytes))
        assert low <= nbytes <= high


def test_the_table_sends_up_to_flat_max_flat_and_says_so():
    table = AcrossNodesTable(64 * KiB, "probe")
    assert table.form_for(64 * KiB) is Form.FLAT and table.form_for(64 * KiB + 1) is Form.SHARDED
    assert table.rows() == [(0, 64 * KiB, Form.FLAT), (64 * KiB + 1, None, Form.SHARDED)]
    assert str(table) == "flat up to 64KiB, sharded above (probe, epoch 0)"
    assert AcrossNodesTable(0, "caller").rows() == [(0, None, Form.SHARDED)]
    assert AcrossNodesTable.decoded(AcrossNodesTable(5, "live", 3).encoded()) == AcrossNodesTable(5, "live", 3)
    assert AcrossNodesTable.decoded(AcrossNodesTable(0, "one shard").encoded()).source == "one shard"


def test_the_probe_keeps_flat_up_to_where_it_first_loses():
    flat = {1 * KiB: 1.0, 4 * KiB: 1.0, 16 * KiB: 3.0, 64 * KiB: 1.0}
    sharded = {1 * KiB: 2.0, 4 * KiB: 2.0, 16 * KiB: 2.0, 64 * KiB: 2.0}
    assert probe_boundary(flat, sharded) == 4 * KiB  # a later win does not carry it past a loss
    assert probe_boundary({1 * KiB: 3.0}, {1 * KiB: 2.0}) == 0


def test_calls_near_the_boundary_explore_the_other_form_every_period():
    forms = AcrossNodesForms(AcrossNodesTable(64 * KiB, "probe"), policy=LivePolicy(explore_period=4), reach=1)
    decided = [forms.decide(64 * KiB) for _ in range(8)]
    assert [explored for _, explored in decided] == [False, False, False, True] * 2
    assert decided[3][0] is Form.SHARDED and decided[0][0] is Form.FLAT
    far = [forms.decide(16 * MiB) for _ in range(8)]  # three buckets past the boundary's
    assert not any(explored for _, explored in far)
    pinned = AcrossNodesForms(AcrossNodesTable(64 * KiB, "caller"), live=False, policy=LivePolicy(explore_period=1))
    assert pinned.decide(64 * KiB) == (Form.FLAT, False) and not pinned.switch_due()


def _timed(forms: AcrossNodesForms, nbytes: int, flat: float, sharded: float, samples: int = 8) -> None:
    for _ in range(samples):
        forms.record(Form.FLAT, nbytes, flat)
        forms.record(Form.SHARDED, nbytes, sharded)


def test_flat_winning_past_the_boundary_moves_it_up_to_the_bucket():
    forms = AcrossNodesForms(AcrossNodesTable(64 * KiB, "probe"))
    _timed(forms, 200 * KiB, flat=1.0, sharded=2.0)  # bucket (64 KiB, 256 KiB]
    moved = forms.proposed()
    assert moved == AcrossNodesTable(256 * KiB, "live", 1)
    assert not forms.evidence.buckets()  # its evidence starts over


def test_sharded_winning_below_the_boundary_moves_it_down_past_the_bucket():
    forms = AcrossNodesForms(AcrossNodesTable(16 * MiB, "caller"))
    _timed(forms, 16 * MiB, flat=2.0, sharded=1.0)  # bucket (4 MiB, 16 MiB]
    _timed(forms, 1 * MiB, flat=1.0, sharded=2.0)  # flat still wins (256 KiB, 1 MiB]
    assert forms.proposed() == AcrossNodesTable(4 * MiB, "live", 1)
    assert forms.evidence.buckets() == [bucket_index(1 * MiB)]


@pytest.mark.parametrize(
    "flat, sharded, samples",
    [
        (1.04, 1.0, 8),  # within the 5% margin
        (3.0, 1.0, 7),  # too few samples (8 of each)
    ],
)
def test_no_move_without_enough_evidence(flat, sharded, samples):
    forms = AcrossNodesForms(AcrossNodesTable(16 * MiB, "caller"))
    _timed(forms, 16 * MiB, flat, sharded, samples)
    assert forms.proposed() is forms.table


def test_a_bucket_the_boundary_splits_is_not_compared():
    forms = AcrossNodesForms(AcrossNodesTable(100 * KiB, "caller"))  # inside (64 KiB, 256 KiB]
    _timed(forms, 90 * KiB, flat=1.0, sharded=9.0)
    _timed(forms, 200 * KiB, flat=1.0, sharded=9.0)
    assert forms.proposed() is forms.table
