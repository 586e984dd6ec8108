"""Wire constants of the data path, one home each (importable without aiohttp: engines too)."""

from __future__ import annotations

#: Content types of data-path HTTP bodies.
JSON = "application/json"
MSGPACK = "application/msgpack"
#: A streamed hop answer: :mod:`~omni_mesh.data_plane.framing` frames of msgpack ``HopResult``.
HOP_FRAMES = "application/x-omni-hop-frames"

#: Tensors up to this many bytes travel inline in a message; larger ones through shared memory.
INLINE_MAX = 4096

#: Environment variable naming an engine process's own temp folder (its $TMPDIR, made by its
#: sidecar): the sidecar removes it when the engine ends, the engine when it exits (so a
#: sidecar killed with -9 leaves nothing either: its engine gets SIGTERM and exits).
ENGINE_TMP_ENV = "OMNI_ENGINE_TMP"
#: In an engine's temp folder: shared-memory segments its libraries made that outlive their
#: processes (vLLM's CPU workers), one name per line, removed with the folder.
ENGINE_SEGMENTS_FILE = "shm-segments"
#: The GPUs an engine process sees: its sidecar sets it to the replica's slice of the stage's
#: ``devices`` (they appear in the engine as cuda:0, cuda:1, …; vLLM and torch read it).
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
