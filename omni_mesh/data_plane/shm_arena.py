"""The writer side of the shared-memory arena: :class:`ShmArena` hands out slots owned by
request ids (see :mod:`omni_mesh.data_plane.shm`).

Power-of-two size classes, one slot per segment; freed segments are pooled and reused (writing
into a fresh segment page-faults at ~1/10 memcpy speed) and every slot is freed with
:meth:`ShmArena.free_owner`. Segments are created ``O_EXCL`` with mode 0600 and sized with
``ftruncate`` + ``posix_fallocate`` (a full tmpfs is an error at allocation, not a SIGBUS at
first write).
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import secrets
import threading
import weakref
from dataclasses import dataclass

from omni_mesh.data_plane.messages import ShmRef
from omni_mesh.data_plane.shm_common import (
    SEGMENT_PREFIX,
    ShmArenaFull,
    ShmError,
    check_name,
    log,
    resolve_directory,
    unmap,
)


@dataclass(frozen=True)
class ShmSlot:
    """A writable slot: ``view`` is exactly ``ref.nbytes`` long."""

    ref: ShmRef
    view: memoryview
    owner: str


@dataclass(frozen=True)
class ArenaStats:
    segments: int  # segments that exist (in use + pooled)
    slots_in_use: int
    bytes_in_use: int  # segment capacity held by live slots
    bytes_pooled: int  # segment capacity kept for reuse
    allocs: int
    reuses: int  # allocs served by a pooled segment


@dataclass
class _Segment:
    name: str
    size: int
    mm: mmap.mmap
    view: memoryview
    owner: str = ""


class ShmArena:
    """Pooled shared-memory slots owned by request ids. Thread-safe.

    ``max_pooled_bytes`` bounds the free segments kept for reuse (beyond it a freed segment is
    unlinked); ``max_total_bytes`` (optional) bounds everything the arena holds, and an
    allocation beyond it raises :class:`ShmArenaFull`."""

    def __init__(
        self,
        prefix: str | None = None,
        *,
        max_pooled_bytes: int = 512 << 20,
        min_segment: int = 1 << 20,
        max_total_bytes: int | None = None,
        directory: str | None = None,
    ) -> None:
        if min_segment < 1 or max_pooled_bytes < 0:
            raise ValueError("min_segment must be >= 1 and max_pooled_bytes >= 0")
        self._prefix = prefix or f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        check_name(self._prefix, "prefix")
        self._dir = resolve_directory(directory)
        self.max_pooled_bytes = max_pooled_bytes
        self.max_total_bytes = max_total_bytes
        self.min_segment = 1 << max(min_segment - 1, mmap.PAGESIZE - 1).bit_length()
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._segments: dict[str, _Segment] = {}  # every live segment
        self._pool: dict[int, list[_Segment]] = {}  # size class → free segments
        self._owners: dict[str, set[str]] = {}  # owner → names of its segments
        self._pooled_bytes = 0
        self._used_bytes = 0  # includes capacity reserved for segments being created
        self._allocs = 0
        self._reuses = 0
        self._closed = False
        self._finalizer = weakref.finalize(
            self, _unlink_all, os.getpid(), self._dir, self._prefix, self._segments
        )

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def directory(self) -> str:
        return self._dir

    def size_class(self, nbytes: int) -> int:
        """Capacity of the segment that holds ``nbytes``: a power of two >= ``min_segment``."""
        return max(self.min_segment, 1 << max(nbytes - 1, 0).bit_length())

    def alloc(self, nbytes: int, owner: str) -> ShmSlot:
        """A writable slot of ``nbytes`` held for ``owner`` (a request id)."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        if not owner:
            raise ValueError("a slot needs a non-empty owner (the request id)")
        size = self.size_class(nbytes)
        with self._lock:
            self._check_open()
            seg = self._take_pooled(size)
            if seg is None:
                self._reserve(size)
        if seg is None:
            seg = self._create(size)
        with self._lock:
            if self._closed:  # closed while we were creating the segment
                _destroy(self._dir, seg)
                raise ShmError(f"arena {self._prefix} is closed")
            seg.owner = owner
            self._segments[seg.name] = seg
            self._owners.setdefault(owner, set()).add(seg.name)
            self._allocs += 1
        ref = ShmRef(segment=seg.name, offset=0, nbytes=nbytes)
        return ShmSlot(ref=ref, view=seg.view[:nbytes], owner=owner)

    def free(self, slot: ShmSlot) -> bool:
        """Free one slot; False if it is no longer allocated to ``slot.owner`` (already freed,
        or its segment since reused by another request)."""
        name = slot.ref.segment
        with self._lock:
            seg = self._segments.get(name)
            if seg is None or seg.owner != slot.owner:
                return False
            names = self._owners[seg.owner]
            names.discard(name)
            if not names:
                del self._owners[seg.owner]
            self._release(seg)
            return True

    def free_owner(self, owner: str) -> int:
        """Free every slot held for ``owner``; returns how many."""
        with self._lock:
            names = self._owners.pop(owner, set())
            for name in names:
                self._release(self._segments[name])
        if names:
            log.debug("shm freed owner=%s slots=%d arena=%s", owner, len(names), self._prefix)
        return len(names)

    def owns(self, ref: ShmRef) -> bool:
        """Whether ``ref`` names a slot this arena currently has allocated."""
        with self._lock:
            seg = self._segments.get(ref.segment)
            return seg is not None and bool(seg.owner)

    def stats(self) -> ArenaStats:
        with self._lock:
            in_use = [s for s in self._segments.values() if s.owner]
            return ArenaStats(
                segments=len(self._segments),
                slots_in_use=len(in_use),
                bytes_in_use=sum(s.size for s in in_use),
                bytes_pooled=self._pooled_bytes,
                allocs=self._allocs,
                reuses=self._reuses,
            )

    def close(self) -> None:
        """Unlink every segment (in use or pooled). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            log.debug("shm arena closed prefix=%s segments=%d", self._prefix, len(self._segments))
            self._pool.clear()
            self._owners.clear()
            self._pooled_bytes = self._used_bytes = 0
            self._finalizer()

    def __enter__(self) -> ShmArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals (called with the lock held unless noted) ----------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ShmError(f"arena {self._prefix} is closed")

    def _take_pooled(self, size: int) -> _Segment | None:
        free = self._pool.get(size)
        if not free:
            return None
        seg = free.pop()
        self._pooled_bytes -= size
        self._used_bytes += size
        self._reuses += 1
        return seg

    def _reserve(self, size: int) -> None:
        cap = self.max_total_bytes
        if cap is not None and self._used_bytes + self._pooled_bytes + size > cap:
            self._evict_pooled(self._used_bytes + self._pooled_bytes + size - cap)
            if self._used_bytes + size > cap:
                raise ShmArenaFull(
                    f"arena {self._prefix}: allocating {size} bytes would exceed "
                    f"max_total_bytes={cap} ({self._used_bytes} in use)"
                )
        self._used_bytes += size

    def _evict_pooled(self, nbytes: int) -> None:
        """Unlink pooled segments, largest first, until ``nbytes`` are released."""
        for size in sorted(self._pool, reverse=True):
            free = self._pool[size]
            while free and nbytes > 0:
                seg = free.pop()
                self._pooled_bytes -= size
                nbytes -= size
                del self._segments[seg.name]
                _destroy(self._dir, seg)

    def _release(self, seg: _Segment) -> None:
        seg.owner = ""
        self._used_bytes -= seg.size
        if self._pooled_bytes + seg.size > self.max_pooled_bytes:
            del self._segments[seg.name]
            _destroy(self._dir, seg)
            return
        self._pool.setdefault(seg.size, []).append(seg)
        self._pooled_bytes += seg.size

    def _create(self, size: int) -> _Segment:
        """Create and map a new segment (without the lock); on ENOSPC, evict and retry."""
        for attempt in (0, 1):
            name = f"{self._prefix}-{next(self._seq)}"
            try:
                return _create_segment(self._dir, name, size)
            except OSError as exc:
                if exc.errno == errno.ENOSPC and attempt == 0:
                    with self._lock:
                        self._evict_pooled(self._pooled_bytes)
                    continue
                with self._lock:
                    self._used_bytes -= size
                if exc.errno == errno.ENOSPC:
                    raise ShmArenaFull(
                        f"{self._dir} is full: cannot create a {size}-byte segment"
                    ) from exc
                raise ShmError(f"cannot create segment {name} in {self._dir}: {exc}") from exc
        raise AssertionError("unreachable")


def _create_segment(directory: str, name: str, size: int) -> _Segment:
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    log.debug("shm segment created name=%s size=%d", name, size)
    return _Segment(name=name, size=size, mm=mm, view=memoryview(mm))


def _destroy(directory: str, seg: _Segment) -> None:
    try:
        os.unlink(os.path.join(directory, seg.name))
    except FileNotFoundError:
        log.warning("shm segment %s was already unlinked", seg.name)
    unmap(seg.mm, seg.view)


def _unlink_all(pid: int, directory: str, prefix: str, segments: dict[str, _Segment]) -> None:
    """Arena finalizer: runs on close(), garbage collection or interpreter exit."""
    if os.getpid() != pid:  # a forked child must not unlink its parent's segments
        return
    for seg in list(segments.values()):
        _destroy(directory, seg)
    segments.clear()
