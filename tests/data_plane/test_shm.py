from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

import numpy as np
import pytest

from omni_mesh.data_plane import shm
from omni_mesh.data_plane.messages import Payload, ShmRef
from omni_mesh.data_plane.shm import (
    ShmArena,
    ShmArenaFull,
    ShmError,
    ShmReader,
    ShmRefError,
    externalize,
    inline,
    sweep_orphans,
    unlink_prefix,
)
from omni_mesh.data_plane.tensors import array_from_tensor, payload_from_arrays

pytestmark = pytest.mark.unit

MiB = 1 << 20


def segments(directory: str, prefix: str) -> set[str]:
    return {n for n in os.listdir(directory) if n.startswith(prefix + "-")}


# ---- arena -----------------------------------------------------------------------------------


def test_alloc_names_sizes_and_permissions() -> None:
    with ShmArena() as arena:
        assert arena.prefix.startswith(f"omni-{os.getpid()}-")
        slot = arena.alloc(1000, "req-1")
        assert slot.ref == ShmRef(segment=f"{arena.prefix}-0", offset=0, nbytes=1000)
        assert len(slot.view) == 1000 and not slot.view.readonly
        path = Path(shm.SHM_DIR, slot.ref.segment)
        st = path.stat()
        assert st.st_size == MiB  # min_segment
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert arena.alloc(3 * MiB, "req-1").ref.segment == f"{arena.prefix}-1"
        assert Path(shm.SHM_DIR, f"{arena.prefix}-1").stat().st_size == 4 * MiB


def test_size_classes() -> None:
    with ShmArena(min_segment=4096) as arena:
        assert [arena.size_class(n) for n in (0, 1, 4096, 4097, 10_000)] == [
            4096,
            4096,
            4096,
            8192,
            16384,
        ]
    with ShmArena(min_segment=3000) as arena:
        assert arena.min_segment == 4096


def test_freed_segment_is_reused() -> None:
    with ShmArena() as arena:
        first = arena.alloc(100_000, "req-1")
        assert arena.free(first)
        assert not arena.free(first)  # already free
        second = arena.alloc(200_000, "req-2")  # same size class
        assert second.ref.segment == first.ref.segment
        assert not arena.free(first)  # a stale slot cannot free the new owner's
        assert arena.owns(second.ref)
        stats = arena.stats()
        assert (stats.allocs, stats.reuses, stats.segments) == (2, 1, 1)


def test_free_owner_frees_every_slot_of_a_request() -> None:
    with ShmArena() as arena:
        for _ in range(3):
            arena.alloc(10, "req-1")
        other = arena.alloc(10, "req-2")
        assert arena.stats().slots_in_use == 4
        assert arena.free_owner("req-1") == 3
        assert arena.free_owner("req-1") == 0
        stats = arena.stats()
        assert (stats.slots_in_use, stats.bytes_in_use, stats.bytes_pooled) == (1, MiB, 3 * MiB)
        assert arena.owns(other.ref)
        assert arena.free(other)
        assert not arena.owns(other.ref)


def test_pool_cap_unlinks_surplus_segments() -> None:
    with ShmArena(max_pooled_bytes=2 * MiB) as arena:
        slots = [arena.alloc(10, f"req-{i}") for i in range(3)]
        for slot in slots:
            arena.free(slot)
        stats = arena.stats()
        assert stats.bytes_pooled == 2 * MiB and stats.segments == 2
        assert segments(shm.SHM_DIR, arena.prefix) == {s.ref.segment for s in slots[:2]}


def test_total_cap_evicts_pooled_segments_then_refuses() -> None:
    with ShmArena(max_total_bytes=4 * MiB) as arena:
        small = arena.alloc(10, "a")
        arena.free(small)  # 1 MiB pooled
        big = arena.alloc(3 * MiB, "b")  # 4 MiB class: evicts the pooled one
        assert not Path(shm.SHM_DIR, small.ref.segment).exists()
        with pytest.raises(ShmArenaFull, match="max_total_bytes"):
            arena.alloc(10, "c")
        arena.free(big)
        arena.alloc(10, "c")


def test_close_unlinks_everything_and_refuses_new_slots() -> None:
    arena = ShmArena()
    arena.alloc(10, "a")
    arena.free(arena.alloc(2 * MiB, "b"))
    assert len(segments(shm.SHM_DIR, arena.prefix)) == 2
    arena.close()
    arena.close()  # idempotent
    assert segments(shm.SHM_DIR, arena.prefix) == set()
    with pytest.raises(ShmError, match="closed"):
        arena.alloc(1, "a")
    assert arena.free_owner("a") == 0


def test_garbage_collected_arena_unlinks_its_segments() -> None:
    arena = ShmArena()
    prefix = arena.prefix
    arena.alloc(10, "a")
    del arena
    assert segments(shm.SHM_DIR, prefix) == set()


def test_slot_views_survive_close() -> None:
    arena = ShmArena()
    view = arena.alloc(8, "a").view
    view[:] = b"abcdefgh"
    arena.close()
    assert bytes(view) == b"abcdefgh"  # mapping kept alive by the view; the file is gone
    view.release()


