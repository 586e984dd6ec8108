"""``omni-cp`` as a command: embedded Redis lifecycle, signals, bad flags, ``status``."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from omni_mesh.control_plane import cli as cp_cli
from omni_mesh.control_plane.client import (
    ControlPlaneClient,
    InstanceUnknownError,
    LoadReport,
    RegisterRequest,
)
from tests.procs import (
    ControlPlaneProcess,
    ManagedProcess,
    child_pids,
    clean_env,
    cp_argv,
    free_port,
    http_status,
    pid_alive,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def run_cp(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cp_argv(*args), capture_output=True, text=True, timeout=30, env=clean_env(env)
    )


def main_in_process(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *args: str,
    env: dict[str, str] | None = None,
) -> tuple[int, str]:
    """``omni-cp ARGS`` through its ``main`` in this process, for argument errors (they end
    before any I/O, so a fresh interpreter per case would only add its start-up): the exit
    code and stderr. The environment is the test's without ``OMNI_*``, plus ``env``."""
    for key in [k for k in os.environ if k.startswith("OMNI_")]:
        monkeypatch.delenv(key)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    try:
        code = cp_cli.main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


def start_bare_serve(
    process_factory: Callable[..., ManagedProcess], tmp_dir: Path | None = None
) -> tuple[ManagedProcess, int, Path]:
    """``omni-cp serve`` with no arguments (the port from OMNI_CP_PORT); returns the process,
    its embedded redis-server pid and the (already removed) directory that server runs in.
    ``tmp_dir`` becomes omni-cp's TMPDIR."""
    port = free_port()
    env = {"OMNI_CP_PORT": str(port)}
    if tmp_dir is not None:
        env["TMPDIR"] = str(tmp_dir)
    proc = process_factory(cp_argv("serve"), name="omni-cp-bare", env=clean_env(env))
    line = proc.wait_for_output(r"omni-cp serving on (\S+) \(redis (\S+) embedded\)", 30)
    assert line.group(1) == f"http://127.0.0.1:{port}"
    proc.wait_http_ready(f"http://127.0.0.1:{port}/healthz")
    [redis_pid] = child_pids(proc.pid)
    redis_port = int(re.search(r":(\d+)/", line.group(2)).group(1))  # type: ignore[union-attr]
    title = Path(f"/proc/{redis_pid}/cmdline").read_bytes().decode(errors="replace")
    assert "redis-server" in title and f"127.0.0.1:{redis_port}" in title  # redis retitles argv
    with redis.Redis(port=redis_port, decode_responses=True) as client:
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
    cwd = os.readlink(f"/proc/{redis_pid}/cwd")  # redis chdirs into --dir ...
    assert cwd.endswith(" (deleted)"), f"{cwd}: removed as soon as redis answered"  # ... gone
    redis_dir = Path(cwd.removesuffix(" (deleted)"))
    assert redis_dir.name.startswith(f"omni-cp-redis-{proc.pid}-")
    assert not redis_dir.exists()
    if tmp_dir is not None:
        assert redis_dir.parent == tmp_dir
    return proc, redis_pid, redis_dir


def redis_dirs(tmp_dir: Path) -> list[str]:
    return sorted(p.name for p in tmp_dir.glob("omni-cp-redis-*"))


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")


def _is_redis(pid: int) -> bool:
    try:
        return "redis-server" in cmdline(pid)
    except OSError:  # gone meanwhile
        return False


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_serve_without_arguments_and_a_clean_shutdown(
    process_factory: Callable[..., ManagedProcess], signum: int
) -> None:
    proc, redis_pid, redis_dir = start_bare_serve(process_factory)
    url = proc.wait_for_output(r"serving on (\S+)").group(1)
    async with ControlPlaneClient([url]) as client:
        registration = await client.register(
            RegisterRequest(
                pipeline="tiny-tts", stage_id=0, address="http://127.0.0.1:9700", capacity=1
            )
        )
        assert (await client.instances("tiny-tts", 0)).instances[0].instance_id == (
            registration.instance_id
        )
    proc.send_signal(signum)
    assert await asyncio.to_thread(proc.wait, 15) == 0, proc.describe()
    assert not pid_alive(redis_pid), "the embedded redis-server outlived omni-cp"
    assert not redis_dir.exists(), "the embedded redis directory was not removed"
    assert "Traceback" not in proc.stderr


