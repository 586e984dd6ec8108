"""How a hop's tensors travel: one interface, interchangeable implementations.

A deploy config names connectors by class (``connectors: {shm: {name: SharedMemoryConnector}}``)
and assigns them to edges; :func:`make_connector` builds one (a pod builds one per edge at
start, so a bad spec fails start-up). Before a hop is sent, :meth:`Connector.prepare` turns the
sender's payload into what goes on the wire:

* :class:`SharedMemoryConnector` — same host: the hop carries only shared-memory handles
  (bytes are not copied at all); other host: tensors are inlined and streamed once over HTTP.
* :class:`HttpConnector` — tensors are always inlined (bytes streamed once over HTTP).

Inlining is zero-copy (views of the mapped slots); the encoder makes the one copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from omni_mesh.data_plane.messages import Payload
from omni_mesh.data_plane.shm import ShmReader, inline

if TYPE_CHECKING:  # annotations only: building connectors needs no pydantic import
    from omni_mesh.configs.deploy import DeployConfig
    from omni_mesh.configs.pipeline_spec import PipelineSpec


class ConnectorError(ValueError):
    """A connector spec is invalid (unknown class, unknown or ill-typed option)."""


class Connector(ABC):
    """Decides how one edge's tensors travel. The built-in connectors take no options."""

    name: ClassVar[str]
    #: Whether routing should prefer a receiver on the sender's host for this edge.
    prefers_same_host: ClassVar[bool] = False

    @abstractmethod
    def prepare(self, payload: Payload, *, same_host: bool, reader: ShmReader) -> Payload:
        """The payload as it must be sent to a receiver (on this host when ``same_host``)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


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


def make_connector(spec_name: str, extra: Mapping[str, object] | None = None) -> Connector:
    """The connector registered as ``spec_name``; its spec's ``extra`` must be empty (the
    built-in connectors take no options)."""
    cls = CONNECTORS.get(spec_name)
    if cls is None:
        raise ConnectorError(
            f"unknown connector {spec_name!r} (known: {', '.join(sorted(CONNECTORS))})"
        )
    if extra:
        raise ConnectorError(
            f"{spec_name}: unknown option {sorted(extra)[0]!r} in extra "
            "(this connector takes no options)"
        )
    return cls()


class EdgeConnectors:
    """One connector per edge of the pipeline, built once at pod start: a bad connector spec
    fails start-up (:class:`ConnectorError` / ``DeployConfigError``: exit 2), not a hop. A
    client's request (``from_stage < 0``) carries no tensors: plain HTTP."""

    def __init__(self, deploy: DeployConfig, pipeline: PipelineSpec) -> None:
        self._client = make_connector("HttpConnector")
        self._edges: dict[tuple[int, int], Connector] = {}
        for stage in pipeline.stages:
            for source in stage.sources:
                spec = deploy.connector_for_edge(source, stage.stage_id)
                try:
                    connector = make_connector(spec.name, spec.extra)
                except ConnectorError as exc:
                    raise ConnectorError(
                        f"connectors: edge {source}->{stage.stage_id}: {exc}"
                    ) from None
                self._edges[(source, stage.stage_id)] = connector

    def __call__(self, from_stage: int, to_stage: int) -> Connector:
        if from_stage < 0:
            return self._client
        return self._edges[(from_stage, to_stage)]
