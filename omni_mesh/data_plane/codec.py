"""The one codec of the data path: msgpack via msgspec, typed, zero-copy for tensor bytes.

* :func:`encode` / :func:`encode_into` serialize any message of ``messages.py``; tensor
  ``memoryview`` data is written as raw msgpack ``bin`` (one memcpy, never a list of numbers).
* :func:`decode` validates against the target type with a cached decoder; decoded tensor
  ``data`` is a ``memoryview`` *into the input buffer* (keep the buffer alive, don't mutate it).
* :func:`encode_json` / :func:`decode_json` are the JSON twins for client-facing bodies
  (``/v1/run``, the API routes, ``omni-run``).
* Errors are :class:`CodecError` carrying msgspec's path (``$.payload.tensors[...].dtype``).

No pickle, ever: msgspec only produces and accepts the declared types.
"""

from __future__ import annotations

import re
import threading
from typing import Any, TypeVar, overload

import msgspec

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview

_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}
_json_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}
_decoders_lock = threading.Lock()
_PATH = re.compile(r" - at `(?P<path>\$[^`]*)`$")


class CodecError(ValueError):
    """A message could not be encoded or decoded. ``path`` names the offending field
    (msgspec's ``$.a.b[...]`` notation) when the failure is a validation error; ``detail`` is
    msgspec's own text; ``malformed`` says the bytes were not msgpack/JSON at all."""

    def __init__(
        self,
        message: str,
        path: str | None = None,
        *,
        detail: str = "",
        malformed: bool = False,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.detail = detail or message
        self.malformed = malformed


# ---- msgpack ---------------------------------------------------------------------------------


def encode(msg: Any) -> bytes:
    """msgpack bytes of ``msg``."""
    try:
        return _msgpack_encoder.encode(msg)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode {type(msg).__name__}: {exc}") from exc


def encode_into(msg: Any, buf: bytearray, offset: int = 0) -> int:
    """Write msgpack of ``msg`` into ``buf`` starting at ``offset``; ``buf`` is resized to end
    exactly after the message. Returns the new ``len(buf)``. Reusing one large buffer avoids
    the page faults of allocating a fresh one per message."""
    try:
        _msgpack_encoder.encode_into(msg, buf, offset)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode {type(msg).__name__}: {exc}") from exc
    return len(buf)


@overload
def decode(data: Buffer, type_: type[T]) -> T: ...
@overload
def decode(data: Buffer, type_: Any) -> Any: ...
def decode(data: Buffer, type_: Any) -> Any:
    """Decode msgpack ``data`` as ``type_`` (a Struct, or a union such as ``EngineMessage``).
    ``memoryview`` fields are zero-copy views into ``data``."""
    decoder = _decoders.get(type_)
    if decoder is None:
        with _decoders_lock:
            decoder = _decoders.setdefault(type_, msgspec.msgpack.Decoder(type_))
    return _decode(decoder, data, type_)


# ---- JSON (client-facing bodies) -------------------------------------------------------------


def encode_json(msg: Any) -> bytes:
    """JSON bytes of ``msg`` (``bytes``/``memoryview`` fields become base64 strings)."""
    try:
        return _json_encoder.encode(msg)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode {type(msg).__name__} as JSON: {exc}") from exc


@overload
def decode_json(data: Buffer, type_: type[T]) -> T: ...
@overload
def decode_json(data: Buffer, type_: Any) -> Any: ...
def decode_json(data: Buffer, type_: Any) -> Any:
    """Decode JSON ``data`` as ``type_``, with the same errors as :func:`decode`."""
    decoder = _json_decoders.get(type_)
    if decoder is None:
        with _decoders_lock:
            decoder = _json_decoders.setdefault(type_, msgspec.json.Decoder(type_))
    return _decode(decoder, data, type_)


def _decode(
    decoder: msgspec.msgpack.Decoder[Any] | msgspec.json.Decoder[Any], data: Buffer, type_: Any
) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc, type_) from None
    except msgspec.DecodeError as exc:
        raise _malformed(exc, type_) from None


def _validation_error(exc: msgspec.ValidationError, type_: Any) -> CodecError:
    text = str(exc)
    match = _PATH.search(text)
    path = match["path"] if match else None
    return CodecError(f"invalid {_type_name(type_)}: {text}", path, detail=text)


def _malformed(exc: msgspec.DecodeError, type_: Any) -> CodecError:
    return CodecError(f"malformed {_type_name(type_)}: {exc}", detail=str(exc), malformed=True)


def _type_name(type_: Any) -> str:
    return getattr(type_, "__name__", None) or str(type_)
