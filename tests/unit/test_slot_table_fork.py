"""A forked child and its parent never share or steal each other's slots (real fork, real locks)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ray_triton_shm._private.shm.segment import new_segment_name
from ray_triton_shm._private.shm.slot_table import SlotTable

QUARANTINE_S = 0.3


@pytest.fixture
def table():
    owner = SlotTable.create(new_segment_name("forktest"), slots=3, quarantine_s=QUARANTINE_S)
    yield owner
    owner.close()
    assert not os.path.exists(f"/dev/shm/{owner.name}")


def _third_claims(table_name: str, index: int) -> bool:
    """Whether an unrelated process can lease slot ``index`` now (it lets go at once)."""
    code = (
        "from ray_triton_shm._private.shm.slot_table import SlotTable\n"
        f"t = SlotTable.attach({table_name!r})\n"
        f"ok = t.try_claim({index})\n"
        f"if ok: t.release({index})\n"
        "print(ok)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return out.strip() == "True"


def _fork(body) -> tuple[int, int, int]:
    """Fork a child that runs ``body(report, wait)`` then exits; return (pid, from_child, to_child)."""
    up_r, up_w = os.pipe()
    down_r, down_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.close(up_r)
            os.close(down_w)
            body(lambda data: os.write(up_w, data), lambda: os.read(down_r, 1))
        except BaseException:
            code = 1
        os._exit(code)
    os.close(up_w)
    os.close(down_r)
    return pid, up_r, down_w


def _exit_code(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_child_cannot_steal_or_share_the_parents_slots(table) -> None:
    user = SlotTable.attach(table.name)
    assert user.try_claim(0)  # the parent's lease, made before the fork

    def child(report, wait) -> None:
        report(bytes([user.try_claim(0), user.try_claim(1)]))  # 0 is the parent's; 1 is free
        wait()  # hold slot 1 until the parent says so
        user.close()

    pid, from_child, to_child = _fork(child)
    try:
        took_parents, took_free = os.read(from_child, 2)
        assert not took_parents, "the child leased the slot its parent holds"
        assert took_free
        # The child's lease is the child's: the parent cannot take it over or unlock it.
        assert not user.try_claim(1), "the parent leased the slot its child holds"
        assert user.held_elsewhere_by(1, _word(table, 1))
        time.sleep(QUARANTINE_S + 0.1)
        assert not _third_claims(table.name, 1), "a third process leased the slot the child holds"
        assert not _third_claims(table.name, 0), "a third process leased the slot the parent holds"
    finally:
        os.write(to_child, b"x")
        assert _exit_code(pid) == 0
        os.close(from_child)
        os.close(to_child)
    # The child is gone: the parent's own lease is still the parent's.
    assert user.token(0) is not None and not _third_claims(table.name, 0)
    user.release(0)
    assert _third_claims(table.name, 0)
    user.close()


def test_the_parents_slots_stay_held_while_and_after_a_forked_child_runs(table) -> None:
    user = SlotTable.attach(table.name)
    assert user.try_claim(2)
    token = user.token(2)

    def child(report, wait) -> None:
        # What a forked worker might do with a copy of its parent's state: give back
        # what looks like its own lease, and sweep.
        user.release(2)
        user.sweep()
        report(b"d")

    pid, from_child, to_child = _fork(child)
    try:
        assert os.read(from_child, 1) == b"d"
        assert _exit_code(pid) == 0
    finally:
        os.close(from_child)
        os.close(to_child)
    assert _word(table, 2) == token, "the child overwrote the parent's lease"
    assert not _third_claims(table.name, 2), "the parent's slot was released by its child"
    user.release(2)
    user.close()


def _word(table: SlotTable, index: int) -> int:
    return table._word(index)


def test_a_forked_child_closing_its_copy_of_an_owned_segment_leaves_it_to_the_owner() -> None:
    from ray_triton_shm._private.shm.segment import Segment

    owned = Segment.create(new_segment_name("forktest"), 64)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child: closes what it inherited, as a worker's cleanup would
            owned.close()
            os._exit(0)
        assert _exit_code(pid) == 0
        assert os.path.exists(f"/dev/shm/{owned.name}"), "a forked child unlinked its parent's segment"
    finally:
        owned.close()
    assert not os.path.exists(f"/dev/shm/{owned.name}")
