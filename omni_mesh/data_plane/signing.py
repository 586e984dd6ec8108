"""HMAC-SHA256 tags over byte strings: what keeps clients from forging intermediate state
(DESIGN invariant 7). Verification is constant-time."""

from __future__ import annotations

import hashlib
import hmac

Buffer = bytes | bytearray | memoryview

TAG_BYTES = hashlib.sha256().digest_size  # 32


def check_secret(secret: bytes) -> None:
    """Refuse an unusable deployment secret (a configuration error, not a client error)."""
    if not isinstance(secret, bytes | bytearray) or not secret:
        raise ValueError("the deployment secret must be non-empty bytes")


def sign(secret: bytes, *parts: Buffer) -> bytes:
    """The tag of the concatenation of ``parts`` (no copy of the parts is made)."""
    check_secret(secret)
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


def verify(secret: bytes, tag: Buffer, *parts: Buffer) -> bool:
    """Whether ``tag`` is the tag of ``parts`` under ``secret`` (constant-time compare)."""
    return hmac.compare_digest(sign(secret, *parts), bytes(tag))


def hop_token(secret: bytes) -> str:
    """The bearer token of internal hops: proves the sender holds the deployment secret
    without sending it (a client cannot forge a hop and its intermediate state)."""
    return sign(secret, b"omni-mesh hop token v1").hex()