@pytest.mark.parametrize("prefix", ["x", "omni-", "omni-a/b", "../etc", "omni-x-"])
def test_invalid_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(ShmRefError, match="invalid shared-memory prefix"):
        ShmArena(prefix)


def test_bad_alloc_arguments() -> None:
    with ShmArena() as arena:
        with pytest.raises(ValueError):
            arena.alloc(-1, "a")
        with pytest.raises(ValueError, match="owner"):
            arena.alloc(1, "")


def test_custom_directory(shm_dir: str) -> None:
    with ShmArena(directory=shm_dir) as arena, ShmReader(directory=shm_dir) as reader:
        slot = arena.alloc(4, "a")
        slot.view[:] = b"wxyz"
        assert os.listdir(shm_dir) == [slot.ref.segment]
        assert bytes(reader.view(slot.ref)) == b"wxyz"


def test_arena_is_thread_safe() -> None:
    errors: list[BaseException] = []
    with ShmArena(min_segment=4096, max_pooled_bytes=64 << 10) as arena:

        def work(i: int) -> None:
            try:
                for j in range(50):
                    slot = arena.alloc(100 * (j % 5), f"req-{i}-{j % 3}")
                    slot.view[:] = bytes([i]) * len(slot.view)
                    assert bytes(slot.view) == bytes([i]) * len(slot.view)
                    if j % 3 == 2:
                        arena.free_owner(f"req-{i}-{j % 3}")
            except BaseException as exc:  # surfaced by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for i in range(4):
            for k in range(3):
                arena.free_owner(f"req-{i}-{k}")
        stats = arena.stats()
        assert stats.slots_in_use == 0 and stats.bytes_in_use == 0
        assert stats.bytes_pooled <= 64 << 10


# ---- reader ----------------------------------------------------------------------------------


def test_reader_views_are_read_only_and_cached() -> None:
    with ShmArena() as arena, ShmReader(max_mapped=2) as reader:
        slots = [arena.alloc(16, "a") for _ in range(3)]
        for i, slot in enumerate(slots):
            slot.view[:] = bytes([i]) * 16
        view = reader.view(slots[0].ref)
        assert view.readonly and bytes(view) == bytes(16)
        with pytest.raises(TypeError):
            view[0] = 1
        reader.view(slots[1].ref)
        reader.view(slots[2].ref)
        assert len(reader) == 2  # LRU: the first mapping was closed (its view stays valid)
        assert bytes(view) == bytes(16)
        slots[0].view[:] = b"\x07" * 16  # same segment, shared pages
        assert bytes(view) == b"\x07" * 16
        view.release()


def test_reader_sees_later_writes_to_a_reused_segment() -> None:
    with ShmArena() as arena, ShmReader() as reader:
        slot = arena.alloc(4, "a")
        slot.view[:] = b"1111"
        assert bytes(reader.view(slot.ref)) == b"1111"
        arena.free(slot)
        again = arena.alloc(4, "b")
        again.view[:] = b"2222"
        assert bytes(reader.view(again.ref)) == b"2222"


def test_missing_segment_is_named() -> None:
    with ShmReader() as reader:
        ref = ShmRef(segment="omni-999999-dead-0", offset=0, nbytes=1)
        with pytest.raises(ShmRefError, match="'omni-999999-dead-0' does not exist"):
            reader.view(ref)


@pytest.mark.parametrize(
    ("offset", "nbytes"), [(0, MiB + 1), (MiB, 1), (-1, 1), (0, -1), (2**62, 2**62)]
)
def test_out_of_bounds_slots_are_refused(offset: int, nbytes: int) -> None:
    with ShmArena() as arena, ShmReader() as reader:
        slot = arena.alloc(10, "a")
        ref = ShmRef(segment=slot.ref.segment, offset=offset, nbytes=nbytes)
        with pytest.raises(ShmRefError, match="outside segment"):
            reader.view(ref)


@pytest.mark.parametrize("name", ["../../etc/passwd", "passwd", "omni-../x", "omni-", ""])
def test_segment_names_are_validated(name: str) -> None:
    with ShmReader() as reader, pytest.raises(ShmRefError, match="invalid shared-memory"):
        reader.view(ShmRef(segment=name, offset=0, nbytes=0))


def test_prune_and_drop_forget_unlinked_segments() -> None:
    with ShmArena(max_pooled_bytes=0) as arena, ShmReader() as reader:
        a, b = arena.alloc(1, "a"), arena.alloc(1, "b")
        reader.view(a.ref).release()
        reader.view(b.ref).release()
        assert len(reader) == 2
        arena.free(a)  # pool cap 0: unlinked at once
        assert reader.prune() == 1 and len(reader) == 1
        reader.drop(b.ref.segment)
        reader.drop(b.ref.segment)
        assert len(reader) == 0


# ---- janitors --------------------------------------------------------------------------------


