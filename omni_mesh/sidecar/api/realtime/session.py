"""One realtime session: the client events it handles, its input audio buffer and turn
detection, its conversation and its one response at a time.

Every client message goes through :meth:`RealtimeSession.handle`: decoded and checked
(:mod:`.client_events`), then applied; anything wrong is an ``error`` event naming the client's
``event_id`` and the ``param`` at fault, and the session goes on. The input buffer keeps the
audio appended since the last commit at the session's input rate; with ``server_vad`` it is fed
to the VAD, and a detected turn is committed from ``prefix_padding_ms`` before the speech
started to where it stopped. Speech that starts while a response runs cancels it
(``interrupt_response``): a barge-in.

The session's clock is the audio it was sent: ``audio_start_ms``/``audio_end_ms`` count the
milliseconds of input audio since the session began, as OpenAI's do.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from aiohttp import web

from omni_mesh.sidecar.api.realtime import audio_formats
from omni_mesh.sidecar.api.realtime.client_events import (
    BufferAppend,
    BufferClear,
    BufferCommit,
    ClientEvent,
    EventError,
    ItemCreate,
    ItemDelete,
    ItemRetrieve,
    ItemTruncate,
    ResponseCancel,
    ResponseCreate,
    SessionUpdate,
    decode_event,
)
from omni_mesh.sidecar.api.realtime.config import (
    SessionConfig,
    apply_update,
    response_overrides,
    session_object,
)
from omni_mesh.sidecar.api.realtime.conversation import (
    Conversation,
    Item,
    audio_part,
    item_from_client,
    model_messages,
    new_id,
)
from omni_mesh.sidecar.api.realtime.input_buffer import InputBuffer
from omni_mesh.sidecar.api.realtime.response import ResponseInput, ResponseRun
from omni_mesh.sidecar.api.realtime.sender import EventSender
from omni_mesh.sidecar.api.realtime.vad import ServerVad
from omni_mesh.sidecar.pod import Pod

logger = logging.getLogger(__name__)

#: The most input audio a buffer holds uncommitted (OpenAI: 15 MiB of PCM16, ~5 min at 24 kHz).
MAX_BUFFER_MS = 5 * 60 * 1000
#: The least audio a manual commit takes (OpenAI's rule).
MIN_COMMIT_MS = 100
#: Audio kept before detected speech beyond the prefix padding (the VAD detects it late).
LOOKBACK_MS = 1000


class SessionHooks:
    """What a session tells the outside: a change to persist, a response's end (metrics)."""

    def changed(self, session: RealtimeSession, *, items: list[str], deleted: list[str]) -> None:
        """Items ``items`` were added or changed, ``deleted`` removed; or the config changed."""

    def response_done(self, session: RealtimeSession, run: ResponseRun) -> None:
        """``run`` ended (its status says how)."""


