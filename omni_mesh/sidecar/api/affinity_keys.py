"""The session affinity key of a client request (``StageInput.affinity``; routing:
``sidecar/hop/affinity.py``), first found of:

1. the ``X-Omni-Session`` header (any route; a gateway in front can set it);
2. OpenAI's ``prompt_cache_key`` (chat, completions: "used to cache responses for similar
   requests"), then ``user``;
3. the route's own: a realtime session's id; for chat, the conversation's start (every message
   up to and including the first user message: the same for every follow-up of one
   conversation); for completions, the prompt's first 512 characters.

Keys are hashed into a short opaque string, so no client text travels in it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from omni_mesh.sidecar.errors import bad_request

SESSION_HEADER = "X-Omni-Session"
_SESSION = re.compile(r"[A-Za-z0-9._:@/+=-]{1,256}")
PROMPT_PREFIX_CHARS = 512


def _hashed(kind: str, text: str) -> str:
    return kind + ":" + hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def affinity_key(request: web.Request, *candidates: str | None) -> str:
    """The request's key: its header, else the first non-empty candidate (the caller's, in
    its order); "" = none. A malformed header is a 400 naming it."""
    raw = request.headers.get(SESSION_HEADER)
    if raw is not None:
        value = raw.strip()
        if not _SESSION.fullmatch(value):
            raise bad_request(
                f"{SESSION_HEADER}: 1 to 256 characters of letters, digits and ._:@/+=-",
                SESSION_HEADER,
            )
        return _hashed("session", value)
    for candidate in candidates:
        if candidate:
            return candidate
    return ""


def named(kind: str, value: str | None) -> str | None:
    """A client-given key (``prompt_cache_key``, ``user``), hashed; None when absent."""
    return _hashed(kind, value) if value else None


def conversation_start(messages: Sequence[dict[str, Any]]) -> str | None:
    """A chat's key: its messages up to and including the first user message."""
    start: list[dict[str, Any]] = []
    for message in messages:
        start.append(message)
        if message.get("role") == "user":
            return _hashed("chat", json.dumps(start, sort_keys=True, ensure_ascii=False))
    return None


def prompt_prefix(prompt: str | Sequence[int]) -> str | None:
    """A completion's key: the start of its prompt (text, or token ids)."""
    if isinstance(prompt, str):
        return _hashed("prompt", prompt[:PROMPT_PREFIX_CHARS]) if prompt else None
    ids = list(prompt[:PROMPT_PREFIX_CHARS])
    return _hashed("prompt", json.dumps(ids)) if ids else None
