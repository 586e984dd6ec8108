"""How a hop's tensors travel: one interface, interchangeable implementations.

A deploy config names connectors by class (``connectors: {shm: {name: SharedMemoryConnector,
extra: {...}}}``) and assigns them to edges; :func:`make_connector` builds one. Before a hop is
sent, :meth:`Connector.prepare` turns the sender's payload into what goes on the wire:

* :class:`SharedMemoryConnector` — same host: the hop carries only shared-memory handles
  (bytes are not copied at all); other host: tensors are inlined and streamed once over HTTP.
* :class:`HttpConnector` — tensors are always inlined (bytes streamed once over HTTP).

Inlining is zero-copy (views of the mapped slots); the encoder makes the one copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from omni_mesh.data_plane.messages import Payload
from omni_mesh.data_plane.shm import ShmReader, inline

DEFAULT_SHM_THRESHOLD = 64 << 10


class ConnectorError(ValueError):
    """A connector spec is invalid (unknown class, unknown or ill-typed option)."""


class Connector(ABC):
    """Decides how one edge's tensors travel.

    ``threshold_bytes``: inline tensors at least this large go into shared memory on the
    receiving host (see ``shm.externalize``); smaller ones stay in the message."""

    name: ClassVar[str]
    #: Whether routing should prefer a receiver on the sender's host for this edge.
    prefers_same_host: ClassVar[bool] = False

    def __init__(self, *, shm_threshold_bytes: int = DEFAULT_SHM_THRESHOLD) -> None:
        if shm_threshold_bytes < 0:
            raise ConnectorError(f"{self.name}: shm_threshold_bytes must be >= 0")
        self.threshold_bytes = shm_threshold_bytes

    @abstractmethod
    def prepare(self, payload: Payload, *, same_host: bool, reader: ShmReader) -> Payload:
        """The payload as it must be sent to a receiver (on this host when ``same_host``)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shm_threshold_bytes={self.threshold_bytes})"


class SharedMemoryConnector(Connector):
    """Handles on the same host, bytes once over HTTP across hosts."""

    name = "SharedMemoryConnector"
    prefers_same_host = True

    def prepare(self, payload: Payload, *, same_host: bool, reader: ShmReader) -> Payload:
        return payload if same_host else inline(payload, reader)


class HttpConnector(Connector):
    """Bytes once over HTTP, whatever the receiver's host."""

    name = "HttpConnector"

    def prepare(self, payload: Payload, *, same_host: bool, reader: ShmReader) -> Payload:
        return inline(payload, reader)


CONNECTORS: dict[str, type[Connector]] = {
    cls.name: cls for cls in (SharedMemoryConnector, HttpConnector)
}
_OPTIONS = {"shm_threshold_bytes": int}


def make_connector(spec_name: str, extra: Mapping[str, object] | None = None) -> Connector:
    """The connector registered as ``spec_name`` configured with the spec's ``extra``."""
    cls = CONNECTORS.get(spec_name)
    if cls is None:
        raise ConnectorError(
            f"unknown connector {spec_name!r} (known: {', '.join(sorted(CONNECTORS))})"
        )
    options: dict[str, int] = {}
    for key, value in (extra or {}).items():
        kind = _OPTIONS.get(key)
        if kind is None:
            raise ConnectorError(
                f"{spec_name}: unknown option {key!r} in extra "
                f"(known: {', '.join(sorted(_OPTIONS))})"
            )
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ConnectorError(
                f"{spec_name}: option {key!r} must be {kind.__name__}, got {value!r}"
            )
        options[key] = value
    return cls(**options)
