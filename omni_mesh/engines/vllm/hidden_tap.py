"""Hidden states per request out of vLLM, without forking its model runner (issue 33).

vLLM's models that support EAGLE-3 can hand out auxiliary hidden states beside the last one:
``set_aux_hidden_state_layers(layers)`` makes the inner model return ``(hidden, [aux…])``, aux
``i`` being the residual stream after layer ``layers[i]`` (0: the input embeddings, multimodal
ones merged in). :func:`tapped` makes a subclass of such a model class that turns them on for
the layers a stage needs, copies them on every forward into one static buffer
``[layers, max_num_batched_tokens, hidden]`` and returns the bare hidden states vLLM's own runner
expects. It is registered with vLLM's model registry and chosen with ``hf_overrides``: no vLLM
class is patched.

:class:`StepRows` splits each engine step's rows by request. The rows of a step are laid out in
the order of ``ModelRunnerOutput.req_ids``, ``num_scheduled_tokens`` each, and the first one's
position is the request's ``num_computed_tokens`` before the step (which the scheduler output
carries for new and running requests alike). Wrapping the in-process scheduler's
``update_from_output`` (called once per step, after the forward, before the step's outputs are
made) hands every request its rows by position: a chunked prefill arrives in pieces, a
preempted request's recomputed positions overwrite the same rows with the same values. One copy
of the step's rows leaves the device; each request then copies only its own.

Requires what makes the buffer the step's: one model in this process (tensor parallel 1), no
asynchronous scheduling (the next forward would overwrite it first), no speculative decoding
(rows a draft adds), no prefix caching (cached positions are never computed, so never seen).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: ``sink(scheduler_request_id, first_position, rows)``: rows [layers, n, hidden] of one
#: request in one step (a view of the step's rows: copy what you keep).
RowSink = Callable[[str, int, torch.Tensor], None]


def tapped(base: Any, name: str, layers_of: Callable[[Any], tuple[int, ...]]) -> Any:
    """A subclass of vLLM model class ``base`` named ``name`` that taps the layers
    ``layers_of(hf_config)`` gives (module docstring). Its instances register themselves in
    ``cls.instances``."""

    def __init__(self: Any, *, vllm_config: Any, prefix: str = "") -> None:
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        layers = tuple(layers_of(vllm_config.model_config.hf_config))
        self.set_aux_hidden_state_layers(layers)
        tokens = vllm_config.scheduler_config.max_num_batched_tokens
        hidden = vllm_config.model_config.get_hidden_size()
        device = next(self.parameters()).device
        dtype = vllm_config.model_config.dtype
        self.tap = torch.zeros(len(layers), tokens, hidden, dtype=dtype, device=device)
        self.tap_rows = 0  # rows the last forward wrote
        type(self).instances.append(self)

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = base.forward(self, *args, **kwargs)
        if not isinstance(out, tuple):  # not the last pipeline rank: intermediate tensors
            return out
        hidden, aux = out
        rows = hidden.shape[0]
        for i, layer in enumerate(aux):
            self.tap[i, :rows].copy_(layer)
        self.tap_rows = rows
        return hidden

    return type(name, (base,), {"__init__": __init__, "forward": forward, "instances": []})


class StepRows:
    """Hands each request of every engine step its tapped rows (module docstring)."""

    def __init__(self, scheduler: Any, tap: Any, sink: RowSink) -> None:
        self.scheduler = scheduler
        self.tap = tap  # the tapped model instance
        self.sink = sink
        self._update = scheduler.update_from_output

    def install(self) -> None:
        self.scheduler.update_from_output = self._on_step

    def _on_step(self, scheduler_output: Any, runner_output: Any) -> Any:
        self.split(scheduler_output, runner_output)
        return self._update(scheduler_output, runner_output)

    def split(self, scheduler_output: Any, runner_output: Any) -> None:
        counts = scheduler_output.num_scheduled_tokens
        total = int(scheduler_output.total_num_scheduled_tokens)
        if total <= 0 or not runner_output.req_ids:
            return
        first = {r.req_id: int(r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        first.update(zip(cached.req_ids, map(int, cached.num_computed_tokens), strict=True))
        rows = self.tap.tap[:, :total].to("cpu")  # one copy off the device (none on a CPU)
        offset = 0
        for rid in runner_output.req_ids:
            n = int(counts.get(rid, 0))
            if n:
                self.sink(rid, first[rid], rows[:, offset : offset + n])
                offset += n
