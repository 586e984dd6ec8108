"""A stage split into prefill and decode pools (``prefill:``): the deploy field and its
layers, what it refuses (an empty pool, an engine that cannot split), and the processes
omni-up plans for it (the prefill pool with ``--role prefill``, the stage's ``num_replicas``
with ``--role decode``; autoscaled, the actuator takes over the decode pool only)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.loader import bundled_deploy_path, load_deploy_config
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.engines.base import EngineConfigError, EngineContext
from omni_mesh.engines.synthetic import SyntheticEngine
from omni_mesh.launcher import cli as cli_up
from omni_mesh.launcher import local_deploy
from omni_mesh.launcher.autoscale import StageActuator
from omni_mesh.launcher.supervised_child import RestartPolicy
from omni_mesh.launcher.supervisor import Supervisor

pytestmark = pytest.mark.unit


def test_the_prefill_pool_is_a_stage_field_with_its_layers(tmp_path: Path) -> None:
    overlay = tmp_path / "split.yaml"
    overlay.write_text(
        f"base_config: {bundled_deploy_path('tiny-llm')}\n"
        "stages: [{stage_id: 0, num_replicas: 2, prefill: {num_replicas: 1}}]\n"
    )
    pipeline = get_pipeline("tiny-llm")
    stage = load_deploy_config(overlay, pipeline).stage(0)
    assert stage.prefill is not None and stage.prefill.num_replicas == 1
    assert stage.num_replicas == 2
    over = {"0": {"prefill": {"num_replicas": 3}}}
    stage = load_deploy_config(overlay, pipeline, stage_overrides=over).stage(0)
    assert stage.prefill is not None and stage.prefill.num_replicas == 3
    assert load_deploy_config(None, pipeline).stage(0).prefill is None  # unsplit by default


def test_what_a_split_stage_refuses() -> None:
    with pytest.raises(ValidationError, match="num_replicas"):
        StageDeployConfig.model_validate({"stage_id": 0, "prefill": {"num_replicas": 0}})
    with pytest.raises(ValidationError, match="extra"):
        StageDeployConfig.model_validate({"stage_id": 0, "prefill": {"replicas": 1}})
    pipeline = get_pipeline("synthetic")
    config = StageDeployConfig.model_validate({"stage_id": 0, "prefill": {"num_replicas": 1}})
    ctx = EngineContext(pipeline=pipeline, stage=pipeline.stage(0), config=config)
    with pytest.raises(EngineConfigError, match="SyntheticEngine does not do"):
        SyntheticEngine(ctx)


def test_omni_up_plans_both_pools_of_a_split_stage(tmp_path: Path) -> None:
    overlay = tmp_path / "split.yaml"
    overlay.write_text(
        f"base_config: {bundled_deploy_path('tiny-llm')}\n"
        "stages: [{stage_id: 0, num_replicas: 2, prefill: {num_replicas: 1}}]\n"
    )
    config = cli_up.parse_args(["--pipeline", "tiny-llm", "--deploy-config", str(overlay)], {})
    assert config.prefill == {0: 1} and config.replicas == (2,)
    plans = local_deploy.plan_stages(config, "http://127.0.0.1:7700")
    roles = {p.name: p.argv[p.argv.index("--role") + 1] for p in plans if "--role" in p.argv}
    assert roles == {
        "stage0-llm-prefill-0": "prefill",
        "stage0-llm-decode-0": "decode",
        "stage0-llm-decode-1": "decode",
    }
    slots = {p.name: p.argv[p.argv.index("--replica-index") + 1] for p in plans if p.stage_id == 0}
    # the prefill pool's slots (slices of the stage's devices) follow the decode pool's
    assert slots == {"stage0-llm-prefill-0": "2", "stage0-llm-decode-0": "0",
                     "stage0-llm-decode-1": "1"}  # fmt: skip
    # Autoscaled: the actuator adopts the decode pool only and starts decode replicas.
    scaled = tmp_path / "scaled.yaml"
    scaled.write_text(
        f"base_config: {bundled_deploy_path('tiny-llm')}\n"
        "stages: [{stage_id: 0, num_replicas: 1, prefill: {num_replicas: 1},\n"
        "          autoscale: {min_replicas: 1, max_replicas: 3}}]\n"
    )
    config = cli_up.parse_args(["--pipeline", "tiny-llm", "--deploy-config", str(scaled)], {})
    plans = local_deploy.plan_stages(config, "http://127.0.0.1:7700")
    sup = Supervisor(log_dir=tmp_path / "logs")
    with StageActuator(
        sup, pipeline="tiny-llm", policies=config.autoscale, cp_url="http://127.0.0.1:1",
        plan_replica=lambda s, n, slot: local_deploy.plan_replica(config, "http://x:1", s, n,
                                                                  slot, role="decode"),
        env={}, restart=RestartPolicy(), poll_s=1.0,
    ) as actuator:  # fmt: skip
        children = [(p, object()) for p in plans if p.stage_id == 0]
        actuator.adopt(children)  # type: ignore[arg-type]
        assert len(actuator.pools[0].children) == 1  # the decode replica, not the prefill one
    assert [p.role for p in plans if p.stage_id == 0] == ["prefill", "decode"]
    assert [p.slot for p in plans if p.stage_id == 0] == [3, 0]  # after max_replicas 3
    unsplit = cli_up.parse_args(["--pipeline", "tiny-llm"], {})
    assert unsplit.prefill == {}
    assert all("--role" not in p.argv for p in local_deploy.plan_stages(unsplit, "http://x:1"))
