"""The reader side of the shared-memory arena: :class:`ShmReader` maps segments read-only on
first use and caches the mappings (see :mod:`omni_mesh.data_plane.shm`)."""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from omni_mesh.data_plane.messages import ShmRef
from omni_mesh.data_plane.shm_common import ShmRefError, check_name, resolve_directory, unmap


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
        self._dir = resolve_directory(directory)
        self._maps: OrderedDict[str, _Mapping] = OrderedDict()
        self._lock = threading.Lock()

    def view(self, ref: ShmRef) -> memoryview:
        """A read-only view of the slot (zero-copy)."""
        check_name(ref.segment, "segment")
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
                unmap(mapping.mm, mapping.view)

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
                unmap(mapping.mm, mapping.view)
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
            unmap(old.mm, old.view)
        return mapping
