"""omni-cp's ``--redis-url`` forms: parsing and redaction (unit), then real Debian redis-servers
over TLS (a throwaway CA made with openssl), with a password, on a Unix socket, and a Redis
Cluster node that omni-cp refuses with exit 2."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import AuthenticationError

from omni_mesh.control_plane.redis_conn import (
    RedisUrlError,
    check_url,
    connect_redis,
    parse_sentinel_url,
    redact,
)
from tests.control_plane.redis_ha import debian_binary, start_redis
from tests.procs import ManagedProcess, cp_argv, free_port, start_control_plane

PASSWORD = "s3cret-pass"

# ---- unit ------------------------------------------------------------------------------------


def test_sentinel_url_parsed() -> None:
    target = parse_sentinel_url(
        "redis+sentinel://:p%40ss@h1:26380,h2/mymaster/3?sentinel_password=sp"
    )
    assert target.sentinels == (("h1", 26380), ("h2", 26379))
    assert (target.service_name, target.db, target.tls) == ("mymaster", 3, False)
    assert target.primary_kwargs == {"password": "p@ss"}
    assert target.sentinel_kwargs == {"password": "sp"}
    tls = parse_sentinel_url("rediss+sentinel://h:1/s?ssl_ca_certs=/ca.pem&ssl_check_hostname=no")
    assert tls.tls
    assert tls.primary_kwargs == {"ssl_ca_certs": "/ca.pem", "ssl_check_hostname": False}


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis+sentinel://h1:26379", "SERVICE_NAME"),
        ("redis+sentinel://h1:26379/m/x", "not a number"),
        ("redis+sentinel://h1:99999/m", "bad sentinel address"),
        ("redis+sentinel://h1:1/m?ssl=1", "unknown query parameter 'ssl'"),
        ("redis+cluster://h1:7000", "Redis Cluster is not supported"),
        ("memcached://h1", "unknown scheme"),
    ],
)
def test_bad_urls_named(url: str, words: str) -> None:
    with pytest.raises(RedisUrlError, match=words):
        check_url(url)


def test_redact_hides_passwords() -> None:
    assert redact("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact("rediss://u:pw@h:1/0?a=1") == "rediss://u:***@h:1/0?a=1"
    assert redact("redis+sentinel://h:1/m?sentinel_password=x") == (
        "redis+sentinel://h:1/m?sentinel_password=***"
    )
    assert redact("unix:///r.sock?password=x&db=1") == "unix:///r.sock?password=***&db=1"


# ---- real redis-servers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA and a server certificate for 127.0.0.1, made with openssl."""
    d = tmp_path_factory.mktemp("tls")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=omni-test-ca")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key",
            "-out", "server.csr", "-subj", "/CN=127.0.0.1")  # fmt: skip
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "1",
            "-extfile", "ext.cnf")  # fmt: skip
    return d


@pytest.fixture(scope="module")
def tls_redis(tls_dir: Path) -> Iterator[int]:
    """A redis-server with a password that speaks TLS only; its TLS port."""
    port = free_port()
    flags = [
        "--tls-port", str(port),
        "--tls-cert-file", str(tls_dir / "server.pem"),
        "--tls-key-file", str(tls_dir / "server.key"),
        "--tls-ca-cert-file", str(tls_dir / "ca.pem"),
        "--tls-auth-clients", "no",
        "--requirepass", PASSWORD,
    ]  # fmt: skip
    proc = start_redis(tls_dir, 0, flags, name="redis-tls")
    try:
        yield port
    finally:
        proc.cleanup()


async def test_tls_and_password(tls_redis: int, tls_dir: Path) -> None:
    ca = tls_dir / "ca.pem"
    good = connect_redis(f"rediss://:{PASSWORD}@127.0.0.1:{tls_redis}/0?ssl_ca_certs={ca}")
    wrong = connect_redis(f"rediss://:nope@127.0.0.1:{tls_redis}/0?ssl_ca_certs={ca}")
    try:
        assert await good.ping()
        script = good.register_script("return redis.call('INCR', KEYS[1])")
        assert await script(keys=["tls-k"]) == 1
        with pytest.raises(AuthenticationError):
            await wrong.ping()
    finally:
        await good.aclose()
        await wrong.aclose()


def test_omni_cp_over_tls_with_password(tls_redis: int, tls_dir: Path, tmp_path: Path) -> None:
    url = f"rediss://:{PASSWORD}@127.0.0.1:{tls_redis}/0?ssl_ca_certs={tls_dir / 'ca.pem'}"
    cp = start_control_plane(url, log_dir=tmp_path, name="cp-tls")
    try:
        body = {
            "pipeline": "synthetic",
            "stage_id": 0,
            "address": "http://10.9.9.9:1",
            "capacity": 1,
        }
        request = urllib.request.Request(
            f"{cp.url}/v1/instances",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 201
        assert PASSWORD not in cp.proc.stdout + cp.proc.stderr  # the URL is logged redacted
        assert ":***@" in cp.proc.stdout
    finally:
        cp.terminate()


async def test_password_without_tls(tmp_path: Path) -> None:
    port = free_port()
    proc = start_redis(tmp_path, port, ["--requirepass", PASSWORD], name="redis-pass")
    good = connect_redis(f"redis://:{PASSWORD}@127.0.0.1:{port}/1")
    anonymous = connect_redis(f"redis://127.0.0.1:{port}/1")
    try:
        assert await good.set("k", "v")
        assert await good.get("k") == "v"
        with pytest.raises(AuthenticationError):
            await anonymous.get("k")
    finally:
        await good.aclose()
        await anonymous.aclose()
        proc.cleanup()


async def test_unix_socket(tmp_path: Path) -> None:
    sock = tmp_path / "r.sock"
    proc = start_redis(tmp_path, 0, ["--unixsocket", str(sock)], name="redis-unix")
    try:
        redis = connect_redis(f"unix://{sock}?db=2")
        try:
            assert await redis.set("k", "v")
            assert await redis.get("k") == "v"
        finally:
            await redis.aclose()
    finally:
        proc.cleanup()


def test_cluster_node_refused_with_exit_2(tmp_path: Path) -> None:
    port = free_port()
    while port > 55535:  # a cluster node also listens on port + 10000
        port = free_port()
    node = start_redis(
        tmp_path, port, ["--cluster-enabled", "yes", "--cluster-config-file",
                         str(tmp_path / "nodes.conf")], name="redis-cluster-node",
    )  # fmt: skip
    try:
        cp = ManagedProcess(
            cp_argv(
                "serve", "--port", str(free_port()), "--redis-url", f"redis://127.0.0.1:{port}"
            ),
            name="cp-cluster",
            log_dir=tmp_path,
        ).start()
        assert cp.wait(30) == 2, cp.describe()
        lines = [line for line in cp.stderr.splitlines() if "omni-cp: error" in line]
        assert len(lines) == 1 and "Redis Cluster is not supported" in lines[0], cp.describe()
    finally:
        node.cleanup()


def test_cluster_scheme_refused_at_parse(tmp_path: Path) -> None:
    debian_binary("redis-server")
    cp = ManagedProcess(
        cp_argv("serve", "--redis-url", "redis+cluster://127.0.0.1:7000"),
        name="cp-cluster-url",
        log_dir=tmp_path,
    ).start()
    assert cp.wait(30) == 2
    assert "--redis-url / OMNI_CP_REDIS_URL: Redis Cluster is not supported" in cp.stderr
