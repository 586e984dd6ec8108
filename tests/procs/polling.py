"""Process and polling utilities: waiting for a condition, whether a pid lives, a process
tree, an HTTP status, a clean environment, leaked shared memory."""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

# ---- small utilities -------------------------------------------------------------------------


def wait_until(
    predicate: Callable[[], object],
    timeout: float,
    *,
    interval: float = 0.05,
    message: str | Callable[[], str] = "condition not met",
) -> None:
    """Poll ``predicate`` until truthy; AssertionError with ``message`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout}s: {text}")
        time.sleep(interval)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ..." - comm may contain spaces and parentheses
    return raw[raw.rindex(")") + 2 :].split()


def pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid``: children, grandchildren, … (Linux)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            out.add(k)
            todo.append(k)
    return out


def child_pids(pid: int) -> list[int]:
    """Live direct children of ``pid`` (scans /proc; Linux)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                children.append(int(entry.name))
    return sorted(children)


def http_status(url: str, *, timeout: float = 1.0, headers: Mapping[str, str] | None = None) -> int:
    """Status code of a GET, or 0 when the server cannot be reached."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def clean_env(
    extra: Mapping[str, str] | None = None, *, drop_prefixes: Iterable[str] = ("OMNI_",)
) -> dict[str, str]:
    """The test process's environment without ``OMNI_*`` variables, plus ``extra``."""
    prefixes = tuple(drop_prefixes)
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def orphaned_shm_segments(directory: str = "/dev/shm") -> set[str]:
    """``omni-{pid}-…`` segments whose owner process is gone: leaked shared memory.

    Segments of live processes are working memory, not leaks, so tests running beside others
    (or beside a benchmark) do not see each other's segments as leaks."""
    leaked = set()
    for path in Path(directory).glob("omni-*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            leaked.add(path.name)
    return leaked
