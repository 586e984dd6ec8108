"""The run client's errors: one base class, a failed call, a stage with no URL."""

from __future__ import annotations


class RunClientError(RuntimeError):
    """A run could not complete; the message says which stage and why."""


class StageCallError(RunClientError):
    """A ``/v1/run`` call failed: an HTTP error answer, no answer, or an unusable one."""

    def __init__(self, stage: str, url: str, status: int | None, message: str) -> None:
        self.stage = stage
        self.url = url
        self.status = status
        self.message = message
        what = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"{stage} @ {url}: {what}: {message}")


class DiscoveryError(RunClientError):
    """No URL could be found for a stage."""
