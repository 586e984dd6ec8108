"""Model execution: the engine host and protocol, model families, what they share (DESIGN §2;
the folders: tests/engines/test_layering.py)."""

from omni_mesh.engines import moved

moved.install()  # old module paths (before the family folders) still import, with a warning
