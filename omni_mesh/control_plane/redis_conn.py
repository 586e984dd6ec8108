"""omni-cp's Redis client, built from ``--redis-url``.

Accepted URLs:

- ``redis://[[user]:password@]host[:port][/db]`` - plain TCP;
- ``rediss://…`` - TLS (``?ssl_ca_certs=/path/ca.pem``, ``ssl_certfile``, ``ssl_keyfile``,
  ``ssl_cert_reqs`` and ``ssl_check_hostname`` as redis-py reads them);
- ``unix:///path/redis.sock[?db=N&password=…]`` - a Unix socket;
- ``redis+sentinel://[[user]:password@]host:port[,host:port…]/service_name[/db]`` - the primary
  that Redis Sentinel manages for ``service_name`` (``rediss+sentinel://`` for TLS to the
  primary, with the ``ssl_*`` parameters above). The user/password are the primary's; a
  ``?sentinel_password=`` (and ``sentinel_username``) query parameter authenticates to the
  sentinels themselves. After a
  failover every new connection asks the sentinels for the current primary, and a connection
  still open to the demoted one is dropped at its first ``READONLY`` reply.

Lua scripts are run with EVALSHA and re-loaded by redis-py when a (new) primary answers
``NOSCRIPT``, so a failover or a restarted Redis needs nothing from us.

Redis Cluster is refused with one line (:class:`RedisUrlError`): ``redis+cluster://`` at parse
time, and a ``redis://`` URL that points at a cluster node at start-up (:func:`refuse_cluster`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff

logger = logging.getLogger(__name__)

#: Redis connections per omni-cp; more requests than this wait for one (see connect_redis).
REDIS_POOL_SIZE = 64
#: How long a request waits for a free pooled connection.
POOL_WAIT_S = 2.0
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
PLAIN_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_SENTINEL_PORT = 26379
_SENTINEL_QUERY = ("sentinel_password", "sentinel_username")
#: TLS settings of the connections to a Sentinel-managed primary (``rediss+sentinel://``).
_PRIMARY_TLS_QUERY = (
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "ssl_check_hostname",
)
_BOOL_QUERY = ("ssl_check_hostname",)
_TLS_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


class RedisUrlError(ValueError):
    """``--redis-url`` names something omni-cp cannot use (bad URL, Redis Cluster)."""


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """A Sentinel-managed primary: where the sentinels are and what to ask them for."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    tls: bool = False
    primary_kwargs: dict[str, Any] = field(default_factory=dict)
    sentinel_kwargs: dict[str, Any] = field(default_factory=dict)


def redact(url: str) -> str:
    """``url`` with its password (userinfo and ``*password`` query values) replaced by ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hosts = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}:***@{hosts}" if ":" in userinfo else f"***@{hosts}"
    query = "&".join(
        f"{k}=***" if "password" in k else f"{k}={v}"
        for k, v in parse_qsl(parts.query, keep_blank_values=True)
    )
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def _host_port(item: str, url: str) -> tuple[str, int]:
    host, sep, port = item.rpartition(":") if item.count(":") == 1 else (item, "", "")
    if not sep:
        host, port = item, str(DEFAULT_SENTINEL_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RedisUrlError(f"bad sentinel address {item!r} in {redact(url)}")
    return host, int(port)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """Split a ``redis+sentinel://`` URL; :class:`RedisUrlError` naming what is wrong."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if not hosts:
        raise RedisUrlError(f"{redact(url)}: no sentinel host:port given")
    sentinels = tuple(_host_port(h, url) for h in hosts.split(",") if h)
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise RedisUrlError(
            f"{redact(url)}: expected /SERVICE_NAME[/DB] after the sentinels "
            "(redis+sentinel://host:port,host:port/mymaster)"
        )
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise RedisUrlError(f"{redact(url)}: database {path[1]!r} is not a number")
        db = int(path[1])
    primary: dict[str, Any] = {}
    if userinfo:
        user, _, password = userinfo.partition(":")
        if user:
            primary["username"] = unquote(user)
        if password:
            primary["password"] = unquote(password)
    sentinel_kw: dict[str, Any] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in _PRIMARY_TLS_QUERY:
            primary[key] = _TLS_BOOLS.get(value.lower(), value) if key in _BOOL_QUERY else value
        elif key in _SENTINEL_QUERY:
            sentinel_kw[key.removeprefix("sentinel_")] = value
        else:
            accepted = ", ".join((*_SENTINEL_QUERY, *_PRIMARY_TLS_QUERY))
            raise RedisUrlError(
                f"{redact(url)}: unknown query parameter {key!r} (accepted: {accepted})"
            )
    tls = parts.scheme == "rediss+sentinel"
    return SentinelTarget(sentinels, unquote(path[0]), db, tls, primary, sentinel_kw)


