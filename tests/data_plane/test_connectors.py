"""Both connectors run the same cases (one interface, interchangeable implementations)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from omni_mesh.data_plane.codec import decode, encode
from omni_mesh.data_plane.connectors import (
    CONNECTORS,
    Connector,
    ConnectorError,
    HttpConnector,
    SharedMemoryConnector,
    make_connector,
)
from omni_mesh.data_plane.messages import Payload
from omni_mesh.data_plane.shm import ShmArena, ShmReader, externalize
from omni_mesh.data_plane.tensors import arrays_from_payload, payload_from_arrays

pytestmark = pytest.mark.unit

ARRAYS: dict[str, np.ndarray] = {
    "hidden": np.random.default_rng(1).standard_normal((64, 512), dtype=np.float32),
    "ids": np.arange(16, dtype=np.int64),  # small: stays inline
}
# connector → same_host → whether shared-memory refs survive prepare()
KEEPS_REFS = {
    "SharedMemoryConnector": {True: True, False: False},
    "HttpConnector": {True: False, False: False},
}


@pytest.fixture(params=sorted(CONNECTORS))
def connector(request: pytest.FixtureRequest) -> Connector:
    return make_connector(request.param, {})


@pytest.fixture
def shm_payload() -> Iterator[tuple[Payload, ShmReader]]:
    with ShmArena() as arena, ShmReader() as reader:
        payload = externalize(payload_from_arrays({"n": 2}, ARRAYS), arena, "req-1")
        assert payload.tensors["hidden"].shm is not None
        assert payload.tensors["ids"].data is not None
        yield payload, reader


@pytest.mark.parametrize("same_host", [True, False], ids=["same-host", "cross-host"])
def test_prepare(
    connector: Connector, same_host: bool, shm_payload: tuple[Payload, ShmReader]
) -> None:
    payload, reader = shm_payload
    out = connector.prepare(payload, same_host=same_host, reader=reader)
    keeps = KEEPS_REFS[connector.name][same_host]
    assert (out.tensors["hidden"].shm is not None) is keeps
    assert (out.tensors["hidden"].data is None) is keeps
    assert out.fields == {"n": 2}
    # What the receiver decodes equals what the sender wrote, whichever way it travelled.
    wire = decode(encode(out), Payload)
    got = arrays_from_payload(wire, reader)
    for name, a in ARRAYS.items():
        np.testing.assert_array_equal(got[name], a)
    if not keeps:  # inlined: the hop carries the bytes once, no handle
        assert len(encode(out)) > ARRAYS["hidden"].nbytes


def test_prepare_leaves_inline_payloads_alone(connector: Connector) -> None:
    payload = payload_from_arrays(arrays=ARRAYS)
    with ShmReader() as reader:
        for same_host in (True, False):
            assert connector.prepare(payload, same_host=same_host, reader=reader) is payload


def test_routing_hint() -> None:
    assert SharedMemoryConnector.prefers_same_host
    assert not HttpConnector.prefers_same_host


def test_make_connector_takes_no_options() -> None:
    c = make_connector("SharedMemoryConnector", {})
    assert isinstance(c, SharedMemoryConnector) and repr(c) == "SharedMemoryConnector()"
    assert isinstance(make_connector("HttpConnector"), HttpConnector)


@pytest.mark.parametrize(
    ("name", "extra", "match"),
    [
        ("MooncakeConnector", {}, "unknown connector 'MooncakeConnector' .*HttpConnector"),
        ("HttpConnector", {"chunk": 1}, "HttpConnector: unknown option 'chunk'"),
        ("SharedMemoryConnector", {"timeout_s": 30}, "unknown option 'timeout_s'.*takes no"),
    ],
)
def test_bad_specs_name_what_is_wrong(name: str, extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConnectorError, match=match):
        make_connector(name, extra)
