"""omni-mesh benchmarks: the fabric's cost against the physical limit and against Ray Serve.

``python -m benchmarks NAME [--quick]`` runs one (``all`` runs every one; ``make bench`` runs
them all and rewrites the generated part of ``docs/benchmarks.md``). Each prints markdown
tables; each figure is the median of several runs, and every comparison is a ratio measured in
the same run. Every process a benchmark starts is stopped at its end, also on error or Ctrl-C.

| name | module | what |
|---|---|---|
| hop | :mod:`benchmarks.hop` | latency/throughput of 1-3 stage no-op chains vs raw aiohttp |
| handoff | :mod:`benchmarks.handoff` | 1/16/64 MiB hand-offs over shm and http vs memcpy |
| scaling | :mod:`benchmarks.scaling` | 1:N:1 with a 50 ms middle stage, N = 1, 2, 4, 8 |
| control-plane | :mod:`benchmarks.control_plane` | heartbeats, watch propagation, kill -9 |
| peer | :mod:`benchmarks.peer` | the same pipelines on Ray Serve (separate venv) |
| streaming | :mod:`benchmarks.streaming` | async_chunk: time to first audio, cost per chunk |
| autoscale | :mod:`benchmarks.autoscale` | omni-up autoscaling: step + square wave, cold start |
| overload | :mod:`benchmarks.overload` | past capacity: closed/open loop, fairness, shedding |
| vllm | :mod:`benchmarks.vllm` | a tiny-llm vLLM stage vs vllm serve; tiny-omni-vllm first audio |
| omni | :mod:`benchmarks.omni` | qwen3-omni streamed speech vs transformers' whole model |
| realtime | :mod:`benchmarks.realtime` | first audio, barge-in, session memory, a kill |
| pd | :mod:`benchmarks.pd` | prefill/decode split 1P:1D vs 2 unsplit replicas, mixed load |
| pd-thinker | :mod:`benchmarks.pd_thinker` | the same for qwen3-omni's thinker (transformers) |
| omni-handoff | :mod:`benchmarks.omni_handoff` | qwen3-omni first audio vs answer length |
| omni-thinkers | :mod:`benchmarks.omni_thinkers` | qwen3-omni's thinker: vLLM vs transformers |
| vllm-core | :mod:`benchmarks.vllm_core` | the vLLM stage's engine path vs LLMEngine alone |
| image | :mod:`benchmarks.image` | glm-image 1:1 and 1:2 vs GlmImagePipeline one at a time |
| service | :mod:`benchmarks.service` | session affinity's TTFT gain; the usage accounting's cost |
"""

NAMES = (
    "hop",
    "handoff",
    "scaling",
    "control-plane",
    "peer",
    "streaming",
    "autoscale",
    "overload",
    "vllm",
    "omni",
    "realtime",
    "pd",
    "pd-thinker",
    "omni-handoff",
    "omni-thinkers",
    "vllm-core",
    "image",
    "service",
)
