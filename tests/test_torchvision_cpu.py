"""torchvision imports in this environment (issue 33): vLLM's Qwen3-Omni thinker needs its
pure-Python transforms, and PyPI's wheel (a CUDA build) has native ops that cannot load next to
torch+cpu. The hook (``omni_mesh/torchvision_cpu.py``, loaded by the venv's ``.pth`` and by the
engine process) lets it import; on a torch whose ops load, it changes nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

IMPORTS = (
    "import torchvision, transformers; "
    "from torchvision.transforms.v2 import functional; "
    "from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor; "
    "print(torchvision.__version__)"
)


def test_a_fresh_interpreter_imports_torchvision_and_the_qwen2_vl_processor() -> None:
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", IMPORTS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("0.")


def test_the_engine_process_installs_the_hook_itself() -> None:
    """Without the venv's .pth (``-S``: no site-packages hooks), the engine entry's call works;
    site-packages is put back on the path by hand."""
    import site

    paths = [p for p in site.getsitepackages() if "site-packages" in p]
    code = (
        "import sys; sys.path[:0] = " + repr(paths) + "; "
        "import omni_mesh.torchvision_cpu as t; assert not any("
        "type(f).__name__ == '_Hook' for f in sys.meta_path); t.install(); t.install(); "
        "assert sum(type(f).__name__ == '_Hook' for f in sys.meta_path) == 1; " + IMPORTS
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
