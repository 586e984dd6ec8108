"""A blocking ``generate()`` call advanced a piece at a time, so the core can interleave streams.

transformers' ``generate`` is one loop that returns when the sequence ends. To stream its output
(and let several requests' generations take turns, each with its own KV cache), the call runs in
a worker thread that never runs at the same time as its caller: :meth:`SteppedCall.advance` hands
control to the worker and blocks until the worker reaches a checkpoint where ``until()`` is true
(the streamer calls :meth:`checkpoint` after every generated token) or the call returns. Control
is strictly passed back and forth, so the process-wide state a generation leans on (the torch
RNG, a model's ``rope_deltas``) can be swapped in and out around each ``advance`` by the owner.

:meth:`close` ends a call early: the worker's next checkpoint raises :class:`Cancelled`, which
unwinds ``generate``, and the thread is joined.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import torch

from omni_mesh.engines.hf.common import seeded_rng


class Cancelled(Exception):
    """Raised inside the worker when its call was closed before it returned."""


class SteppedCall:
    """``fn(checkpoint)`` in a worker thread, run between checkpoints on demand."""

    def __init__(self, fn: Callable[[Callable[[], None]], Any], name: str) -> None:
        self._fn = fn
        self._go = threading.Semaphore(0)
        self._back = threading.Semaphore(0)
        self._until: Callable[[], bool] = lambda: True
        self._cancelled = False
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._started = False

    def _work(self) -> None:
        self._go.acquire()
        try:
            if not self._cancelled:
                with torch.inference_mode():
                    self.result = self._fn(self.checkpoint)
        except Cancelled:
            pass
        except BaseException as exc:  # handed to the caller of advance()
            self.error = exc
        finally:
            self.done = True
            self._back.release()

    def checkpoint(self) -> None:
        """Called by the worker: pause here if the caller has what it asked for."""
        if self._cancelled:
            raise Cancelled
        if self._until():
            self._back.release()
            self._go.acquire()
            if self._cancelled:
                raise Cancelled

    def advance(self, until: Callable[[], bool]) -> bool:
        """Run the call until ``until()`` holds at a checkpoint or it returns; True when done.
        Re-raises the call's exception."""
        if self.done:
            return True
        self._until = until
        if not self._started:
            self._started = True
            self._thread.start()
        self._go.release()
        self._back.acquire()
        if self.error is not None:
            raise self.error
        return self.done

    def close(self) -> None:
        """End the call (if it is still running) and join its thread."""
        if self._started and not self.done:
            self._cancelled = True
            self._go.release()
            self._thread.join()
        elif self._started:
            self._thread.join()


class CheckpointStreamer:
    """A generate() streamer that calls ``checkpoint`` after each new token (not the prompt),
    after handing the token to ``on_token`` when given."""

    def __init__(
        self, checkpoint: Callable[[], None], on_token: Callable[[int], None] | None = None
    ) -> None:
        self._checkpoint = checkpoint
        self._on_token = on_token
        self._seen_prompt = False

    def put(self, value: Any) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        if self._on_token is not None:
            self._on_token(int(value.reshape(-1)[0]))
        self._checkpoint()

    def end(self) -> None:
        pass


@dataclass
class TurnState:
    """What one request's generation keeps between its turns: its torch RNG states (the CPU's,
    and the CUDA device's it samples on, if any) and the model attributes ``generate()`` leaves
    on the module for the next step (``rope_deltas``)."""

    rng: torch.Tensor
    attrs: dict[str, Any]
    device: torch.device | None = None
    cuda_rng: torch.Tensor | None = None

    @classmethod
    def start(
        cls, seed: int, names: Sequence[str], device: torch.device | None = None
    ) -> TurnState:
        """A fresh state: the RNGs as ``torch.manual_seed(seed)`` leaves them, attributes
        None."""
        cuda = device if device is not None and device.type == "cuda" else None
        with seeded_rng(seed, cuda):
            rng = torch.get_rng_state()
            cuda_rng = torch.cuda.get_rng_state(cuda) if cuda is not None else None
        return cls(rng, dict.fromkeys(names), cuda, cuda_rng)


def take_turn(call: SteppedCall, state: TurnState, model: Any, until: Callable[[], bool]) -> bool:
    """``call.advance(until)`` with the request's RNGs and model attributes swapped in (and the
    caller's put back after); True when the call has returned."""
    saved = torch.get_rng_state()
    torch.set_rng_state(state.rng)
    cuda = state.device
    saved_cuda = torch.cuda.get_rng_state(cuda) if cuda is not None else None
    if cuda is not None and state.cuda_rng is not None:
        torch.cuda.set_rng_state(state.cuda_rng, cuda)
    for name, value in state.attrs.items():
        setattr(model, name, value)
    try:
        return call.advance(until)
    finally:
        for name in state.attrs:
            state.attrs[name] = getattr(model, name)
        state.rng = torch.get_rng_state()
        torch.set_rng_state(saved)
        if cuda is not None and saved_cuda is not None:
            state.cuda_rng = torch.cuda.get_rng_state(cuda)
            torch.cuda.set_rng_state(saved_cuda, cuda)


def has_at_least(items: Sized, n: int) -> Callable[[], bool]:
    """An ``until`` for :func:`take_turn`: true once ``items`` holds ``n`` entries."""
    return lambda: len(items) >= n
