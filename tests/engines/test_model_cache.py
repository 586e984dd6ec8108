"""The tiny models' cache: processes of one machine that need a model at once build it once (a
deployment's pods start together), and a folder that is there is taken as it is."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omni_mesh.engines.model_cache import build_once

pytestmark = pytest.mark.unit

BUILDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from omni_mesh.engines.model_cache import build_once

    def write(folder: Path) -> None:
        with open(sys.argv[2], "a") as log:
            log.write("built\\n")
        time.sleep(0.5)  # long enough for the others to arrive while it builds
        (folder / "config.json").write_text("{}")

    print(build_once(Path(sys.argv[1]), write))
""")


def test_processes_that_need_a_model_at_once_build_it_once(tmp_path: Path) -> None:
    target, log = tmp_path / "models" / "tiny-x-v1", tmp_path / "builds.log"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILDER, str(target), str(log)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outs == [str(target)] * 3
    assert log.read_text() == "built\n"
    assert (target / "config.json").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == [".tiny-x-v1.lock", "tiny-x-v1"]


def test_a_built_folder_is_taken_as_it_is_and_a_failed_build_leaves_nothing(
    tmp_path: Path,
) -> None:
    target = tmp_path / "tiny-y-v1"

    def fail(folder: Path) -> None:
        (folder / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_once(target, fail)
    assert not target.exists() and [p.name for p in tmp_path.iterdir()] == [".tiny-y-v1.lock"]
    build_once(target, lambda folder: (folder / "config.json").write_text("{}"))
    assert build_once(target, fail) == target  # there: not built again