def test_unlink_prefix_removes_only_that_prefix(shm_dir: str) -> None:
    mine = ShmArena(directory=shm_dir)
    other = ShmArena(f"{mine.prefix}0", directory=shm_dir)  # shares the leading characters
    try:
        mine.alloc(1, "a")
        mine.free(mine.alloc(1, "b"))
        other.alloc(1, "c")
        assert unlink_prefix(mine.prefix, directory=shm_dir) == 2
        assert os.listdir(shm_dir) == [f"{other.prefix}-0"]
    finally:
        mine.close()
        other.close()


def test_unlink_prefix_refuses_a_prefix_that_would_match_everything() -> None:
    with pytest.raises(ShmRefError):
        unlink_prefix("omni-")
    with pytest.raises(ShmRefError):
        unlink_prefix("")


def test_sweep_keeps_live_processes_segments(shm_dir: str) -> None:
    with ShmArena(directory=shm_dir) as arena:
        arena.alloc(1, "a")
        parent = Path(shm_dir, f"omni-{os.getppid()}-feed-0")  # pytest's parent: alive
        parent.write_bytes(b"x")
        foreign = Path(shm_dir, "omni-notapid-0")
        foreign.write_bytes(b"x")
        try:
            assert sweep_orphans(directory=shm_dir) == 0
            assert len(os.listdir(shm_dir)) == 3
        finally:
            parent.unlink()
            foreign.unlink()


# ---- payloads --------------------------------------------------------------------------------


def test_externalize_and_inline_round_trip() -> None:
    big = np.arange(100_000, dtype=np.float32)
    small = np.arange(10, dtype=np.int32)
    payload = payload_from_arrays({"n": 1}, {"big": big, "small": small})
    with ShmArena() as arena, ShmReader() as reader:
        out = externalize(payload, arena, "req-1", threshold=64 << 10)
        assert out.fields == {"n": 1}
        assert out.tensors["big"].shm is not None and out.tensors["big"].data is None
        assert out.tensors["small"] is payload.tensors["small"]
        assert arena.stats().slots_in_use == 1
        np.testing.assert_array_equal(array_from_tensor(out.tensors["big"], reader), big)

        back = inline(out, reader)
        data = back.tensors["big"].data
        assert data is not None and back.tensors["big"].shm is None
        inlined = array_from_tensor(back.tensors["big"])
        np.testing.assert_array_equal(inlined, big)
        assert np.shares_memory(inlined, array_from_tensor(out.tensors["big"], reader))
        assert not np.shares_memory(inlined, big)  # the one copy: into the slot
        assert inline(payload, reader) is payload  # nothing to do
        del data, back, inlined
        assert arena.free_owner("req-1") == 1


def test_externalize_accepts_typed_memoryviews() -> None:
    a = np.arange(20_000, dtype=np.float64)
    payload = payload_from_arrays(arrays={"a": a})
    payload.tensors["a"].data = a.data  # format 'd', not bytes
    with ShmArena() as arena, ShmReader() as reader:
        out = externalize(payload, arena, "r", threshold=0)
        np.testing.assert_array_equal(array_from_tensor(out.tensors["a"], reader), a)


def test_externalize_frees_its_slots_when_it_fails() -> None:
    payload = payload_from_arrays(
        arrays={"a": np.zeros(MiB, np.uint8), "b": np.zeros(2 * MiB, np.uint8)}
    )
    with ShmArena(max_total_bytes=MiB) as arena:
        with pytest.raises(ShmArenaFull):
            externalize(payload, arena, "req-1", threshold=0)
        assert arena.stats().slots_in_use == 0


def test_empty_payload() -> None:
    with ShmArena() as arena, ShmReader() as reader:
        assert externalize(Payload(), arena, "r").tensors == {}
        assert inline(Payload(), reader).tensors == {}


# ---- a full /dev/shm -------------------------------------------------------------------------


def _fallocate_failing(times: int) -> tuple[list[int], object]:
    calls: list[int] = []
    real = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        if len(calls) <= times:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    return calls, fallocate


def test_a_full_filesystem_is_an_error_at_alloc_not_a_sigbus(
    monkeypatch: pytest.MonkeyPatch, shm_dir: str
) -> None:
    calls, fallocate = _fallocate_failing(times=2)
    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with ShmArena(directory=shm_dir) as arena:
        with pytest.raises(ShmArenaFull, match="is full: cannot create a 1048576-byte segment"):
            arena.alloc(10, "a")
        assert len(calls) == 2  # retried once after evicting the pool
        assert os.listdir(shm_dir) == []
        assert arena.stats().bytes_in_use == 0
        arena.alloc(10, "a")  # space again


def test_a_full_filesystem_evicts_pooled_segments_and_retries(
    monkeypatch: pytest.MonkeyPatch, shm_dir: str
) -> None:
    with ShmArena(directory=shm_dir) as arena:
        pooled = arena.alloc(10, "a")
        arena.free(pooled)
        calls, fallocate = _fallocate_failing(times=1)
        monkeypatch.setattr(os, "posix_fallocate", fallocate)
        slot = arena.alloc(3 * MiB, "b")
        assert len(calls) == 2
        assert os.listdir(shm_dir) == [slot.ref.segment]  # the pooled segment made room
        assert arena.stats().bytes_pooled == 0
