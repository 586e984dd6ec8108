"""Types shared by the configs tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

WriteYaml = Callable[[str, str], Path]
