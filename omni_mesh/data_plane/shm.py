"""The shared-memory arena (DESIGN invariant 4: bytes move once per host, /dev/shm never leaks).

Segments are plain files under :data:`SHM_DIR` (``/dev/shm``), created ``O_EXCL`` with mode
0600, sized with ``ftruncate`` + ``posix_fallocate`` (a full tmpfs is an error at allocation,
not a SIGBUS at first write) and mapped with ``mmap``. They are named
``omni-{pid}-{token}-{seq}``: ``token`` is random per arena and ``seq`` is never reused, so a
reader's cached mapping can never alias a newer segment.

* :class:`ShmArena` — the writer side: power-of-two size classes, one slot per segment, freed
  segments pooled and reused (writing into a fresh segment page-faults at ~1/10 memcpy speed),
  every slot owned by a request id and freed with :meth:`ShmArena.free_owner`.
* :class:`ShmReader` — the reader side: maps segments read-only on first use, LRU-cached.
* :func:`unlink_prefix` / :func:`sweep_orphans` — janitors for crashed processes.
* :func:`externalize` / :func:`inline` — move a payload's tensors into / out of slots.

``multiprocessing.shared_memory`` is deliberately not used: its resource tracker unlinks
segments it does not own and warns at exit.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import re
import secrets
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

from omni_mesh.data_plane.messages import Payload, ShmRef, Tensor

log = logging.getLogger(__name__)

#: Directory holding the segments; tests may point it elsewhere (read at call time).
SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "omni-"
_NAME = re.compile(r"^omni-[A-Za-z0-9_.\-]{1,200}$")
_ORPHAN = re.compile(r"^omni-(?P<pid>\d+)-")
# A pid whose process started this long after a segment was last changed cannot own it.
_PID_REUSE_MARGIN_S = 2.0


class ShmError(RuntimeError):
    """A shared-memory operation failed."""


class ShmArenaFull(ShmError):
    """The arena's byte cap or the shared-memory filesystem is exhausted."""


class ShmRefError(ShmError, ValueError):
    """A :class:`ShmRef` names no readable slot (missing segment, bad name, out of bounds)."""


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


def _directory(directory: str | None) -> str:
    return directory if directory is not None else SHM_DIR


def _check_name(name: str, what: str) -> None:
    if not _NAME.fullmatch(name) or name.endswith("-"):
        raise ShmRefError(f"invalid shared-memory {what} {name!r} (expected 'omni-…')")


# ---- writer side -----------------------------------------------------------------------------


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
        _check_name(self._prefix, "prefix")
        self._dir = _directory(directory)
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
    _unmap(seg.mm, seg.view)


def _unmap(mm: mmap.mmap, view: memoryview) -> None:
    """Close a mapping; one still viewed by callers is left for the garbage collector."""
    view.release()
    try:
        mm.close()
    except BufferError:
        log.debug("shm mapping still viewed; it will be unmapped when the views are gone")


def _unlink_all(pid: int, directory: str, prefix: str, segments: dict[str, _Segment]) -> None:
    """Arena finalizer: runs on close(), garbage collection or interpreter exit."""
    if os.getpid() != pid:  # a forked child must not unlink its parent's segments
        return
    for seg in list(segments.values()):
        _destroy(directory, seg)
    segments.clear()


# ---- reader side -----------------------------------------------------------------------------


@dataclass
class _Mapping:
    mm: mmap.mmap
    view: memoryview = field(repr=False)
    size: int


