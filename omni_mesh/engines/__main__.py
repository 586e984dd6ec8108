"""Entry point of an engine process: ``python -m omni_mesh.engines …``.

Started by the stage sidecar, never by hand: it inherits one end of a Unix socket pair
(``--channel-fd``) and receives its stage configuration as JSON. It imports the same pipeline
modules as its sidecar (``--pipeline-module``, else ``$OMNI_PIPELINE_MODULES``, which omni-stage
sets for it, plus the ``omni_mesh.pipelines`` entry points) before it looks its pipeline up.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from omni_mesh.configs.deploy import StageDeployConfig
from omni_mesh.configs.registry import get_pipeline, load_pipeline_modules, pipeline_modules_from
from omni_mesh.data_plane.channel import BlockingChannel
from omni_mesh.engines.base import EngineContext
from omni_mesh.engines.process import EngineProc, remove_own_tmp


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="omni-engine", description=__doc__)
    p.add_argument("--pipeline", required=True)
    p.add_argument("--stage-id", type=int, required=True)
    p.add_argument("--channel-fd", type=int, required=True)
    p.add_argument("--config-json", required=True, help="StageDeployConfig as JSON")
    p.add_argument("--peer-shm-prefix", default=None)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--async-chunk",
        action="store_true",
        help="the pipeline streams chunks between stages: engines may emit their output in chunks",
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--pipeline-module", action="append", metavar="MODULE")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s engine[{args.stage_id}] %(name)s: %(message)s",
    )
    from omni_mesh.data_plane.memory import tune_malloc
    from omni_mesh.torchvision_cpu import install as torchvision_importable

    tune_malloc()
    torchvision_importable()  # a venv made without `make install` has no .pth calling it
    load_pipeline_modules(pipeline_modules_from(args.pipeline_module, os.environ))
    pipeline = get_pipeline(args.pipeline)
    config = StageDeployConfig.model_validate_json(args.config_json)
    ctx = EngineContext(
        pipeline=pipeline,
        stage=pipeline.stage(args.stage_id),
        config=config,
        device="cuda" if config.devices else "cpu",  # its slice only: CUDA_VISIBLE_DEVICES
        async_chunk=args.async_chunk,
    )
    sock = socket.socket(fileno=args.channel_fd)
    proc = EngineProc(
        ctx, BlockingChannel(sock), peer_shm_prefix=args.peer_shm_prefix, torch_threads=args.threads
    )
    try:
        code = proc.run()
    finally:
        remove_own_tmp()
    if code != 0:  # the load failed (close() never ran): leave by the interpreter's teardown
        return code
    # Stopped cleanly: the engine closed (vLLM's executor and its workers included) and freed
    # its shared memory; what is left the OS frees. The interpreter's own teardown (vLLM's and
    # NIXL's finalizers, a large heap) took seconds of every drain, so it is skipped.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
