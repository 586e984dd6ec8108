"""omni-mesh: a serving fabric for multi-stage model pipelines."""

__version__ = "0.1.0"