def test_embedded_redis_dies_with_a_killed_control_plane_and_leaves_no_directory(
    process_factory: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    tmp_dir = tmp_path / "tmp"
    tmp_dir.mkdir()
    proc, redis_pid, _ = start_bare_serve(process_factory, tmp_dir)
    assert redis_dirs(tmp_dir) == []
    proc.kill()
    wait_until(lambda: not pid_alive(redis_pid), 5, message="redis-server survived kill -9")
    assert redis_dirs(tmp_dir) == [], "kill -9 of omni-cp left an embedded-redis directory"


def test_stale_redis_directories_of_dead_owners_are_swept_at_start_up(
    process_factory: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    tmp_dir = tmp_path / "tmp"
    tmp_dir.mkdir()
    gone = dead_pid()
    stale = tmp_dir / f"omni-cp-redis-{gone}-abc123"  # omni-cp's pid in the name
    legacy = tmp_dir / "omni-cp-redis-k2j3h4g5"  # the older layout: redis's pid in its log
    in_use = tmp_dir / f"omni-cp-redis-{os.getpid()}-def456"  # owner alive: kept
    legacy_in_use = tmp_dir / "omni-cp-redis-q9w8e7r6"
    for path in (stale, legacy, in_use, legacy_in_use):
        path.mkdir()
    (stale / "dump.rdb").write_bytes(b"x")
    (legacy / "redis.log").write_text(f"{gone}:C 29 Nov 2026 11:45:21.150 # Redis is starting\n")
    (legacy_in_use / "redis.log").write_text(f"{os.getpid()}:M 29 Nov 2026 11:45:21.150 * x\n")
    proc, _, _ = start_bare_serve(process_factory, tmp_dir)
    assert redis_dirs(tmp_dir) == sorted([in_use.name, legacy_in_use.name])
    proc.terminate()


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["serve", "--port", "0"], None, "--port"),
        (["serve", "--port", "http"], None, "--port"),
        (["serve", "--no-such-flag"], None, "--no-such-flag"),
        (["serve", "--redis-url", "http://localhost:1"], None, "--redis-url"),
        (["serve", "--lease-ttl-ms", "500", "--heartbeat-interval-ms", "1000"], None,
         "lease_ttl_ms"),
        (["serve", "--log-level", "chatty"], None, "--log-level"),
        (["serve"], {"OMNI_CP_SWEEP_INTERVAL_MS": "lots"}, "OMNI_CP_SWEEP_INTERVAL_MS"),
        (["frobnicate"], None, "invalid choice"),
    ],
)  # fmt: skip
def test_bad_flags_exit_2_with_a_clear_message(
    args: list[str],
    env: dict[str, str] | None,
    needle: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # In process: an exception other than the parser's exit would fail the test here.
    code, err = main_in_process(monkeypatch, capsys, *args, env=env)
    assert code == 2, err
    assert needle in err, err
    assert "Traceback" not in err


def test_a_bad_flag_exits_2_from_the_real_process_too() -> None:
    result = run_cp("serve", "--lease-ttl-ms", "500", "--heartbeat-interval-ms", "1000")
    assert result.returncode == 2, result
    assert "lease_ttl_ms" in result.stderr and "Traceback" not in result.stderr


def test_no_command_prints_help_and_exits_2() -> None:
    result = run_cp()
    assert result.returncode == 2
    assert "serve" in result.stderr and "status" in result.stderr


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("omni-cp")
    if not script.exists():
        pytest.skip("omni-cp console script not installed in this environment")
    result = subprocess.run(
        [str(script), "serve", "--help"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0 and "--lease-ttl-ms" in result.stdout


def test_port_in_use_is_a_clear_error(control_plane: ControlPlaneProcess, redis_url: str) -> None:
    result = run_cp("serve", "--port", str(control_plane.port), "--redis-url", redis_url)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{control_plane.port}" in result.stderr


async def test_status_shows_a_table(control_plane: ControlPlaneProcess) -> None:
    async with ControlPlaneClient([control_plane.url]) as client:
        a = await client.register(
            RegisterRequest(
                pipeline="tiny-omni", stage_id=1, address="http://127.0.0.1:9801", capacity=4
            )
        )
        b = await client.register(
            RegisterRequest(
                pipeline="tiny-omni",
                stage_id=2,
                address="http://127.0.0.1:9802",
                capacity=2,
                host_id="gpu-7",
            )
        )
        await client.isolate(b.instance_id, reason="maintenance")
        api = await client.register(
            RegisterRequest(
                pipeline="tiny-omni",
                stage_id=0,
                address="http://127.0.0.1:9800",
                capacity=64,
                labels={"role": "api-only"},
                role="api",
            )
        )
        pool = await client.instances("tiny-omni", 0)  # an API server is never routed to
        assert pool.instances == ()
    result = await asyncio.to_thread(run_cp, "status", "--cp", control_plane.url)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].split() == [
        "PIPELINE", "STAGE", "ROLE", "INSTANCE", "STATE", "ADDRESS", "HOST", "LOAD",
        "HEARTBEAT-AGE", "REASON", "DESIRED",
    ]  # fmt: skip
    rows = [line.split() for line in lines[1:]]
    assert [r[:8] for r in rows] == [
        ["tiny-omni", "0", "api-only", api.instance_id, "healthy", "http://127.0.0.1:9800",
         "127.0.0.1", "0/64"],
        ["tiny-omni", "1", "-", a.instance_id, "healthy", "http://127.0.0.1:9801", "127.0.0.1",
         "0/4"],
        ["tiny-omni", "2", "-", b.instance_id, "isolated", "http://127.0.0.1:9802", "gpu-7",
         "0/2"],
    ]  # fmt: skip
    assert rows[1][9] == "-" and rows[2][9] == "maintenance"
    assert re.fullmatch(r"\d+\.\ds", rows[1][8])

    filtered = await asyncio.to_thread(
        run_cp, "status", "--pipeline", "tiny-tts", env={"OMNI_CP_URL": control_plane.url}
    )
    assert filtered.returncode == 0 and "no instances registered" in filtered.stdout


def test_status_exits_1_when_the_control_plane_is_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = run_cp("status", "--cp", url, "--timeout-s", "1")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"omni-cp status: cannot reach the control plane at {url}: connection refused"
    )


@pytest.mark.parametrize(
    "url", ["htp:/foo", "localhost:7700", "http://", "http://h:99999", "http://h:port", "x"]
)
def test_status_rejects_a_malformed_url_with_exit_2(
    url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = main_in_process(monkeypatch, capsys, "status", "--cp", url, "--timeout-s", "1")
    assert code == 2, err
    assert "--cp" in err and "invalid control-plane URL" in err
    assert repr(url) in err
    assert "unreachable" not in err and "Traceback" not in err
    env = {"OMNI_CP_URL": f"http://127.0.0.1:1,{url}"}
    code, err = main_in_process(monkeypatch, capsys, "status", env=env)
    assert code == 2 and "OMNI_CP_URL" in err, err


def test_status_rejects_a_malformed_url_from_the_real_process_too() -> None:
    result = run_cp("status", "--cp", "htp:/foo", "--timeout-s", "1")
    assert result.returncode == 2, result
    assert "invalid control-plane URL 'htp:/foo'" in result.stderr
    assert "Traceback" not in result.stderr


def test_status_with_a_wrong_token_exits_1(
    cp_factory: Callable[..., ControlPlaneProcess],
) -> None:
    cp = cp_factory(auth_token="right")
    result = run_cp("status", "--cp", cp.url, "--auth-token", "wrong")
    assert result.returncode == 1 and "401" in result.stderr
    ok = run_cp("status", "--cp", cp.url, env={"OMNI_CP_AUTH_TOKEN": "right"})
    assert ok.returncode == 0, ok.stderr


# ---- supervision of the embedded redis-server ---------------------------------------------


def next_redis_pid(proc: ManagedProcess, not_pid: int, timeout: float = 10.0) -> int:
    """The pid of omni-cp's redis-server child once it is another than ``not_pid`` (not any
    child: the ``ldconfig -p`` that ctypes.util.find_library runs before each spawn is one for
    a moment, and was taken for the new server)."""
    found: list[int] = []

    def restarted() -> bool:
        found[:] = [p for p in child_pids(proc.pid) if p != not_pid and _is_redis(p)]
        return bool(found)

    wait_until(restarted, timeout, message=lambda: f"redis not restarted\n{proc.describe()}")
    return found[0]


async def test_a_killed_embedded_redis_is_restarted_empty_and_instances_re_register(
    process_factory: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    tmp_dir = tmp_path / "tmp"
    tmp_dir.mkdir()
    proc, redis_pid, _ = start_bare_serve(process_factory, tmp_dir)
    url = proc.wait_for_output(r"serving on (\S+)").group(1)
    request = RegisterRequest(
        pipeline="tiny-tts", stage_id=0, address="http://127.0.0.1:9701", capacity=1
    )
    async with ControlPlaneClient([url], timeout_s=2.0) as client:
        registration = await client.register(request)
        os.kill(redis_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        new_pid = await asyncio.to_thread(next_redis_pid, proc, redis_pid)
        await asyncio.to_thread(
            wait_until, lambda: http_status(f"{url}/healthz") == 200, 5, message="healthz"
        )
        assert time.monotonic() - killed_at < 5.0
        redis_url = proc.wait_for_output(r"\(redis (\S+) embedded\)").group(1)
        assert redis_url.removesuffix("/0").removeprefix("redis://") in cmdline(new_pid), (
            "restarted on the same port"
        )
        # the data is gone: the old instance's heartbeat gets 404 -> the sidecar re-registers
        with pytest.raises(InstanceUnknownError):
            await client.heartbeat(registration.instance_id, LoadReport())
        again = await client.register(request)
        pool = await client.instances("tiny-tts", 0)
        assert [i.instance_id for i in pool.instances] == [again.instance_id]
    log = proc.stderr
    assert re.search(
        rf"ERROR omni_mesh\.control_plane\.server: embedded redis-server pid={redis_pid} died "
        r"unexpectedly \(killed by SIGKILL\); restarting it empty on port \d+",
        log,
    ), log
    # The restarted Redis's working dir goes as soon as it answers (just after healthz may).
    await asyncio.to_thread(
        wait_until, lambda: redis_dirs(tmp_dir) == [], 5, message=lambda: str(redis_dirs(tmp_dir))
    )
    proc.terminate()
    assert await asyncio.to_thread(proc.wait, 15) == 0
    assert not pid_alive(new_pid)


def test_an_embedded_redis_that_keeps_dying_makes_omni_cp_exit_non_zero(
    process_factory: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    tmp_dir = tmp_path / "tmp"
    tmp_dir.mkdir()
    proc, redis_pid, _ = start_bare_serve(process_factory, tmp_dir)
    pid = redis_pid
    for death in (1, 2):
        os.kill(pid, signal.SIGKILL)
        pid = next_redis_pid(proc, pid)
        assert f"({death}/3 deaths within 30s)" in proc.stderr
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(10) == 1, proc.describe()
    assert "died 3 times within 30s: giving up" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not pid_alive(pid)
    assert redis_dirs(tmp_dir) == []