def check_url(url: str) -> None:
    """Raise :class:`RedisUrlError` for a URL omni-cp cannot use; return for a usable one."""
    scheme = urlsplit(url).scheme
    if scheme in CLUSTER_SCHEMES:
        raise RedisUrlError(
            "Redis Cluster is not supported: point --redis-url at one primary "
            "(redis://, rediss://) or a Sentinel-managed one (redis+sentinel://)"
        )
    if scheme in SENTINEL_SCHEMES:
        parse_sentinel_url(url)
    elif scheme not in PLAIN_SCHEMES:
        raise RedisUrlError(
            f"{redact(url)}: unknown scheme {scheme!r} "
            "(redis, rediss, unix, redis+sentinel, rediss+sentinel)"
        )


def _client_kwargs() -> dict[str, Any]:
    """Fail fast (one quick retry), so that the API answers 503 promptly when Redis is down."""
    return {
        "decode_responses": True,
        "socket_connect_timeout": 1.0,
        "socket_timeout": 2.0,
        "retry": Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=1),
        "health_check_interval": 10,
    }


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """A Sentinel pool that waits for a free connection like :class:`BlockingConnectionPool`."""


def connect_redis(url: str) -> Redis:
    """A Redis client for ``url`` (see the module docstring for the accepted forms).

    The pool blocks (up to ``POOL_WAIT_S``) when all its connections are busy: a burst of
    heartbeats queues for a connection instead of failing with "Too many connections"."""
    check_url(url)
    pool_kwargs = {"max_connections": REDIS_POOL_SIZE, "timeout": POOL_WAIT_S}
    if urlsplit(url).scheme not in SENTINEL_SCHEMES:
        pool = BlockingConnectionPool.from_url(url, **pool_kwargs, **_client_kwargs())
        return Redis.from_pool(pool)  # closing the client closes its pool
    target = parse_sentinel_url(url)
    sentinel = Sentinel(  # type: ignore[no-untyped-call,unused-ignore]
        list(target.sentinels),
        sentinel_kwargs={
            "socket_connect_timeout": 0.5,
            "socket_timeout": 1.0,
            "decode_responses": True,
            **target.sentinel_kwargs,
        },
    )
    logger.info(
        "redis: primary %r from sentinels %s",
        target.service_name,
        ",".join(f"{h}:{p}" for h, p in target.sentinels),
    )
    return sentinel.master_for(  # type: ignore[no-any-return]
        target.service_name,
        redis_class=Redis,
        connection_pool_class=_BlockingSentinelPool,
        db=target.db,
        ssl=target.tls,
        **pool_kwargs,
        **target.primary_kwargs,
        **_client_kwargs(),
    )


async def close_redis(redis: Redis) -> None:
    """Close ``redis``, its pool and, for a Sentinel-managed primary, the sentinel clients."""
    pool = redis.connection_pool
    await redis.aclose()
    if isinstance(pool, SentinelConnectionPool):
        await pool.sentinel_manager.aclose()


async def refuse_cluster(redis: Redis) -> None:
    """Raise :class:`RedisUrlError` when ``redis`` is a Redis Cluster node."""
    info = await redis.info("cluster")
    if int(info.get("cluster_enabled", 0)):
        raise RedisUrlError(
            "Redis Cluster is not supported (the Redis at --redis-url has cluster_enabled:1): "
            "use one primary, optionally managed by Sentinel (redis+sentinel://)"
        )
