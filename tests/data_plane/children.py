"""Tiny child-process programs for the cross-process tests (run with ``sys.executable -c``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])

# argv: directory, segment, offset, nbytes → prints the sha256 of the slot's bytes.
READER = """
import hashlib, sys
from omni_mesh.data_plane.messages import ShmRef
from omni_mesh.data_plane.shm import ShmReader
directory, segment, offset, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with ShmReader(directory=directory) as reader:
    view = reader.view(ShmRef(segment=segment, offset=offset, nbytes=nbytes))
    print(hashlib.sha256(view).hexdigest(), flush=True)
    view.release()
"""

# argv: directory, nbytes, count → fills `count` slots with byte i, prints {"prefix", "refs"},
# then holds them until stdin closes, and closes its arena.
WRITER = """
import json, sys
from omni_mesh.data_plane.shm import ShmArena
directory, nbytes, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
arena = ShmArena(directory=directory)
refs = []
for i in range(count):
    slot = arena.alloc(nbytes, f"req-{i}")
    slot.view[:] = bytes([i + 1]) * nbytes
    refs.append([slot.ref.segment, slot.ref.offset, slot.ref.nbytes])
print(json.dumps({"prefix": arena.prefix, "refs": refs}), flush=True)
sys.stdin.read()
arena.close()
"""

# argv: fd → an engine stand-in: HELLO, then answers Submit with Result until Shutdown/EOF.
ENGINE = """
import os, socket, sys
from omni_mesh.data_plane.channel import BlockingChannel
from omni_mesh.data_plane.messages import Hello, Result, StageOutput, Shutdown, Submit
with BlockingChannel(socket.socket(fileno=int(sys.argv[1]))) as chan:
    chan.send(Hello(pid=os.getpid(), shm_prefix="omni-test"))
    while (msg := chan.recv()) is not None and not isinstance(msg, Shutdown):
        if isinstance(msg, Submit):
            si = msg.stage_input
            chan.send(Result(output=StageOutput(request_id=si.request_id, stage_id=si.stage_id,
                                                final=si.payload), key=si.request_id))
"""


def start(script: str, *args: str, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        text=True,
        **kw,
    )


def read_json_line(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"child exited early with {proc.wait()}"
    return json.loads(line)  # type: ignore[no-any-return]
