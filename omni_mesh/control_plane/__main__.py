"""``python -m omni_mesh.control_plane`` = ``omni-cp``."""

from __future__ import annotations

import sys

from omni_mesh.control_plane.cli import main

if __name__ == "__main__":
    sys.exit(main())
