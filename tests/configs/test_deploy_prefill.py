"""A stage split into prefill and decode pools (``prefill:``): the deploy field and its
layers, what it refuses (an empty pool, an engine that cannot split), and the processes
omni-up plans for it (the prefill pool with ``--role prefill``, the stage's ``num_replicas``
with ``--role decode``; autoscaled, the actuator takes over the decode pool, and the prefill
pool too when it has an ``autoscale:`` of its own, with its device slots after the decode
pool's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.errors import DeployConfigError
from omni_mesh.configs.loader import bundled_deploy_path, load_deploy_config
from omni_mesh.configs.registry import get_pipeline
from omni_mesh.control_plane.client import ScalePool
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
        plan_replica=lambda s, n, slot, pool: local_deploy.plan_replica(config, "http://x:1", s,
                                                                        n, slot, role="decode"),
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


SPLIT_SCALED = """\
stages:
  - stage_id: 0
    num_replicas: 1
    devices: "0,1,2,3,4,5"
    autoscale: {min_replicas: 1, max_replicas: 2}
    prefill:
      num_replicas: 2
      autoscale: {min_replicas: 1, max_replicas: 3, standby_replicas: 1}
"""


def test_the_prefill_pool_autoscales_with_a_policy_of_its_own(tmp_path: Path) -> None:
    overlay = tmp_path / "split.yaml"
    overlay.write_text(f"base_config: {bundled_deploy_path('tiny-llm')}\n{SPLIT_SCALED}")
    pipeline = get_pipeline("tiny-llm")
    stage = load_deploy_config(overlay, pipeline).stage(0)
    assert stage.prefill is not None and stage.prefill.autoscale is not None
    assert stage.prefill.autoscale.max_replicas == 3 and stage.prefill.num_replicas == 2
    assert stage.autoscale is not None and stage.autoscale.max_replicas == 2  # the decode pool's
    # decode: 2 slots (max_replicas); prefill: 3 (max_replicas) + 1 (standby), numbered after
    assert (stage.pool_slots, stage.prefill.device_slots, stage.device_slots) == (2, 4, 6)
    assert [stage.replica_devices(i) for i in (2, 5)] == [(2,), (5,)]
    # Layered like any field: --stage-overrides merges into the block.
    over = {"0": {"devices": None, "prefill": {"autoscale": {"target_utilization": 0.3}}}}
    stage = load_deploy_config(overlay, pipeline, stage_overrides=over).stage(0)
    assert stage.prefill is not None and stage.prefill.autoscale is not None
    assert stage.prefill.autoscale.target_utilization == 0.3
    assert stage.prefill.autoscale.max_replicas == 3  # the YAML's, kept


@pytest.mark.parametrize(
    ("prefill", "words"),
    [
        ({"num_replicas": 4, "autoscale": {"min_replicas": 1, "max_replicas": 3}},
         "prefill: num_replicas (4) is the starting count of an autoscaled prefill pool and must "
         "lie in [autoscale.min_replicas, autoscale.max_replicas] = [1, 3]"),
        ({"num_replicas": 1, "autoscale": {"min_replicas": 2, "max_replicas": 3}},
         "prefill: num_replicas (1) is the starting count"),
        ({"num_replicas": 1, "autoscale": {"min_replicas": 0, "max_replicas": 3}},
         "prefill: autoscale.min_replicas is 0, but a prefill pool cannot scale to zero"),
        ({"autoscale": {"min_replicas": 3, "max_replicas": 2}},
         "prefill.autoscale: max_replicas (2) must be at least min_replicas (3)"),
        ({"autoscale": {"target_utilization": 0}}, "prefill.autoscale.target_utilization"),
        ({"autoscale": {"max_replicaz": 3}}, "prefill.autoscale.max_replicaz: unknown key"),
    ],
)  # fmt: skip
def test_what_an_autoscaled_prefill_pool_refuses(prefill: dict[str, object], words: str) -> None:
    pipeline = get_pipeline("tiny-llm")
    with pytest.raises(DeployConfigError) as err:
        load_deploy_config(None, pipeline, stage_overrides={"0": {"prefill": prefill}})
    assert "stages[stage_id=0]." in str(err.value) and words in str(err.value), err.value


def test_an_autoscaled_prefill_pool_needs_devices_for_its_largest_size() -> None:
    pipeline = get_pipeline("tiny-llm")
    prefill = {"num_replicas": 1, "autoscale": {"max_replicas": 3, "standby_replicas": 1}}
    over = {"0": {"devices": "0,1,2", "prefill": prefill}}
    with pytest.raises(DeployConfigError) as err:
        load_deploy_config(None, pipeline, stage_overrides=over)
    msg = str(err.value)
    assert "stages[stage_id=0].devices: stage 0 lists 3 device(s) ('0,1,2') but needs 5" in msg
    assert (
        "(num_replicas 1 + prefill.autoscale.max_replicas 3 + "
        "prefill.autoscale.standby_replicas 1)" in msg
    )


def test_omni_up_hands_an_autoscaled_prefill_pool_to_the_actuator(tmp_path: Path) -> None:
    overlay = tmp_path / "split.yaml"
    overlay.write_text(f"base_config: {bundled_deploy_path('tiny-llm')}\n{SPLIT_SCALED}")
    config = cli_up.parse_args(["--pipeline", "tiny-llm", "--deploy-config", str(overlay)], {})
    assert config.prefill == {0: 2} and config.replicas == (1,)
    policy = AutoscaleConfig(min_replicas=1, max_replicas=3, standby_replicas=1)
    assert config.prefill_autoscale == {0: policy} and config.autoscaled
    assert config.prefill_first_slot(0) == 2  # after the decode pool's max_replicas 2
    plans = [
        p for p in local_deploy.plan_stages(config, "http://127.0.0.1:7700") if p.stage_id == 0
    ]
    assert [(p.role, p.slot) for p in plans] == [("prefill", 2), ("prefill", 3), ("decode", 0)]
    sup = Supervisor(log_dir=tmp_path / "logs")
    with StageActuator(
        sup, pipeline="tiny-llm", policies=config.autoscale, cp_url="http://127.0.0.1:1",
        prefill_policies={0: (policy, config.prefill_first_slot(0))},
        plan_replica=lambda s, n, slot, pool: plans[0], env={}, restart=RestartPolicy(),
        poll_s=1.0,
    ) as actuator:  # fmt: skip
        actuator.adopt([(p, object()) for p in plans])  # type: ignore[misc]
        prefill = actuator.prefill_pools[0]
        assert prefill.pool is ScalePool.PREFILL and prefill.where == "stage=0 pool=prefill"
        assert len(prefill.children) == 2 and prefill.next_replica == 2
        assert [slot for _, slot in prefill.slots] == [2, 3]
        assert len(actuator.pools[0].children) == 1  # the decode replica
    # A split stage whose prefill pool has no autoscale: keeps its size (not adopted).
    plain = cli_up.parse_args(
        ["--pipeline", "tiny-llm", "--deploy-config", str(overlay),
         "--stage-overrides", '{"0": {"devices": null, "prefill": {"autoscale": null}}}'], {}
    )  # fmt: skip
    assert plain.prefill == {0: 2} and plain.prefill_autoscale == {}