class RealtimeSession:
    """A session's state and event handling (see the module docstring)."""

    def __init__(
        self,
        pod: Pod,
        request: web.Request,
        sender: EventSender,
        session_id: str,
        config: SessionConfig,
        conversation: Conversation | None = None,
        hooks: SessionHooks | None = None,
    ) -> None:
        self.pod, self.request, self.sender = pod, request, sender
        self.id = session_id
        self.config = config
        self.conversation = conversation or Conversation()
        self.hooks = hooks or SessionHooks()
        self.response: ResponseRun | None = None
        self._buffer = InputBuffer()  # at the input format's rate
        self._clock_samples = 0  # input samples since `_clock_base_ms`
        self._clock_base_ms = 0.0
        self._vad: ServerVad | None = None
        self._vad_base_ms = 0.0
        self._speech_item: str | None = None
        self._speech_start_ms = 0.0
        self._idle: asyncio.TimerHandle | None = None

    # ---- state seen from outside -------------------------------------------------------------

    @property
    def state(self) -> str:
        """``responding``, ``speaking`` (the VAD hears the user) or ``idle``."""
        if self.response is not None and not self.response.done:
            return "responding"
        if self._vad is not None and self._vad.speaking:
            return "speaking"
        return "idle"

    @property
    def audio_ms(self) -> float:
        """The session's clock: input audio received, in ms."""
        return self._clock_base_ms + self._clock_samples * 1000.0 / self._rate

    @property
    def _rate(self) -> int:
        return audio_formats.format_rate(self.config.input_format)

    # ---- the socket's side -------------------------------------------------------------------

    def start(self, *, resumed: bool = False) -> None:
        self.sender.send(
            {"type": "session.created", "session": session_object(self.id, self.config)}
        )
        if resumed:  # the conversation so far, as items the client may not have seen
            previous: str | None = None
            for item in self.conversation.items:
                self.sender.send(
                    {
                        "type": "conversation.item.added",
                        "previous_item_id": previous,
                        "item": item.wire(),
                    }
                )
                self.sender.send({"type": "conversation.item.done", "item": item.wire()})
                previous = item.id
        self._arm_idle()

    async def handle(self, data: str | bytes) -> None:
        """One client message (see the module docstring)."""
        event: ClientEvent | None = None
        try:
            event = decode_event(data)
            self._dispatch(event)
        except EventError as exc:
            if exc.event_id is None and event is not None:
                exc.event_id = event.event_id
            self.error(exc)

    def error(self, exc: EventError) -> None:
        self.sender.send(
            {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "code": exc.code,
                    "message": exc.message,
                    "param": exc.param,
                    "event_id": exc.event_id,
                },
            }
        )

    async def close(self) -> None:
        """The socket closed: a running response ends without events (its stages abort)."""
        if self._idle is not None:
            self._idle.cancel()
        run = self.response
        if run is not None and run.task is not None and not run.task.done():
            run.task.cancel()
            await run.wait()

    # ---- events ------------------------------------------------------------------------------

    def _dispatch(self, event: ClientEvent) -> None:
        handler: Callable[[Any], None] = getattr(self, _HANDLERS[type(event)])
        handler(event)

    def _session_update(self, event: SessionUpdate) -> None:
        new = apply_update(self.pod.pipeline, self.config, event.session)
        if new.input_format != self.config.input_format:  # a new rate: a new buffer and clock
            self._clock_base_ms = self.audio_ms
            self._clock_samples = 0
            self._buffer.clear(self.audio_ms)
        if new.turn_detection != self.config.turn_detection:
            self._vad = None  # made again, with the new settings, on the next append
        self.config = new
        self.sender.send({"type": "session.updated", "session": session_object(self.id, new)})
        self.hooks.changed(self, items=[], deleted=[])
        self._arm_idle()

    def _buffer_append(self, event: BufferAppend) -> None:
        try:
            raw = base64.b64decode(event.audio, validate=True)
            samples = audio_formats.decode(self.config.input_format, raw)
        except (binascii.Error, ValueError) as exc:
            raise EventError(
                f"audio: not {self.config.input_format} in base64 ({exc})",
                param="audio",
                code="invalid_audio",
            ) from None
        if self._buffer.samples + len(samples) > MAX_BUFFER_MS * self._rate // 1000:
            raise EventError(
                f"audio: the input audio buffer is full ({MAX_BUFFER_MS // 1000} s uncommitted)",
                param="audio",
                code="input_audio_buffer_full",
            )
        if len(samples) == 0:
            return
        self._buffer.append(samples, self.audio_ms)
        self._clock_samples += len(samples)
        td = self.config.turn_detection
        if td is None:
            return
        if self._vad is None:
            self._vad = ServerVad(td.threshold, td.prefix_padding_ms, td.silence_duration_ms)
            self._vad_base_ms = self.audio_ms - len(samples) * 1000.0 / self._rate
        for vad_event in self._vad.feed(samples, self._rate):
            at_ms = self._vad_base_ms + vad_event.audio_ms
            if vad_event.kind == "speech_started":
                self._speech_started(at_ms)
            else:
                self._speech_stopped(at_ms)
        if not self._vad.speaking:  # only the look-back before speech is worth keeping
            self._buffer.trim(td.prefix_padding_ms + LOOKBACK_MS, self._rate)

    def _speech_started(self, at_ms: float) -> None:
        td = self.config.turn_detection
        assert td is not None
        self._disarm_idle()
        self._speech_item = new_id("item")
        self._speech_start_ms = at_ms
        self.sender.send(
            {
                "type": "input_audio_buffer.speech_started",
                "audio_start_ms": int(at_ms),
                "item_id": self._speech_item,
            }
        )
        if td.interrupt_response and self.response is not None:
            self.response.cancel("turn_detected")

    def _speech_stopped(self, at_ms: float) -> None:
        td = self.config.turn_detection
        assert td is not None
        item_id = self._speech_item or new_id("item")
        self._speech_item = None
        self.sender.send(
            {
                "type": "input_audio_buffer.speech_stopped",
                "audio_end_ms": int(at_ms),
                "item_id": item_id,
            }
        )
        start_ms = max(self._buffer.start_ms, self._speech_start_ms - td.prefix_padding_ms)
        samples = self._buffer.take(start_ms, at_ms, self._rate)
        if len(samples) == 0:
            return
        self._commit(samples, item_id)
        if td.create_response:
            self._start_response(None)

    def _buffer_commit(self, event: BufferCommit) -> None:
        ms = self._buffer.ms(self._rate)
        if ms < MIN_COMMIT_MS:
            raise EventError(
                f"buffer too small: a commit needs at least {MIN_COMMIT_MS} ms of audio, the "
                f"buffer has {ms:.0f} ms",
                code="input_audio_buffer_commit_empty",
            )
        samples = self._buffer.take(self._buffer.start_ms, self.audio_ms, self._rate)
        if self._vad is not None:
            self._vad.reset()
            self._vad = None
        self._commit(samples, self._speech_item or new_id("item"))
        self._speech_item = None

    def _buffer_clear(self, event: BufferClear) -> None:
        self._buffer.clear(self.audio_ms)
        self._vad = None
        self._speech_item = None
        self.sender.send({"type": "input_audio_buffer.cleared"})

    def _commit(self, samples: np.ndarray, item_id: str) -> None:
        if not self.pod.pipeline.input_audio:
            raise EventError(
                f"input_audio_buffer: pipeline {self.pod.pipeline.name!r} takes no audio input",
                code="audio_not_served",
            )
        previous = self.conversation.items[-1].id if self.conversation.items else None
        item = Item(id=item_id, role="user", parts=[audio_part(samples, self._rate)])
        self.sender.send(
            {
                "type": "input_audio_buffer.committed",
                "previous_item_id": previous,
                "item_id": item_id,
            }
        )
        self._add_item(item, None)

    def _item_create(self, event: ItemCreate) -> None:
        item = item_from_client(event.item, self.config.input_format, self.pod.pipeline.input_audio)
        self._add_item(item, event.previous_item_id)

    def _add_item(self, item: Item, previous_item_id: str | None) -> None:
        dropped = self.conversation.add(item, previous_item_id)
        previous = self.conversation.previous_id(item.id)
        wire = item.wire()
        self.sender.send(
            {"type": "conversation.item.added", "previous_item_id": previous, "item": wire}
        )
        self.sender.send({"type": "conversation.item.done", "item": wire})
        self.hooks.changed(self, items=[item.id], deleted=[d.id for d in dropped])

    def _item_delete(self, event: ItemDelete) -> None:
        if self.response is not None and self.response.item_id == event.item_id:
            raise EventError(
                "item_id: the item is being made by the running response", param="item_id"
            )
        self.conversation.delete(event.item_id)
        self.sender.send({"type": "conversation.item.deleted", "item_id": event.item_id})
        self.hooks.changed(self, items=[], deleted=[event.item_id])

    def _item_retrieve(self, event: ItemRetrieve) -> None:
        item = self.conversation.find(event.item_id)
        if item is None:
            raise EventError(f"item_id: no item {event.item_id!r}", param="item_id")
        self.sender.send({"type": "conversation.item.retrieved", "item": item.wire()})

    def _item_truncate(self, event: ItemTruncate) -> None:
        if self.response is not None and self.response.item_id == event.item_id:
            self.response.cancel("client_cancelled")  # what was heard ends the answer
        self.conversation.truncate(event.item_id, event.content_index, event.audio_end_ms)
        self.sender.send(
            {
                "type": "conversation.item.truncated",
                "item_id": event.item_id,
                "content_index": event.content_index,
                "audio_end_ms": event.audio_end_ms,
            }
        )
        self.hooks.changed(self, items=[event.item_id], deleted=[])

    def _response_create(self, event: ResponseCreate) -> None:
        self._start_response(event)

    def _response_cancel(self, event: ResponseCancel) -> None:
        run = self.response
        if run is None or run.done or (event.response_id not in (None, run.id)):
            raise EventError(
                "response.cancel: no response is in progress"
                if run is None or run.done
                else f"response_id: {event.response_id!r} is not the response in progress",
                param=None if run is None or run.done else "response_id",
                code="response_cancel_not_active",
            )
        run.cancel("client_cancelled")

    # ---- responses ---------------------------------------------------------------------------

    def _start_response(self, event: ResponseCreate | None) -> None:
        if self.response is not None and not self.response.done:
            raise EventError(
                f"a response ({self.response.id}) is in progress: cancel it or wait for "
                "response.done",
                code="conversation_already_has_active_response",
            )
        config = response_overrides(
            self.pod.pipeline, self.config, event.response if event else None
        )
        prompt, messages = model_messages(
            self.conversation.items, config.instructions, audio_in=self.pod.pipeline.input_audio
        )
        previous = self.conversation.items[-1].id if self.conversation.items else None
        messages_json = json.dumps(messages, ensure_ascii=False)
        audio_ms = sum(
            part.audio_ms
            for item in self.conversation.items
            if item.role == "user"
            for part in item.parts
            if part.type == "input_audio" and part.wav is not None
        )
        audio_in_s = audio_ms / 1000.0 if self.pod.pipeline.input_audio else 0.0
        inp = ResponseInput(
            config, prompt, messages_json, previous, session_id=self.id, audio_in_s=audio_in_s
        )
        self._disarm_idle()
        run = ResponseRun(
            self.pod, self.request, self.sender, self.conversation, inp, on_done=self._done
        )
        self.response = run
        run.start()

    def _done(self, run: ResponseRun) -> None:
        if run.item is not None:  # the assistant item as it ended (cut short when cancelled)
            self.hooks.changed(self, items=[run.item.id], deleted=[])
        self.hooks.response_done(self, run)
        self._arm_idle(after_s=_playback_left_s(run))

    # ---- idle timeout ------------------------------------------------------------------------

    def _arm_idle(self, after_s: float = 0.0) -> None:
        """Fire ``idle_timeout_ms`` after now plus ``after_s`` (the answer's audio still
        playing at the client, as OpenAI counts it: from the end of its playback)."""
        self._disarm_idle()
        td = self.config.turn_detection
        if td is None or td.idle_timeout_ms is None:
            return
        loop = asyncio.get_running_loop()
        self._idle = loop.call_later(td.idle_timeout_ms / 1000.0 + after_s, self._idle_fired)

    def _disarm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _idle_fired(self) -> None:
        """No speech for ``idle_timeout_ms``: what the buffer holds is committed and answered
        (OpenAI's ``input_audio_buffer.timeout_triggered``)."""
        self._idle = None
        if self.state != "idle" or self.sender.closed:
            return
        item_id = new_id("item")
        start, end = self._buffer.start_ms, self.audio_ms
        self.sender.send(
            {
                "type": "input_audio_buffer.timeout_triggered",
                "audio_start_ms": int(start),
                "audio_end_ms": int(end),
                "item_id": item_id,
            }
        )
        try:
            if self._buffer.samples and self.pod.pipeline.input_audio:
                self._commit(self._buffer.take(start, end, self._rate), item_id)
            self._start_response(None)
        except EventError as exc:
            self.error(exc)


_HANDLERS: dict[type, str] = {
    SessionUpdate: "_session_update",
    BufferAppend: "_buffer_append",
    BufferCommit: "_buffer_commit",
    BufferClear: "_buffer_clear",
    ItemCreate: "_item_create",
    ItemDelete: "_item_delete",
    ItemRetrieve: "_item_retrieve",
    ItemTruncate: "_item_truncate",
    ResponseCreate: "_response_create",
    ResponseCancel: "_response_cancel",
}


def _playback_left_s(run: ResponseRun) -> float:
    """Seconds of ``run``'s audio the client has yet to play, played in real time from its
    first audio delta."""
    stats = run.stats
    if stats.first_audio_s is None:
        return 0.0
    end = stats.started + stats.first_audio_s + stats.audio_ms / 1000.0
    return max(0.0, end - time.perf_counter())
