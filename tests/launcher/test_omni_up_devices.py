"""A stage's ``devices`` placed replica by replica: omni-up gives each replica its slot
(``--replica-index``), each pod gives its engine only its slot's slice of the stage's devices
(``CUDA_VISIBLE_DEVICES``), an autoscaled pool starts a new replica in a slot no running replica
holds, and a torch stage that lists devices on a machine without CUDA stops with exit 2, saying
so, rather than running on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from omni_mesh.configs.autoscale import AutoscaleConfig
from omni_mesh.launcher import autoscale
from omni_mesh.sidecar import cli_stage
from omni_mesh.sidecar.engine_link.client import EngineStartError, visible_devices
from tests.procs import ManagedProcess, clean_env, free_port
from tests.sidecar.topology import engine_pid

READY = r"omni-up ready: http://127\.0\.0\.1:\d+"
DEPLOY = """\
pipeline: synthetic
stages:
  - {stage_id: 1, num_replicas: 2, devices: "4,7"}
"""


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(item.split("=", 1) for item in raw if "=" in item)


def _pods(up: ManagedProcess) -> list[tuple[int, list[str]]]:
    pods = []
    for pid in Path(f"/proc/{up.pid}/task/{up.pid}/children").read_text().split():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if "omni_mesh.sidecar.cli_stage" in argv and "--headless" in argv:
            pods.append((int(pid), argv))
    return pods


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_each_replica_engine_sees_only_its_slice_of_the_stage_devices(tmp_path: Path) -> None:
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(DEPLOY)
    env = {k: v for k, v in clean_env().items() if k != "CUDA_VISIBLE_DEVICES"}
    argv = [sys.executable, "-m", "omni_mesh.launcher.cli", "--pipeline", "synthetic",
            "--port", str(free_port()), "--deploy-config", str(deploy)]  # fmt: skip
    with ManagedProcess(argv, name="omni-up", env=env, log_dir=tmp_path).start() as up:
        up.wait_for_output(READY, timeout=90)
        seen: dict[str, list[str | None]] = {}
        for pid, pod_argv in _pods(up):
            stage = pod_argv[pod_argv.index("--stage-id") + 1]
            visible = _environ(engine_pid(SimpleNamespace(pid=pid)))  # type: ignore[arg-type]
            seen.setdefault(stage, []).append(visible.get("CUDA_VISIBLE_DEVICES"))
        assert sorted(str(v) for v in seen["1"]) == ["4", "7"]  # one device each, by slot
        assert seen["0"] == [None] and seen["2"] == [None]  # no devices: untouched
        assert up.interrupt(timeout=60) == 0


def _child(returncode: int | None, *, retired: bool = False) -> Any:
    return SimpleNamespace(returncode=returncode, retiring_since=1.0 if retired else None)


@pytest.mark.unit
def test_a_new_replica_takes_a_slot_no_replica_holds() -> None:
    policy = AutoscaleConfig(min_replicas=1, max_replicas=3, standby_replicas=1)
    pool = autoscale.StagePool(1, policy)
    first, second, gone = _child(None), _child(None), _child(0, retired=True)
    pool.slots = [(first, 0), (gone, 1), (second, 2)]
    assert autoscale._free_slot(pool) == 1  # a retired replica that exited frees its slot
    crashed = _child(-9)  # waits for the supervisor to restart it, in the same slot
    pool.slots.append((crashed, 1))
    assert autoscale._free_slot(pool) == 3  # the standby's slot, not the crashed one's
    pool.slots.append((_child(None, retired=True), 3))  # retired, still draining
    assert autoscale._free_slot(pool) == 0  # every slot held: the least held
    assert [slot for _, slot in pool.slots] == [0, 2, 1, 3]  # exited retirees forgotten


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_torch_stage_listing_devices_without_cuda_exits_2_saying_so(tmp_path: Path) -> None:
    """Device 977 exists on no machine: torch sees no CUDA device through that slice."""
    env = {k: v for k, v in clean_env().items() if k != "CUDA_VISIBLE_DEVICES"}
    argv = [sys.executable, "-m", "omni_mesh.sidecar.cli_stage", "--pipeline", "qwen3-omni",
            "--stage-id", "2", "--headless", "--port", str(free_port()),
            "--stage-overrides", '{"2": {"devices": "977"}}']  # fmt: skip
    with ManagedProcess(argv, name="code2wav", env=env, log_dir=tmp_path).start() as pod:
        assert pod.wait(timeout=100) == 2
        assert "lists devices '977', but torch sees no CUDA device" in pod.stderr


@pytest.mark.unit
def test_a_replica_index_past_the_stage_slots_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    overrides = '{"1": {"devices": "0,1", "num_replicas": 2}}'  # one device each
    with pytest.raises(SystemExit) as exit_:
        cli_stage.main(["--pipeline", "synthetic", "--stage-id", "1", "--headless",
                        "--stage-overrides", overrides, "--replica-index", "2"])  # fmt: skip
    assert exit_.value.code == 2
    assert "no replica slot 2 (it has 2: 0 to 1)" in capsys.readouterr().err


@pytest.mark.unit
def test_devices_count_within_an_inherited_mask() -> None:
    """Under a scheduler's allocation (CUDA_VISIBLE_DEVICES set for the pod) a stage's
    devices are indices within it; without one, the machine's own."""
    assert visible_devices(1, (1, 2), None) == "1,2"
    assert visible_devices(1, (1,), "4,5") == "5"
    assert visible_devices(1, (0, 1), "GPU-a, GPU-b") == "GPU-a,GPU-b"
    with pytest.raises(EngineStartError, match=r"\[2\] is past it") as info:
        visible_devices(1, (1, 2), "4,5")
    assert info.value.config_error
