"""A spoken conversation with barge-in through ``omni-up`` (qwen3-omni, the bundled 1:2:1), as a
user would hold it: the official SDK on ``/v1/realtime`` of omni-up's API server, real speech
from espeak-ng, the server's VAD deciding the turns. Then Ctrl-C leaves nothing behind."""

from __future__ import annotations

import base64
import re
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from omni_mesh.procutil import free_port
from tests.procs import ManagedProcess, clean_env, descendants, pid_alive
from tests.sidecar.realtime.sdk import RATE, send_audio
from tests.sidecar.realtime.sdk import until as read_until
from tests.sidecar.realtime.speech import noise, silence, speech

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
]

PIPELINE = "qwen3-omni"
ANSWERED = ("completed", "incomplete")  # incomplete: max_output_tokens reached (kept low here)


def until(conn: Any, kind: str, events: list[Any]) -> Any:
    """Read events into ``events`` up to the first of type ``kind``; return it."""
    events += read_until(conn, kind)
    return events[-1]


def audio_of(events: list[Any], response_id: str) -> int:
    return sum(
        len(base64.b64decode(e.delta)) // 2
        for e in events
        if e.type == "response.output_audio.delta" and e.response_id == response_id
    )


def test_a_spoken_conversation_with_barge_in_through_omni_up(tmp_path: Path) -> None:
    port = free_port()
    up = ManagedProcess(
        [sys.executable, "-m", "omni_mesh.launcher.cli", "--pipeline", PIPELINE,
         "--port", str(port)],
        name="omni-up", env=clean_env(), log_dir=tmp_path,
    ).start()  # fmt: skip
    try:
        ready = up.wait_for_output(r"omni-up ready: (\S+) \(pipeline qwen3-omni, replicas (\S+)\)",
                                   timeout=240)  # fmt: skip
        assert ready.group(2) == "1:2:1"  # the bundled deploy config's
        children = descendants(up.pid)
        sdk = openai.OpenAI(base_url=f"{ready.group(1)}/v1", api_key="none", max_retries=0)
        vad = {"type": "server_vad", "silence_duration_ms": 400, "prefix_padding_ms": 200,
               "create_response": True, "interrupt_response": True}  # fmt: skip
        events: list[Any] = []
        with sdk.realtime.connect(model=PIPELINE) as conn:
            until(conn, "session.created", events)
            conn.session.update(
                session={
                    "type": "realtime",
                    "audio": {"input": {"turn_detection": vad}},
                    "max_output_tokens": 6,
                }
            )
            until(conn, "session.updated", events)

            # Turn 1: the user speaks, the server hears the end of it and answers aloud.
            send_audio(conn, np.concatenate([noise(400, RATE, 200),
                                             speech("hello there, how are you", RATE),
                                             silence(1000, RATE)]))  # fmt: skip
            first = until(conn, "response.done", events).response
            assert first.status in ANSWERED, first
            assert audio_of(events, first.id) > RATE // 2

            # Turn 2: another question; while its answer streams, the user talks over it.
            send_audio(conn, np.concatenate([speech("tell me a long story", RATE),
                                             silence(800, RATE)]))  # fmt: skip
            delta = until(conn, "response.output_audio.delta", events)
            send_audio(conn, np.concatenate([speech("stop, please stop", RATE),
                                             silence(900, RATE)]))  # fmt: skip
            cut = until(conn, "response.done", events).response
            assert cut.id == delta.response_id
            assert (cut.status, cut.status_details.reason) == ("cancelled", "turn_detected")
            done_at = len(events)

            # The interruption is the user's next turn, and it is answered.
            last = until(conn, "response.done", events).response
            assert last.status in ANSWERED, last
            assert not [e for e in events[done_at:]
                        if getattr(e, "response_id", None) == cut.id]  # fmt: skip
            assert audio_of(events, last.id) > 0

        items = [e.item for e in events if e.type == "conversation.item.done"]
        roles = [(i.role, i.content[0].type) for i in items if i.role in ("user", "assistant")]
        assert roles == [("user", "input_audio"), ("assistant", "output_audio")] * 3, roles
        statuses = [i.status for i in items if i.role == "assistant"]
        assert statuses[1] == "incomplete"  # the cut answer, as far as it was heard

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=90) == 0
        assert [p for p in children if pid_alive(p)] == []
        assert re.search(r"control plane\s+http://", up.stdout)
    finally:
        up.cleanup()
