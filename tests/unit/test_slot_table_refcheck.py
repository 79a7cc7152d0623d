"""``held_elsewhere_by`` against a lease that ends, and a slot leased again, while it looks."""

from __future__ import annotations

import os

import pytest

from ray_triton_shm._private.shm.segment import new_segment_name
from ray_triton_shm._private.shm.slot_table import SlotTable


@pytest.fixture
def table():
    owner = SlotTable.create(new_segment_name("refcheck"), slots=2, quarantine_s=0.2)
    yield owner
    owner.close()
    assert not os.path.exists(f"/dev/shm/{owner.name}")


def test_a_lease_that_ends_while_its_ref_is_checked_is_not_accepted(table, monkeypatch) -> None:
    # Three holders of the table, each with its own open file description (as three processes).
    leaser, checker, next_user = (SlotTable.attach(table.name) for _ in range(3))
    try:
        assert leaser.try_claim(0)
        token = leaser.token(0)
        assert checker.held_elsewhere_by(0, token)

        # The interleaving: the checker has read the slot's word (still the lease's token);
        # before it looks at the lock, the lease ends and another user leases the slot.
        look_at_lock = checker._locked_elsewhere

        def lease_ends_then_slot_taken(index: int) -> bool:
            leaser.release(0)
            assert next_user.try_claim(0)
            return look_at_lock(index)

        monkeypatch.setattr(checker, "_locked_elsewhere", lease_ends_then_slot_taken)
        assert not checker.held_elsewhere_by(0, token), "an ended lease's slot ref was accepted"
        assert next_user.token(0) != token
        next_user.release(0)
    finally:
        for t in (leaser, checker, next_user):
            t.close()
