"""The pure helpers of the glm-image benchmark: a phase's figures, the better monolith, the
deploy files it writes, its registration. No server started (``python -m benchmarks image
--quick`` runs it whole)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchmarks import NAMES
from benchmarks.__main__ import MODULES
from benchmarks.image import MONO, Answer, Phase, best_mono, deploy_file

pytestmark = pytest.mark.unit


def test_a_phases_figures() -> None:
    phase = Phase("omni-mesh 1:2", 8, wall_s=2.0)
    phase.answers = [Answer(0.2, 1.0), Answer(0.4, 2.0), Answer(0.3, 1.5)]
    assert phase.images_per_s == pytest.approx(1.5)
    assert phase.total(50) == pytest.approx(1.5) and phase.first(50) == pytest.approx(0.3)


def test_the_better_monolith_by_throughput_or_latency() -> None:
    one, two = Phase(f"{MONO}, 1 thread", 8, wall_s=4.0), Phase(f"{MONO}, 2 threads", 8, wall_s=2.0)
    one.answers = [Answer(1.0, 1.0)] * 4
    two.answers = [Answer(3.0, 3.0)] * 4
    ours = Phase("omni-mesh 1:2", 8, wall_s=0.5)
    ours.answers = [Answer(0.1, 0.1)] * 4
    assert best_mono([one, two, ours], 8, key="throughput") is two
    assert best_mono([one, two, ours], 8, key="latency") is one


def test_deploy_files_set_the_dit_replicas_and_batch_steps(tmp_path: Path) -> None:
    plain = yaml.safe_load(deploy_file(2, tmp_path).read_text())
    batched = yaml.safe_load(deploy_file(2, tmp_path, batch_steps=True).read_text())
    for config in (plain, batched):
        ar, dit = config["stages"]
        assert (ar["num_replicas"], dit["num_replicas"]) == (1, 2)
    assert "batch_steps" not in plain["stages"][1]["engine_extras"]
    assert batched["stages"][1]["engine_extras"]["batch_steps"] is True


def test_it_is_registered() -> None:
    assert "image" in NAMES and MODULES["image"] == "benchmarks.image"
