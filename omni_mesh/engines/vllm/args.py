"""A vLLM stage's engine arguments: assembled from the deploy config and checked before vLLM
starts.

``engine_args:`` of a stage are vLLM's own engine arguments (the fields of
``vllm.engine.arg_utils.EngineArgs``). Settings that are also stage fields (``max_num_seqs``,
``max_model_len``, ``dtype``, ``enforce_eager``, ``gpu_memory_utilization`` and the parallel
sizes) come from the stage fields only, so the existing flags and ``--stage-overrides`` reach
them one way; naming them in ``engine_args`` is an error that says so. ``model`` (and
``tokenizer``) may name a tiny model (:mod:`.tiny_models`) or must be an existing folder.

Every problem is an :class:`EngineConfigError` naming the key: ``omni-stage`` exits 2 with one
line, before vLLM builds anything.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_mesh.engines.base import EngineConfigError
from omni_mesh.engines.vllm.tiny_models import TinyModelError, resolve_model

if TYPE_CHECKING:
    from omni_mesh.configs.deploy import StageDeployConfig

#: vLLM arguments that are stage fields: set there (flags and overrides reach them there).
STAGE_FIELD_ARGS = (
    "max_num_seqs",
    "max_model_len",
    "dtype",
    "enforce_eager",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
)
#: Our defaults where vLLM's do not suit a stage engine (a request's seed is per request).
DEFAULTS: dict[str, Any] = {"enforce_eager": True, "disable_log_stats": True}


def engine_arg_fields() -> dict[str, dataclasses.Field[Any]]:
    """vLLM's engine arguments by name (imports vLLM: seconds)."""
    from vllm.engine.arg_utils import EngineArgs

    return {f.name: f for f in dataclasses.fields(EngineArgs)}


def build_engine_args(config: StageDeployConfig, cache_dir: Path | None = None) -> dict[str, Any]:
    """The keyword arguments of ``EngineArgs`` for a stage; raises EngineConfigError naming
    the first bad key."""
    where = f"stage {config.stage_id}: engine_args"
    args = dict(config.engine_args)
    for key in STAGE_FIELD_ARGS:
        if key in args:
            raise EngineConfigError(
                f"{where}.{key}: set the stage field {key!r} instead "
                "(the deploy config's stage entry, its flag or --stage-overrides)"
            )
    if not isinstance(args.get("model"), str):
        raise EngineConfigError(f"{where}.model: required (a model folder or a tiny model name)")
    for key in ("model", "tokenizer"):  # before importing vLLM: a typo costs no seconds
        if isinstance(args.get(key), str):
            try:
                args[key] = str(resolve_model(args[key], cache_dir))
            except TinyModelError as exc:
                raise EngineConfigError(f"{where}.{key}: {exc}") from None
    fields = engine_arg_fields()
    for key in sorted(args):
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise EngineConfigError(f"{where}.{key}: not a vLLM engine argument{hint}")
        _check_type(where, key, args[key], fields[key])
    stage_values = {key: getattr(config, key) for key in STAGE_FIELD_ARGS}
    defaults = dict(DEFAULTS)
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        defaults["distributed_executor_backend"] = "uni"  # the worker in this very process
    return {**defaults, **{k: v for k, v in stage_values.items() if v is not None}, **args}


def _check_type(where: str, key: str, value: Any, field: dataclasses.Field[Any]) -> None:
    """Reject a value whose type cannot be the argument's (scalars whose default says it)."""
    default = field.default
    if default is dataclasses.MISSING or default is None:
        return
    expected: tuple[type, ...] | None = None
    if isinstance(default, bool):
        expected = (bool,)
    elif isinstance(default, int):
        expected = (int,)
    elif isinstance(default, float):
        expected = (int, float)
    elif isinstance(default, str):
        expected = (str,)
    if expected is None:
        return
    wrong_bool = isinstance(value, bool) and bool not in expected
    if wrong_bool or not isinstance(value, expected):
        raise EngineConfigError(
            f"{where}.{key}: expected {expected[-1].__name__}, got {type(value).__name__} {value!r}"
        )


def make_vllm_config(args: dict[str, Any], stage_id: int) -> Any:
    """vLLM's own checks of the arguments (``EngineArgs.create_engine_config``): a VllmConfig,
    or an EngineConfigError with vLLM's message on one line."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        return EngineArgs(**args).create_engine_config()
    except (TypeError, ValueError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        message = " ".join(str(exc).split())
        raise EngineConfigError(
            f"stage {stage_id}: engine_args rejected by vLLM: {message}"
        ) from None
