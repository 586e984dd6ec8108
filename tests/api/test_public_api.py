"""The public API for users' pipelines (issue #32): ``omni_mesh.api`` exports what a plug-in
needs; a plug-in written against the old path (``omni_mesh.configs.pipeline``) or naming a
built-in engine by its old module still loads, warning with the new name."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import omni_mesh.api
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.engines.base import import_object
from omni_mesh.engines.qwen3_omni.talker import Qwen3OmniTalkerEngine
from tests.procs import clean_env

pytestmark = pytest.mark.unit

#: What a plug-in needs (the issue's list, and the errors and helpers its engines raise and use).
PLUGIN_NAMES = {
    "register_pipeline",
    "PipelineSpec",
    "StageSpec",
    "OutputKind",
    "StageEngine",
    "EngineRequest",
    "EngineResult",
    "StageData",
    "EngineContext",
    "EngineInputError",
    "EngineConfigError",
}

ENGINES = """
from collections.abc import Sequence

from {api} import EngineRequest, EngineResult, StageData, StageEngine


class Upper(StageEngine):
    uses_torch = False

    def load(self) -> None:
        pass

    def execute(self, batch: Sequence[EngineRequest]) -> list[EngineResult]:
        out = []
        for r in batch:
            text = str(r.data.fields["prompt"]).upper()
            out.append(EngineResult(r.request_id, output=StageData(fields={{"text": text}})))
        return out
"""

OLD_PLUGIN = """
from omni_mesh.configs.pipeline import OutputKind, PipelineSpec, StageSpec, register_pipeline

register_pipeline(PipelineSpec(name="{name}", stages=(StageSpec(
    stage_id=0, name="up", engine="{module}:Upper", final_output=OutputKind.TEXT),)))
"""

NEW_PLUGIN = """
from omni_mesh.api import OutputKind, PipelineSpec, StageSpec, register_pipeline

register_pipeline(PipelineSpec(name="{name}", stages=(StageSpec(
    stage_id=0, name="up", engine="{module}:Upper", final_output=OutputKind.TEXT),)))
"""


def test_the_api_exports_what_a_plugin_needs() -> None:
    assert set(omni_mesh.api.__all__) >= PLUGIN_NAMES
    for name in omni_mesh.api.__all__:
        assert getattr(omni_mesh.api, name) is not None


def test_importing_the_api_loads_no_torch_nor_network_stack() -> None:
    code = (
        "import sys, omni_mesh.api; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'aiohttp', 'redis', 'transformers', 'vllm'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _plugin(tmp_path: Path, name: str, source: str, api: str) -> str:
    (tmp_path / f"{name}_engines.py").write_text(ENGINES.format(api=api))
    module = f"{name}_pipes"
    text = source.format(name=name.replace("_", "-"), module=f"{name}_engines")
    (tmp_path / f"{module}.py").write_text(text)
    return module


def _load(tmp_path: Path, module: str) -> subprocess.CompletedProcess[str]:
    """Load the plug-in as every omni-mesh process does, run its engine once, in a fresh
    interpreter (warnings shown, as a user would see them)."""
    code = textwrap.dedent(f"""
        import logging, warnings
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        from omni_mesh.configs.deploy import StageDeployConfig
        from omni_mesh.configs.registry import get_pipeline, load_pipeline_modules
        from omni_mesh.engines.base import EngineContext, EngineRequest, StageData, import_object
        (name,) = load_pipeline_modules([{module!r}], entry_points=False)
        spec = get_pipeline(name)
        ctx = EngineContext(spec, spec.stage(0), StageDeployConfig(stage_id=0))
        engine = import_object(spec.stage(0).engine)(ctx)
        engine.load()
        data = StageData(fields={{"prompt": "hi"}})
        (result,) = engine.execute([EngineRequest("r1", 0, data)])
        print(name, result.output.fields["text"])
    """)
    env = clean_env({"PYTHONPATH": str(tmp_path)})
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_plugin_written_against_the_api_loads_without_warning(tmp_path: Path) -> None:
    module = _plugin(tmp_path, "new_api", NEW_PLUGIN, "omni_mesh.api")
    done = _load(tmp_path, module)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "new-api HI"
    assert "deprecated" not in done.stderr.lower(), done.stderr


def test_a_plugin_written_against_the_old_path_loads_and_warns(tmp_path: Path) -> None:
    module = _plugin(tmp_path, "old_api", OLD_PLUGIN, "omni_mesh.engines.base")
    done = _load(tmp_path, module)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "old-api HI"
    for name in ("OutputKind", "PipelineSpec", "StageSpec", "register_pipeline"):
        line = f"WARNING omni_mesh.configs.pipeline is deprecated: import {name} from omni_mesh.api"
        assert done.stderr.count(line) == 1, done.stderr  # logged once: an operator sees it


def test_the_old_path_gives_the_same_objects() -> None:
    with pytest.warns(DeprecationWarning, match="import register_pipeline from omni_mesh.api"):
        from omni_mesh.configs.pipeline import register_pipeline
    assert register_pipeline is omni_mesh.api.register_pipeline
    with pytest.warns(DeprecationWarning, match="import MAX_STAGES from .*pipeline_spec"):
        from omni_mesh.configs.pipeline import MAX_STAGES
    assert MAX_STAGES == 64
    with pytest.raises(ImportError, match="no_such_name"):
        from omni_mesh.configs.pipeline import no_such_name  # noqa: F401
    import omni_mesh.configs.pipeline as old_home

    assert {"PipelineSpec", "register_pipeline", "load_pipeline_modules"} <= set(old_home.__all__)
    assert "StageSpec" in dir(old_home)


def test_a_built_in_engine_named_by_its_old_module_still_loads() -> None:
    old = "omni_mesh.engines.hf.qwen3_omni_talker:Qwen3OmniTalkerEngine"
    with pytest.warns(DeprecationWarning, match=r"moved to omni_mesh\.engines\.qwen3_omni\.talker"):
        assert import_object(old) is Qwen3OmniTalkerEngine
    assert get_pipeline("qwen3-omni").stage(1).engine == (
        "omni_mesh.engines.qwen3_omni.talker:Qwen3OmniTalkerEngine"
    )


def test_old_engine_modules_and_names_still_import_warning_with_the_new_path() -> None:
    from omni_mesh.engines.torch_engine import TorchEngine

    with pytest.warns(DeprecationWarning, match=r"moved to omni_mesh\.engines\.kv\.exchange"):
        from omni_mesh.engines.hf import kv_exchange
    assert kv_exchange.__name__ == "omni_mesh.engines.kv.exchange"
    with pytest.warns(DeprecationWarning, match=r"reference\.common\.ReferenceEngine moved to"):
        from omni_mesh.engines.reference.common import ReferenceEngine
    assert ReferenceEngine is TorchEngine
    with pytest.warns(DeprecationWarning, match=r"moved to omni_mesh\.engines\.seeds\.derive_seed"):
        from omni_mesh.engines.reference.layers import derive_seed
    assert derive_seed("a") == derive_seed("a")
    with pytest.raises(ImportError):
        from omni_mesh.engines.reference.common import no_such_thing  # noqa: F401
