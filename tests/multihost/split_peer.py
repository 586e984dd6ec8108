"""One side of a split thinker across two test hosts (``test_split_thinker_hosts.py``), run
inside a host: ``prefill OUT`` loads a split qwen3-omni thinker, prefills the test's requests,
writes their params to OUT (one JSON line each, then ``done``) and stays up until killed;
``decode PARAMS TIMEOUT_S`` loads a split thinker (``kv_pull_timeout_s``) and an unsplit one,
decodes each request from its params and alone, and prints one JSON line: whether every answer
was equal, and the pulls."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from omni_mesh.data_plane.kv_transfer import PREFILL_REQUEST
from omni_mesh.engines.base import EngineRequest
from tests.engines.helpers import make_engine
from tests.engines.qwen3_omni.test_qwen3_omni_thinker_split import chat, split_engine

#: (request index in omni_reference.CHATS, seed): a text prompt and an audio one.
REQUESTS = ((0, 21), (1, 22))


def prefill(out: Path) -> None:
    engine = split_engine()
    lines = []
    for index, seed in REQUESTS:
        request = EngineRequest(f"p{index}", seed, chat(index), kv_transfer=PREFILL_REQUEST)
        (answer,) = engine.execute([request])
        assert answer.error is None, answer.error
        lines.append(answer.kv_transfer)
    out.write_text("\n".join([*lines, "done"]) + "\n")
    while True:  # serve the reads (NIXL's progress thread) and the notifications
        engine.idle()
        time.sleep(0.05)


def decode(params_file: Path, timeout_s: float) -> None:
    params = params_file.read_text().splitlines()[: len(REQUESTS)]
    split, whole = split_engine(kv_pull_timeout_s=timeout_s), make_engine("qwen3-omni", 0)
    equal = []
    for (index, seed), kv in zip(REQUESTS, params, strict=True):
        t0 = time.monotonic()
        (got,) = split.execute([EngineRequest("d", seed, chat(index), kv_transfer=kv)])
        print(f"decode took {time.monotonic() - t0:.2f} s", file=sys.stderr)
        (want,) = whole.execute([EngineRequest("w", seed, chat(index))])
        same = got.error is None and got.final == want.final
        same = same and all(
            (got.output.arrays[k] == v).all() for k, v in want.output.arrays.items()
        )
        equal.append(bool(same))
    counts = split.kv.exchange.counts  # type: ignore[attr-defined]
    print(json.dumps({"equal": equal, "pulled": counts.pulled, "failed": counts.failed,
                      "bytes": counts.pulled_bytes}))  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1] == "prefill":
        prefill(Path(sys.argv[2]))
    else:
        decode(Path(sys.argv[2]), float(sys.argv[3]))
