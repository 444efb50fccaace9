"""The slab layout of a top-k exchange, which the daemon allocates and every rank maps.

Rows are owned in contiguous blocks: with `rows` rows in a stage, per = ceil(rows / world_size)
and rank r owns rows [r * per, min((r + 1) * per, rows)). Owner r's slab holds two slots (stages
alternate between them); a slot is an index plane then a score plane, each
[rows_per_owner, world_size, topk] of 4-byte elements (int32 indices, float32 score bits), where
[i, s, :] is what source rank s wrote for the owner's i-th row.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUT_VERSION = 1
SLOTS = 2
ELEMENT_BYTES = 4


def owned_rows(rows: int, world_size: int, rank: int) -> range:
    per = -(-rows // world_size)
    return range(min(rows, rank * per), min(rows, (rank + 1) * per))


@dataclass(frozen=True)
class TopkLayout:
    max_rows: int
    topk: int
    world_size: int

    @property
    def rows_per_owner(self) -> int:
        """The most rows any owner can have in a stage: ceil(max_rows / world_size)."""
        return -(-self.max_rows // self.world_size)

    @property
    def plane_elements(self) -> int:
        return self.rows_per_owner * self.world_size * self.topk

    @property
    def slot_bytes(self) -> int:
        return 2 * self.plane_elements * ELEMENT_BYTES

    @property
    def slab_bytes(self) -> int:
        return SLOTS * self.slot_bytes
