"""join_input: one input per source, one request, whole inputs; the same join input whatever
order the sources' inputs come in."""

from __future__ import annotations

import msgspec
import pytest

from omni_mesh.configs.registry import get_pipeline
from omni_mesh.data_plane.codec import encode
from omni_mesh.data_plane.joins import JoinInputError, join_input, split_join
from omni_mesh.data_plane.messages import Payload, StageInput, Tensor

pytestmark = pytest.mark.unit

SPEC = get_pipeline("synthetic-diamond")


def _input(source: int, rid: str = "r1", **kw: object) -> StageInput:
    tensor = Tensor(dtype="uint8", shape=(2,), data=memoryview(bytes([source, source])))
    si = StageInput(
        pipeline=SPEC.name,
        request_id=rid,
        stage_id=3,
        from_stage=source,
        deadline_ms=2_000_000_000_000 + source,
        seed=9,
        payload=Payload(fields={"prompt": "p"}, tensors={"data": tensor}),
    )
    return msgspec.structs.replace(si, **kw)


def test_join_input_is_the_same_whichever_source_came_first() -> None:
    a = join_input(SPEC, 3, {1: _input(1), 2: _input(2)})
    b = join_input(SPEC, 3, {2: _input(2), 1: _input(1)})
    assert encode(a) == encode(b)
    assert list(a.payload.fields) == ["s1.prompt", "s2.prompt"]
    assert list(a.payload.tensors) == ["s1.data", "s2.data"]
    assert (a.stage_id, a.from_stage, a.chunk, a.last) == (3, 1, 0, True)
    assert a.deadline_ms == 2_000_000_000_001  # the earliest
    assert split_join(SPEC, 3, a.payload.fields) == {
        "s1": {"prompt": "p"},
        "s2": {"prompt": "p"},
    }


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        (
            {1: _input(1)},
            r"stage 3 \(s3\) is a join of stages \[1, 2\]: no input from stage\(s\) \[2\]",
        ),
        (
            {0: _input(0), 1: _input(1), 2: _input(2)},
            r"takes input from stages \[1, 2\], not from stage\(s\) \[0\]",
        ),
        ({1: _input(1), 2: _input(2, rid="other")}, "stage 2's is for request 'other'"),
        ({1: _input(1), 2: _input(2, chunk=1, last=False)}, "chunk 1 of a stream"),
        ({1: _input(1), 2: _input(1)}, "the input given as stage 2's is from stage 1"),
    ],
)
def test_bad_join_inputs(inputs: dict[int, StageInput], expected: str) -> None:
    with pytest.raises(JoinInputError, match=expected):
        join_input(SPEC, 3, inputs)


def test_split_names_an_input_without_a_source() -> None:
    with pytest.raises(JoinInputError, match=r"input 'x\.y' does not name one of"):
        split_join(SPEC, 3, {"x.y": 1})
