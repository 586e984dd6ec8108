"""Users' own pipelines: --pipeline-module / OMNI_PIPELINE_MODULES / the omni_mesh.pipelines
entry-point group, and the one-line exit 2 for a module that fails or registers nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omni_mesh.configs.registry import (
    PipelineModuleError,
    load_pipeline_modules,
    pipeline_modules_from,
)
from tests.procs import clean_env

pytestmark = pytest.mark.unit

PIPELINE_SRC = """
from omni_mesh.configs.pipeline_spec import OutputKind, PipelineSpec, StageSpec
from omni_mesh.configs.registry import register_pipeline
register_pipeline(PipelineSpec(name="{name}", stages=(StageSpec(
    stage_id=0, name="only", engine="omni_mesh.engines.synthetic:SyntheticEngine",
    final_output=OutputKind.DATA),)))
"""


def test_flags_beat_the_environment() -> None:
    env = {"OMNI_PIPELINE_MODULES": "a.b, c ,a.b"}
    assert pipeline_modules_from(None, env) == ("a.b", "c")
    assert pipeline_modules_from(["x", "x", "y.z"], env) == ("x", "y.z")
    assert pipeline_modules_from(None, {}) == ()
    with pytest.raises(PipelineModuleError, match="'not a module': not a Python module name"):
        pipeline_modules_from(["not a module"], {})


def test_a_module_that_registers_nothing_or_fails_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "user_nothing.py").write_text("X = 1\n")
    (tmp_path / "user_broken.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    (tmp_path / "user_pipes.py").write_text(PIPELINE_SRC.format(name="user-one"))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PipelineModuleError, match="user_nothing: registered no pipeline"):
        load_pipeline_modules(["user_nothing"], entry_points=False)
    with pytest.raises(
        PipelineModuleError, match=r"user_broken: failed to import: RuntimeError: boom$"
    ):
        load_pipeline_modules(["user_broken"], entry_points=False)
    assert load_pipeline_modules(["user_pipes"], entry_points=False) == ("user-one",)
    assert load_pipeline_modules(["user_pipes"], entry_points=False) == ("user-one",)  # once


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = clean_env({"PYTHONPATH": str(tmp_path)})
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )


def test_entry_point_group_registers_installed_pipelines(tmp_path: Path) -> None:
    (tmp_path / "installed_pipes.py").write_text(PIPELINE_SRC.format(name="installed-one"))
    info = tmp_path / "installed_pipes-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: installed-pipes\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[omni_mesh.pipelines]\none = installed_pipes\n")
    code = textwrap.dedent("""
        from omni_mesh.configs.registry import get_pipeline, load_pipeline_modules
        print(load_pipeline_modules(), get_pipeline("installed-one").stage(0).name)
    """)
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "('installed-one',) only"


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        ("no_such_mod", "pipeline module no_such_mod: failed to import: ModuleNotFoundError"),
        ("json", "pipeline module json: registered no pipeline"),
    ],
)
def test_omni_stage_exits_2_with_one_line(module: str, expected: str) -> None:
    argv = [sys.executable, "-m", "omni_mesh.sidecar.cli_stage", "--pipeline-module", module,
            "--pipeline", "synthetic"]  # fmt: skip
    done = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith(f"omni-stage: error: {expected}"), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