class ShmReader:
    """Read-only views of slots named by :class:`ShmRef`; mappings are cached (LRU, at most
    ``max_mapped``). Thread-safe. Call :meth:`drop` / :meth:`prune` to let go of segments
    their owner has unlinked (a cached mapping keeps their memory alive)."""

    def __init__(self, max_mapped: int = 256, *, directory: str | None = None) -> None:
        if max_mapped < 1:
            raise ValueError("max_mapped must be >= 1")
        self.max_mapped = max_mapped
        self._dir = _directory(directory)
        self._maps: OrderedDict[str, _Mapping] = OrderedDict()
        self._lock = threading.Lock()

    def view(self, ref: ShmRef) -> memoryview:
        """A read-only view of the slot (zero-copy)."""
        _check_name(ref.segment, "segment")
        with self._lock:
            mapping = self._maps.get(ref.segment)
            if mapping is None:
                mapping = self._map(ref.segment)
            else:
                self._maps.move_to_end(ref.segment)
            if ref.offset < 0 or ref.nbytes < 0 or ref.offset + ref.nbytes > mapping.size:
                raise ShmRefError(
                    f"slot [{ref.offset}, {ref.offset}+{ref.nbytes}) is outside segment "
                    f"{ref.segment!r} of {mapping.size} bytes"
                )
            return mapping.view[ref.offset : ref.offset + ref.nbytes]

    def drop(self, segment: str) -> None:
        """Forget the mapping of ``segment`` (if cached)."""
        with self._lock:
            mapping = self._maps.pop(segment, None)
            if mapping is not None:
                _unmap(mapping.mm, mapping.view)

    def prune(self) -> int:
        """Drop mappings of segments that no longer exist; returns how many."""
        with self._lock:
            gone = [n for n in self._maps if not os.path.exists(os.path.join(self._dir, n))]
        for name in gone:
            self.drop(name)
        return len(gone)

    def close(self) -> None:
        with self._lock:
            for mapping in self._maps.values():
                _unmap(mapping.mm, mapping.view)
            self._maps.clear()

    def __len__(self) -> int:
        return len(self._maps)

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _map(self, name: str) -> _Mapping:
        path = os.path.join(self._dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ShmRefError(
                f"shared-memory segment {name!r} does not exist in {self._dir} "
                "(freed by its owner, or written on another host)"
            ) from None
        except OSError as exc:
            raise ShmRefError(f"cannot open shared-memory segment {name!r}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise ShmRefError(f"shared-memory segment {name!r} is empty")
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        mapping = _Mapping(mm=mm, view=memoryview(mm), size=size)
        self._maps[name] = mapping
        while len(self._maps) > self.max_mapped:
            _, old = self._maps.popitem(last=False)
            _unmap(old.mm, old.view)
        return mapping


# ---- janitors --------------------------------------------------------------------------------


def unlink_prefix(prefix: str, *, directory: str | None = None) -> int:
    """Unlink every segment named ``{prefix}-…`` (an arena's, or every arena of a pid with
    ``omni-{pid}``); returns how many. Used when an engine process died."""
    _check_name(prefix, "prefix")
    root = _directory(directory)
    count = 0
    for entry in os.scandir(root):
        if entry.name.startswith(prefix + "-") and _unlink(root, entry.name):
            count += 1
    if count:
        log.info("shm unlinked prefix=%s segments=%d", prefix, count)
    return count


def sweep_orphans(*, directory: str | None = None) -> int:
    """Unlink ``omni-{pid}-…`` segments whose creating process is gone (dead, a zombie, or
    its pid reused by a newer process); returns how many. Safe to run at any time."""
    root = _directory(directory)
    count = 0
    for entry in os.scandir(root):
        match = _ORPHAN.match(entry.name)
        if match is None or int(match["pid"]) == os.getpid():
            continue
        try:
            changed = entry.stat().st_ctime
        except FileNotFoundError:
            continue
        if not _owner_alive(int(match["pid"]), changed) and _unlink(root, entry.name):
            count += 1
    if count:
        log.warning("shm swept orphaned segments=%d dir=%s", count, root)
    return count


def _unlink(root: str, name: str) -> bool:
    try:
        os.unlink(os.path.join(root, name))
    except FileNotFoundError:
        return False
    return True


def _owner_alive(pid: int, changed: float) -> bool:
    """Whether process ``pid`` is alive and old enough to have created a file last changed at
    ``changed`` (epoch seconds)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith(b"btime"))
    except (OSError, IndexError, StopIteration, ValueError):
        return True  # no procfs details: trust kill(0)
    if fields[0] == b"Z":
        return False
    started = btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return started <= changed + _PID_REUSE_MARGIN_S


# ---- payloads --------------------------------------------------------------------------------


def externalize(
    payload: Payload, arena: ShmArena, owner: str, *, threshold: int = 64 << 10
) -> Payload:
    """A copy of ``payload`` whose inline tensors of ``threshold`` bytes or more live in slots
    of ``arena`` held for ``owner`` (one memcpy each). Smaller tensors stay inline."""
    tensors: dict[str, Tensor] = {}
    slots: list[ShmSlot] = []
    try:
        for name, t in payload.tensors.items():
            if t.data is None or t.data.nbytes < threshold:
                tensors[name] = t
                continue
            slot = arena.alloc(t.data.nbytes, owner)
            slots.append(slot)
            data = t.data if t.data.format == "B" and t.data.ndim == 1 else t.data.cast("B")
            slot.view[:] = data
            tensors[name] = Tensor(dtype=t.dtype, shape=t.shape, shm=slot.ref)
    except BaseException:
        for slot in slots:
            arena.free(slot)
        raise
    return Payload(fields=payload.fields, tensors=tensors)


def inline(payload: Payload, reader: ShmReader) -> Payload:
    """A copy of ``payload`` whose shared-memory tensors are zero-copy views of their mapped
    slots; the encoder then copies them once into the outgoing message."""
    if all(t.shm is None for t in payload.tensors.values()):
        return payload
    tensors = {
        name: t if t.shm is None else Tensor(dtype=t.dtype, shape=t.shape, data=reader.view(t.shm))
        for name, t in payload.tensors.items()
    }
    return Payload(fields=payload.fields, tensors=tensors)
