"""``tiny-glm-image``: laid out as the real checkpoint, loadable by diffusers' own
``GlmImagePipeline.from_pretrained``, built the same on every machine, its AR unable to end an
image early; a folder that lacks a stage's part is a config error naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from omni_mesh.engines.base import EngineConfigError
from omni_mesh.engines.glm_image import tiny
from omni_mesh.engines.hf.folders import ensure_tiny_folder, resolve_folder
from tests.engines.helpers import make_engine

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PARTS = {
    "vision_language_encoder",
    "processor",
    "transformer",
    "vae",
    "text_encoder",
    "tokenizer",
    "scheduler",
}


def test_the_folder_is_laid_out_as_the_real_checkpoint() -> None:
    folder = resolve_folder("tiny-glm-image")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "GlmImagePipeline"
    assert {k for k in index if not k.startswith("_")} == PARTS
    assert index["vision_language_encoder"] == ["transformers", "GlmImageForConditionalGeneration"]
    assert index["transformer"] == ["diffusers", "GlmImageTransformer2DModel"]
    assert {p.name for p in folder.iterdir() if p.is_dir()} == PARTS
    config = json.loads((folder / "vision_language_encoder" / "config.json").read_text())
    # the end of image lies past the AR's head: a random model never stops early
    assert config["text_config"]["vision_vocab_size"] == tiny.CODEBOOK
    assert config["image_end_token_id"] >= tiny.CODEBOOK
    dit = json.loads((folder / "transformer" / "config.json").read_text())
    assert dit["prior_vq_quantizer_codebook_size"] == tiny.CODEBOOK


def test_every_build_writes_the_same_weights(tmp_path: Path) -> None:
    cached = resolve_folder("tiny-glm-image")
    fresh = ensure_tiny_folder("tiny-glm-image", tmp_path)
    files = sorted(p.relative_to(cached) for p in cached.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file())
    for name in files:
        assert (cached / name).read_bytes() == (fresh / name).read_bytes(), name
    staging = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith(".tiny")]
    assert not staging, "a staging folder was left"


def test_a_folder_without_a_stage_part_is_a_config_error(tmp_path: Path) -> None:
    folder = tmp_path / "glm"
    shutil.copytree(resolve_folder("tiny-glm-image"), folder)
    shutil.rmtree(folder / "vae")
    make_engine("glm-image", 0, model=str(folder))  # the AR needs no VAE
    with pytest.raises(EngineConfigError, match=r"has no vae/"):
        make_engine("glm-image", 1, model=str(folder))
    (folder / "model_index.json").unlink()
    with pytest.raises(EngineConfigError, match=r"config\.json or model_index\.json"):
        make_engine("glm-image", 0, model=str(folder))
