"""The cache of tiny model folders, shared by the vLLM and transformers engines.

A tiny model is built by code in this repository the first time it is needed, into
``<cache>/<name>-v<version>``: once, when several processes of the machine need it together
(they wait on a lock file beside it; without file locks they race, the first atomic rename
wins). A stage's ``model`` is either such a name or an existing Hugging Face folder (with its
``config.json``, or a diffusers pipeline's ``model_index.json``): a real checkpoint takes the same
path as a tiny one.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

#: A folder holding one of these files is a model: a model's own config, or the index of a
#: diffusers pipeline's component folders (GLM-Image).
MARKERS = ("config.json", "model_index.json")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/omni-mesh/models``, else ``~/.cache/omni-mesh/models``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "omni-mesh" / "models"


def build_once(target: Path, write: Callable[[Path], None]) -> Path:
    """``target``, written by ``write(folder)`` into a staging folder and renamed into place
    unless it holds a model already (one of :data:`MARKERS`). Processes of one machine that
    need it at once (the pods of a deployment starting together) build it once: the others
    wait on a lock file beside it, then find it built."""
    if _is_model(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.parent / f".{target.name}.lock"
    try:  # readable and writable by all: a cache shared by several users
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError as exc:
        logger.warning("no build lock %s (%s): building without it", lock, exc)
        return _build(target, write)
    try:
        if not _locked(fd, lock):
            return _build(target, write)  # no locks here (NFS without a lock daemon)
        if _is_model(target):
            return target  # built by the process that held the lock
        return _build(target, write)
    finally:
        os.close(fd)  # releases the lock (so does the death of the process)


def _locked(fd: int, lock: Path, tick_s: float = 0.1, say_every: int = 300) -> bool:
    """Take the lock, saying every ``say_every`` ticks (30 s) what it waits for; False where
    locks are not supported."""
    ticks = 0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            ticks += 1
            if ticks % say_every == 0:
                logger.info("waiting %.0fs for another process building %s", ticks * tick_s, lock)
            time.sleep(tick_s)
        except OSError as exc:  # ENOLCK and kin
            logger.warning("cannot lock %s (%s): building without it", lock, exc)
            return False


def _build(target: Path, write: Callable[[Path], None]) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        try:
            staging.rename(target)
            logger.info("built tiny model %s", target)
        except OSError:  # another process finished first: keep its copy
            if not _is_model(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def existing_folder(model: str, tiny_names: Iterable[str], error: type[ValueError]) -> Path:
    """``model`` as an existing model folder; ``error`` naming the tiny names otherwise."""
    path = Path(model).expanduser()
    if not path.is_dir():
        names = ", ".join(sorted(tiny_names))
        raise error(
            f"model {model!r} is neither a tiny model ({names}) nor an existing model folder"
        )
    if not _is_model(path):
        raise error(f"model folder {str(path)!r} has no {' or '.join(MARKERS)}")
    return path.resolve()


def _is_model(folder: Path) -> bool:
    return any((folder / name).is_file() for name in MARKERS)
