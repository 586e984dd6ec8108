"""The pipeline-wide settings every pod of one pipeline must agree on, as a small mapping the
control plane compares at registration (a pod that disagrees with the pods already registered
is refused with a 409 naming the setting)."""

from __future__ import annotations

import hashlib

from omni_mesh.configs.deploy import DeployConfig
from omni_mesh.configs.pipeline_spec import PipelineSpec

__all__ = ["pipeline_fingerprint"]


def pipeline_fingerprint(pipeline: PipelineSpec, deploy: DeployConfig) -> dict[str, str]:
    """``{"async_chunk": "true", "stages": "<digest>"}``: the streaming mode, and a digest of the
    pipeline's stage list (ids, names, engine classes, sources, processors, final outputs), so
    two versions of a user's pipeline module are told apart."""
    stages = ";".join(
        f"{s.stage_id}:{s.name}:{s.engine}:{','.join(map(str, s.sources))}:"
        f"{s.processor or ''}:{s.final_output or ''}"
        for s in sorted(pipeline.stages, key=lambda s: s.stage_id)
    )
    digest = hashlib.sha256(stages.encode()).hexdigest()[:16]
    return {"async_chunk": "true" if deploy.async_chunk else "false", "stages": digest}
