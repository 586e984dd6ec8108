"""One qwen3-omni topology (1:2:1, omni-cp, an API server; the thinker on transformers) for
every test module here that needs it: started by the first, closed when the run leaves this
folder (a topology takes ~20 s to start on 2 cores; the chat and the realtime tests share
it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_mesh.configs.loader import bundled_deploy_path
from tests.sidecar.topology import Topology

QWEN3_OMNI = "qwen3-omni"
_HERE = Path(__file__).parent
_SHARED: dict[str, Topology] = {}


def _close_shared() -> None:
    for top in _SHARED.values():
        top.close()
    _SHARED.clear()


#: The bundled config with its thinker on transformers: its ``backend: auto`` picks vLLM here,
#: whose thinker the vLLM modules serve (test_qwen3_omni_vllm_*.py, test_qwen3_omni_whole.py);
#: the realtime cancel tests slice the thinker's process to hold a response in every stage,
#: which they were made to hold under load for this thinker.
OVERLAY = """\
base_config: {bundled}
stages:
  - stage_id: 0
    engine_extras: {{backend: transformers}}
"""


@pytest.fixture(scope="session")
def qwen3_omni_topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    log_dir = tmp_path_factory.mktemp(QWEN3_OMNI)
    overlay = log_dir / "transformers-thinker.yaml"
    overlay.write_text(OVERLAY.format(bundled=bundled_deploy_path(QWEN3_OMNI)))
    # spans on stderr: the realtime tests read a cancel's acknowledgement at every stage
    config = ["--deploy-config", str(overlay), "--tracing", "console"]
    top = Topology(QWEN3_OMNI, [1, 2, 1], log_dir, extra_stage_args=config)
    _SHARED[QWEN3_OMNI] = top
    try:
        top.start()
        for stage_id, count in enumerate(top.replicas):
            top.wait_discovered(stage_id, count, timeout=120)
        yield top
    finally:
        _close_shared()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The shared topology goes when the next test is not in this folder."""
    if _SHARED and (nextitem is None or _HERE not in nextitem.path.parents):
        _close_shared()
