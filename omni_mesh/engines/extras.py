"""Engine knobs read from a stage's ``engine_extras`` with bounds: a value out of bounds is an
:class:`~omni_mesh.engines.base.EngineConfigError` naming the stage and the knob (``omni-stage``
exits 2 with it)."""

from __future__ import annotations

from omni_mesh.engines.base import EngineConfigError, EngineContext


def extra_int(ctx: EngineContext, name: str, default: int, lo: int, hi: int) -> int:
    """An integer engine knob from ``engine_extras`` (a config error if out of bounds)."""
    value = ctx.config.engine_extras.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise EngineConfigError(
            f"stage {ctx.stage.name!r} ({ctx.pipeline.name}): engine_extras.{name} must be an "
            f"integer in [{lo}, {hi}], got {value!r}"
        )
    return value


def extra_float(ctx: EngineContext, name: str, default: float, lo: float, hi: float) -> float:
    value = ctx.config.engine_extras.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise EngineConfigError(
            f"stage {ctx.stage.name!r} ({ctx.pipeline.name}): engine_extras.{name} must be a "
            f"number in [{lo}, {hi}], got {value!r}"
        )
    return float(value)


def extra_bool(ctx: EngineContext, name: str, default: bool) -> bool:
    """A true/false engine knob from ``engine_extras`` (a config error otherwise)."""
    value = ctx.config.engine_extras.get(name, default)
    if not isinstance(value, bool):
        raise EngineConfigError(
            f"stage {ctx.stage.name!r} ({ctx.pipeline.name}): engine_extras.{name} must be "
            f"true or false, got {value!r}"
        )
    return value
