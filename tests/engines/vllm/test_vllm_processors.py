"""The tiny-omni-vllm processors: thinker token ids into the talker's codec vocabulary with a
frame budget, talker tokens into code2wav frames (whole frames, left context kept at the end),
and errors that name the processor and the array."""

from __future__ import annotations

import numpy as np
import pytest

from omni_mesh.engines.base import EngineInputError, StageData
from omni_mesh.engines.vllm.processors import (
    FRAMES_PER_TOKEN,
    talker_to_code2wav,
    thinker_to_talker,
)

pytestmark = pytest.mark.unit


def test_thinker_ids_map_into_the_codec_vocabulary_with_a_frame_budget() -> None:
    ids = np.array([0, 1, 1023, 500], dtype=np.int64)
    out = thinker_to_talker(
        StageData(fields={"voice": "echo", "text": "hi"}, arrays={"token_ids": ids})
    )
    codes = out.arrays["token_ids"]
    assert codes.shape == (4,) and codes.min() >= 0 and codes.max() < 1024
    assert len(set(codes.tolist())) == 4  # a permutation: distinct ids stay distinct
    assert out.fields == {"voice": "echo", "max_tokens": 4 * FRAMES_PER_TOKEN * 4}


def test_an_empty_thinker_chunk_still_feeds_the_talker() -> None:
    out = thinker_to_talker(StageData(arrays={"token_ids": np.empty(0, dtype=np.int64)}))
    assert out.arrays["token_ids"].shape == (1,)


def test_talker_tokens_become_whole_frames_and_context() -> None:
    ids = np.arange(10, dtype=np.int64)  # 2 whole frames and 2 spare codes
    context = np.arange(100, 106, dtype=np.int64)  # 1 whole frame, the latest 4 codes kept
    out = talker_to_code2wav(StageData(arrays={"token_ids": ids, "context_token_ids": context}))
    assert out.arrays["codes"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert out.arrays["context_codes"].tolist() == [[102, 103, 104, 105]]


@pytest.mark.parametrize(
    ("arrays", "needle"),
    [
        ({}, "talker_to_code2wav: upstream output lacks array 'token_ids'"),
        ({"token_ids": np.arange(3)}, "3 talker tokens make no whole frame"),
        ({"token_ids": np.array([0, 1, 2, 5000])}, "token_ids outside the codec's range"),
    ],
)
def test_bad_talker_output_is_named(arrays: dict[str, np.ndarray], needle: str) -> None:
    with pytest.raises(EngineInputError, match=needle):
        talker_to_code2wav(StageData(arrays=arrays))
