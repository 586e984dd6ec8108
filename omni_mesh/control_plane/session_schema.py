"""Messages of the realtime-session API (``routes_sessions.py``), shared with its client
(``client/sessions.py``). The conventions of ``schema.py`` hold: requests strict and bounded,
responses tolerant of fields they do not know.

A session is the control-plane state of one realtime connection: its pipeline, the API server
that holds it (``owner``), a fencing ``epoch`` bumped by every claim, its ``config`` and its
conversation items in ``order``. Items and config are JSON objects the control plane stores
without looking inside.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StringConstraints, model_validator

from omni_mesh.control_plane.schema import PipelineNameStr

#: A session's stored size (config + order + items, as JSON) may not exceed this.
MAX_SESSION_BYTES = 8 * 1024 * 1024
#: Items one session may hold.
MAX_SESSION_ITEMS = 1024
#: Request bodies of the session routes: a whole session plus its JSON framing.
MAX_SESSION_BODY_BYTES = MAX_SESSION_BYTES + 256 * 1024
#: TTL of a session while it is owned, renewed by every write and touch.
OWNED_TTL_MS = 120_000
#: Default TTL of a released session (a client may reconnect and resume it until then).
RELEASED_TTL_MS = 600_000
MAX_RELEASED_TTL_MS = 24 * 3600 * 1000
#: Sessions one touch may renew (the client sends more in several touches).
MAX_TOUCH_IDS = 4096
#: Request bodies of a touch: MAX_TOUCH_IDS ids of the longest kind, quoted.
MAX_TOUCH_BODY_BYTES = 1024 * 1024

SessionId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_\-.:]{1,128}$")]
ItemId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_\-.:]{1,128}$")]
#: An API server's instance id, "" for nobody.
Owner = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_\-.:]{0,128}$")]
OwnerId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_\-.:]{1,128}$")]
JsonObject = dict[str, JsonValue]
Epoch = Annotated[int, Field(ge=1, le=2**53)]


def _unique(ids: list[str], field: str) -> None:
    seen: set[str] = set()
    for item_id in ids:
        if item_id in seen:
            raise ValueError(f"{field}: item id {item_id!r} appears twice")
        seen.add(item_id)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


# ---- requests ----------------------------------------------------------------------------------


class SessionCreateRequest(_Request):
    """``POST /v1/sessions``: a new session (epoch 1), owned by ``owner`` ("": released)."""

    session_id: SessionId = Field(description="The session's id (the realtime session id).")
    pipeline: PipelineNameStr = Field(description="Registered pipeline the session runs on.")
    owner: Owner = Field(default="", description="Instance id of the API server holding it.")
    config: JsonObject = Field(default_factory=dict, description="The session's configuration.")


class SessionClaimRequest(_Request):
    """``POST /v1/sessions/{id}/claim``: ``owner`` takes the session over (epoch + 1); the
    previous owner's writes are refused from then on."""

    owner: OwnerId = Field(description="Instance id of the API server taking it.")


class SessionPatchRequest(_Request):
    """``PATCH /v1/sessions/{id}``: the owner's changes, applied at once or not at all.

    New items without an ``order`` go to the end, in the order given; deleted ones leave the
    order. An ``order`` must list every item of the session after the change, once.
    """

    epoch: Epoch = Field(description="The epoch of the caller's claim (fencing token).")
    config: JsonObject | None = Field(default=None, description="Replaces the whole config.")
    put_items: dict[ItemId, JsonObject] = Field(
        default_factory=dict, max_length=MAX_SESSION_ITEMS, description="Items to add/replace."
    )
    delete_items: list[ItemId] = Field(
        default_factory=list, max_length=MAX_SESSION_ITEMS, description="Items to remove."
    )
    order: list[ItemId] | None = Field(
        default=None, max_length=MAX_SESSION_ITEMS, description="Every item id, in order."
    )

    @model_validator(mode="after")
    def _consistent(self) -> SessionPatchRequest:
        both = sorted(set(self.put_items) & set(self.delete_items))
        if both:
            raise ValueError(f"delete_items: item {both[0]!r} is also in put_items")
        _unique(self.delete_items, "delete_items")
        if self.order is not None:
            _unique(self.order, "order")
        return self


class SessionReleaseRequest(_Request):
    """``POST /v1/sessions/{id}/release``: the owner lets the session go; it is kept for
    ``ttl_ms`` so that another API server can claim it."""

    epoch: Epoch = Field(description="The epoch of the caller's claim.")
    ttl_ms: int = Field(
        default=RELEASED_TTL_MS, ge=1, le=MAX_RELEASED_TTL_MS, description="Kept this long."
    )


class SessionTouchRequest(_Request):
    """``POST /v1/sessions/touch``: ``owner`` renews the TTL of the sessions it holds."""

    owner: OwnerId = Field(description="Instance id of the API server.")
    session_ids: list[SessionId] = Field(max_length=MAX_TOUCH_IDS, description="Its sessions.")


# ---- responses ---------------------------------------------------------------------------------


class SessionItem(_Response):
    id: str
    item: JsonObject


class SessionSummary(_Response):
    """Answer to create, patch and release: where the session stands after the write."""

    session_id: str
    pipeline: str
    owner: str = Field(default="", description='"" once released.')
    epoch: int
    item_count: int = Field(default=0, description="Items it holds.")
    size_bytes: int = Field(default=0, description="Stored size (config + order + items).")
    updated_ms: int = 0
    ttl_ms: int = Field(default=0, description="Time left before it expires, ms.")


class SessionState(SessionSummary):
    """Answer to claim and get: the whole session, its items in order."""

    config: JsonObject = Field(default_factory=dict)
    items: tuple[SessionItem, ...] = Field(default=(), description="Its items, in order.")


class SessionTouchResult(_Response):
    """Answer to a touch: ``lost`` are the ids the owner no longer holds (claimed by another,
    released, expired or deleted)."""

    renewed: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()


class SessionCounts(_Response):
    pipeline: str
    owned: int = 0
    released: int = 0


class SessionCountList(_Response):
    """``GET /v1/sessions[?pipeline=...]``: sessions per pipeline."""

    pipelines: tuple[SessionCounts, ...] = ()
