"""The deploy configs the README shows (whole YAML files, in ```yaml blocks or written by a
shell heredoc) load through the same loader a stage uses: a reader who copies one does not meet
a config error the page did not mention. Model folders are not checked (the real checkpoints
are not here); everything else is, the device counts included."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from omni_mesh.configs.loader import load_deploy_config
from omni_mesh.configs.registry import get_pipeline

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
_YAML_BLOCK = re.compile(r"```yaml\n(.*?)```", re.S)
_HEREDOC = re.compile(r"cat > \S+\.yaml <<'EOF'\n(.*?)\nEOF\n.*?--pipeline (\S+)", re.S)


def readme_configs() -> list[tuple[str, str]]:
    """(pipeline, YAML) of every whole deploy config on the page."""
    text = (ROOT / "README.md").read_text()
    found = []
    for block in _YAML_BLOCK.findall(text):
        name = re.match(r"pipeline: (\S+)", block)
        if name:  # a whole file, not an excerpt of one stage entry
            found.append((name.group(1), block))
    found += [(pipeline, body) for body, pipeline in _HEREDOC.findall(text)]
    return found


def test_the_readme_shows_its_gpu_configs() -> None:
    names = [name for name, _ in readme_configs()]
    assert {"qwen3-omni", "csm-tts", "glm-image", "tiny-llm"} <= set(names), names


@pytest.mark.parametrize(("pipeline", "body"), readme_configs())
def test_a_readme_config_loads(
    pipeline: str, body: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # base_config paths on the page are from the repository root
    path = tmp_path / "deploy.yaml"
    path.write_text(body.replace("base_config: omni_mesh/", f"base_config: {ROOT}/omni_mesh/"))
    config = load_deploy_config(path, get_pipeline(pipeline))
    assert config.stages
