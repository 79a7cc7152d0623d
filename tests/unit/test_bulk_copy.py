from __future__ import annotations

import threading

import numpy as np
import pytest

from ray_triton_shm._private.shm.bulk_copy import PART_MIN_BYTES, BulkCopier, default_copy_threads

MB = 1024 * 1024


def copy_threads_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("rtshm-copy")]


@pytest.fixture
def copier():
    copier = BulkCopier(threads=3)
    yield copier
    copier.close()
    assert not copy_threads_alive()


@pytest.mark.parametrize(
    "nbytes",
    [0, 4, PART_MIN_BYTES - 4, 2 * PART_MIN_BYTES, 2 * PART_MIN_BYTES + 4, 3 * PART_MIN_BYTES + 4096 + 12],
)
def test_copies_every_byte(copier: BulkCopier, nbytes: int) -> None:
    src = np.random.default_rng(nbytes).integers(0, 2**31, nbytes // 4, dtype=np.int32)
    dst = np.zeros_like(src)
    copier.copy(dst, src)
    assert np.array_equal(dst, src)


def test_a_large_copy_is_split_across_helper_threads(copier: BulkCopier) -> None:
    assert copier.parts(12 * MB) == 3
    assert copier.parts(PART_MIN_BYTES) == 1
    src = np.arange(3 * MB, dtype=np.float32).reshape(3, MB)
    dst = np.empty_like(src)
    copier.copy(dst, src)
    assert np.array_equal(dst, src)
    # Helpers ran the other two parts (a small copy never starts them). One helper may run
    # both: the pool reuses a thread that is idle again before the second part is handed over.
    assert 1 <= len(copy_threads_alive()) <= 2


def test_small_copies_start_no_threads() -> None:
    copier = BulkCopier(threads=4)
    src = np.ones(MB // 4, np.float32)
    dst = np.empty_like(src)
    copier.copy(dst, src)
    assert np.array_equal(dst, src)
    assert not copy_threads_alive()
    copier.close()


@pytest.mark.parametrize("dtype", [np.int8, np.float16, np.float64, np.complex128, np.bool_])
def test_every_dtype_and_shape_round_trips(copier: BulkCopier, dtype: type) -> None:
    count = (9 * MB) // np.dtype(dtype).itemsize + 3
    src = (np.arange(count) % 7).astype(dtype).reshape(-1, 1)
    dst = np.empty_like(src)
    copier.copy(dst, src)
    assert np.array_equal(dst, src)


def test_non_contiguous_source_is_copied_whole(copier: BulkCopier) -> None:
    base = np.arange(2 * 9 * MB // 4, dtype=np.float32).reshape(-1, 2)
    src = base[:, 1]  # a strided view
    dst = np.empty(src.shape, np.float32)
    copier.copy(dst, src)
    assert np.array_equal(dst, src)


def test_dtype_mismatch_raises_and_leaves_the_target_alone(copier: BulkCopier) -> None:
    src = np.ones(3 * MB, np.float64)
    dst = np.zeros(3 * MB, np.float32)
    with pytest.raises(TypeError):
        copier.copy(dst, src)
    assert not dst.any()


def test_shape_mismatch_raises(copier: BulkCopier) -> None:
    with pytest.raises(ValueError):
        copier.copy(np.zeros(3 * MB, np.float32), np.ones(3 * MB + 1, np.float32))


def test_many_callers_at_once_share_the_helpers(copier: BulkCopier) -> None:
    sources = [np.full(3 * MB, i, np.float32) for i in range(6)]
    targets = [np.empty_like(s) for s in sources]
    errors: list[BaseException] = []
    start = threading.Barrier(len(sources))

    def run(i: int) -> None:
        try:
            start.wait()
            for _ in range(5):
                copier.copy(targets[i], sources[i])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sources))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for src, dst in zip(sources, targets, strict=True):
        assert np.array_equal(dst, src)
    assert copier._helpers_lent == 0  # every helper was given back


def test_close_is_idempotent_and_later_copies_run_inline() -> None:
    copier = BulkCopier(threads=2)
    src = np.arange(3 * MB, dtype=np.float32)
    copier.copy(np.empty_like(src), src)
    assert copy_threads_alive()
    copier.close()
    copier.close()
    assert not copy_threads_alive()
    dst = np.empty_like(src)
    copier.copy(dst, src)
    assert np.array_equal(dst, src)
    assert not copy_threads_alive()


def test_one_thread_never_starts_helpers() -> None:
    copier = BulkCopier(threads=1)
    src = np.arange(8 * MB, dtype=np.float32)
    dst = np.empty_like(src)
    copier.copy(dst, src)
    assert np.array_equal(dst, src)
    assert not copy_threads_alive()
    copier.close()


def test_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="threads"):
        BulkCopier(threads=0)


def test_default_threads_are_between_one_and_four() -> None:
    assert 1 <= default_copy_threads() <= 4
