"""torchvision beside a CPU-only torch: vLLM's Qwen3-Omni thinker (and transformers' Qwen2-VL
image processor it imports) need ``torchvision.transforms``, pure Python.

The only torchvision wheel on PyPI for x86_64 Linux is a CUDA build. Next to ``torch+cpu`` its
native ops (``_C.so``) cannot load, which torchvision tolerates, except that its
``_meta_registrations`` registers fake kernels for ``torchvision::nms`` and ``::qnms`` without
checking, and fails: ``import torchvision``, and every ``import transformers`` that reaches it,
raise "operator torchvision::nms does not exist". :func:`install` adds an import hook that,
when ``torchvision`` is first imported and its native ops do not load, defines those two ops'
schemas first, so the import succeeds; the ops themselves stay unavailable (nothing here uses
them). Where the native ops load (a CUDA torch), it does nothing.

``make install`` puts a ``.pth`` file in the virtual environment that calls :func:`install`
in every interpreter; the engine process calls it too (``engines/__main__.py``). Cheap: nothing
is imported until something imports torchvision.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

#: The ops torchvision registers fake kernels for without checking that they exist.
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_kept: list[Any] = []  # the stub library: torch drops its definitions when it is collected


class _Hook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: prepares torch before the real finder loads torchvision."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torchvision":
            return None
        uninstall()
        spec = importlib.util.find_spec("torchvision")
        if spec is not None and spec.origin is not None:
            prepare(Path(spec.origin).parent)
        return spec


def install() -> None:
    """Add the hook (once); a no-op when torchvision is imported already."""
    if "torchvision" in sys.modules or any(isinstance(f, _Hook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Hook())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Hook)]


def prepare(folder: Path) -> bool:
    """Define the stub schemas when torchvision's native ops (``folder/_C*.so``) do not load;
    True when it did."""
    import torch

    native = next(iter(sorted(folder.glob("_C*.so"))), None)
    if native is not None:
        try:
            torch.ops.load_library(str(native))  # type: ignore[no-untyped-call]
            return False  # they load: torchvision is whole
        except OSError:
            pass
    if hasattr(torch.ops.torchvision, "nms"):
        return False
    lib: Any = torch.library.Library("torchvision", "DEF")  # type: ignore[no-untyped-call]
    for schema in SCHEMAS:
        lib.define(schema)
    _kept.append(lib)
    return True
