"""handoff — moving 1, 16 and 64 MiB between two co-located stages, over the ``shm`` connector
and over the ``http`` connector, beside a memcpy of the same size measured in the same run.

Topology: omni-cp, one consumer pod of stage 2 and, for every (connector, size), one producer
pod of stage 1 of the ``synthetic`` pipeline whose engine outputs ``size`` bytes; the edge
1 → 2 uses the connector named in the pod's deploy YAML (``connectors:`` +
``output_connectors: {to_stage_2: shm|http}``). A baseline producer outputs 64 bytes.

The client calls the producer's ``/v1/hop`` at concurrency 1: the producer's engine writes
``size`` bytes, its sidecar hands them to the consumer, the consumer's engine takes them, and the
answer (64 bytes) comes back. Per request, hand-off time = client latency - the producer
engine's own step time (generating the synthetic bytes, reported back in the hop's timings) -
the median of the same for the 64-byte baseline. It therefore includes the engine's write into
its shared-memory slot and everything the fabric does to get the bytes to the consumer's engine:
for ``shm`` a handle (the consumer maps the slot, zero-copy; the synthetic consumer does not
read it), for ``http`` inline + msgpack encode + loopback HTTP + bounded body read + the copy into
the consumer's arena.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from statistics import median

import yaml

from benchmarks.common import Options, Report, hop_caller
from benchmarks.fabric import Fabric, Pod
from benchmarks.load import run_load
from benchmarks.measure import (
    MIB,
    RssReport,
    Target,
    fmt_ms,
    fmt_num,
    md_table,
    memcpy_gbps,
    ratio,
)
from benchmarks.profiling import Profiler
from omni_mesh.data_plane.messages import HopResult

SIZES_MIB = (1, 16, 64)
NOISE_S = 50e-6
CONNECTORS = ("shm", "http")


def deploy_yaml(directory: Path, connector: str) -> Path:
    """The bundled synthetic deploy config with the 1 → 2 edge on ``connector``."""
    doc = {
        "pipeline": "synthetic",
        "request_timeout_s": 120,
        "hop_retries": 2,
        "connectors": {
            "shm": {"name": "SharedMemoryConnector"},
            "http": {"name": "HttpConnector"},
        },
        "stages": [
            {"stage_id": 0, "output_connectors": {"to_stage_1": "shm"}},
            {
                "stage_id": 1,
                "input_connectors": {"from_stage_0": "shm"},
                "output_connectors": {"to_stage_2": connector},
            },
            {"stage_id": 2, "input_connectors": {"from_stage_1": connector}},
        ],
    }
    path = directory / f"synthetic-{connector}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


async def bench(opts: Options) -> Report:
    report = Report("handoff", "handoff: 1/16/64 MiB between co-located stages vs memcpy")
    reps = opts.repetitions()
    counts = {1: opts.pick(60, 20), 16: opts.pick(30, 10), 64: opts.pick(16, 6)}
    rss = RssReport()
    samples: dict[tuple[str, int], list[float]] = {}  # (connector, MiB) -> hand-off seconds
    base: list[float] = []
    memcpy: dict[int, list[float]] = {s: [] for s in SIZES_MIB}
    with tempfile.TemporaryDirectory(prefix="omni-bench-yaml-") as tmp, Fabric("handoff") as fab:
        configs = {c: deploy_yaml(Path(tmp), c) for c in CONNECTORS}
        fab.start_cp()
        fab.add_stage(2, wait=False, deploy_config=configs["shm"])
        producers: dict[tuple[str, int], Pod] = {}
        baseline = fab.add_stage(1, wait=False, deploy_config=configs["shm"])
        for conn in CONNECTORS:
            for size in SIZES_MIB:
                producers[(conn, size)] = fab.add_stage(
                    1,
                    wait=False,
                    deploy_config=configs[conn],
                    extra=["--output-bytes", str(size * MIB)],
                )
        fab.wait_ready()
        fab.wait_discovered(2, 1)
        rss.idle = fab.processes().rss()
        for pod in [baseline, *producers.values()]:  # warm-up: segments, mappings, pools
            await run_load(hop_caller(pod.url, 1, f"warm{pod.pid}"), concurrency=1, requests=4)
        for rep in range(reps):
            base += await _run(baseline, counts[1], f"b{rep}")
            for size in SIZES_MIB:
                memcpy[size].append(memcpy_gbps(size * MIB))
                for conn in CONNECTORS:
                    got = await _run(producers[(conn, size)], counts[size], f"{conn}{size}r{rep}")
                    samples.setdefault((conn, size), []).extend(got)
            print(f"[handoff] repetition {rep + 1}/{reps} done", flush=True)
        rss.loaded = fab.processes().rss()
        if opts.profile_dir is not None:
            await _profile(opts, fab, producers[("http", 64)], report)
    _tables(report, samples, base, memcpy, rss, reps)
    return report


async def _profile(opts: Options, fab: Fabric, producer: Pod, report: Report) -> None:
    """py-spy of both sidecars and the producer engine during 64 MiB http hand-offs."""
    assert opts.profile_dir is not None
    consumer = fab.stage_pods(2)[0]
    targets = {"handoff-http64-producer-sidecar": producer.pid}
    targets["handoff-http64-consumer-sidecar"] = consumer.pid
    engine = producer.engine_pid()
    if engine is not None:
        targets["handoff-http64-producer-engine"] = engine
    consumer_engine = consumer.engine_pid()
    if consumer_engine is not None:
        targets["handoff-http64-consumer-engine"] = consumer_engine
    seconds = 6.0
    prof = Profiler(targets, opts.profile_dir, seconds)
    if not prof.start():
        report.notes.append("py-spy not installed: no profile taken")
        return
    await run_load(hop_caller(producer.url, 1, "prof"), concurrency=1, duration_s=seconds)
    prof.wait()
    report.add(prof.summaries())


async def _run(pod: Pod, n: int, tag: str) -> list[float]:
    """Per request: client latency minus the producer engine's step time (seconds)."""
    engine_s: list[float] = []

    def keep(result: HopResult) -> None:
        producer = next(t for t in result.timings if t.stage_id == 1)
        engine_s.append(producer.engine_ms / 1e3)

    res = await run_load(hop_caller(pod.url, 1, tag, on_result=keep), concurrency=1, requests=n)
    res.check(f"handoff {tag}")
    # Latencies and engine times are recorded in the same order (concurrency 1); the result
    # callback also ran for the few requests outside the window: keep the last n.
    engine_s = engine_s[-len(res.latencies) :]
    return [lat - eng for lat, eng in zip(res.latencies, engine_s, strict=True)]


def _tables(
    report: Report,
    samples: dict[tuple[str, int], list[float]],
    base: list[float],
    memcpy: dict[int, list[float]],
    rss: RssReport,
    reps: int,
) -> None:
    base_s = median(base)
    rows = []
    figures: dict[tuple[str, int], tuple[float, float]] = {}
    for size in SIZES_MIB:
        mem = median(memcpy[size])
        for conn in CONNECTORS:
            t = median(samples[(conn, size)]) - base_s
            if t <= NOISE_S:  # a handle only: not measurably slower than the 64-byte chain
                figures[(conn, size)] = (math.inf, math.inf)
                rows.append([f"{size} MiB", conn, "~0 (in noise)", "-", fmt_num(mem, 2), "-"])
                continue
            gbps = size * MIB / t / 1e9
            figures[(conn, size)] = (gbps, ratio(gbps, mem))
            rows.append(
                [
                    f"{size} MiB",
                    conn,
                    fmt_ms(t, 2),
                    fmt_num(gbps, 2),
                    fmt_num(mem, 2),
                    f"{100 * ratio(gbps, mem):.0f}%",
                ]
            )
    report.add(
        md_table(
            ["payload", "connector", "hand-off ms (p50)", "GB/s", "memcpy GB/s", "of memcpy"],
            rows,
            title="Hand-off between two co-located stages",
            notes=(
                f"Medians over {reps} runs at concurrency 1 (64 MiB: {len(samples[('shm', 64)])} "
                f"hand-offs per connector). Baseline chain with a 64-byte payload: "
                f"{fmt_ms(base_s, 3)} ms (subtracted). memcpy: numpy copyto between two "
                "prefaulted buffers of the same size, in this process, in the same run."
            ),
        )
    )
    report.add(rss.table())
    _, shm_ratio = figures[("shm", 64)]
    http_gbps, _ = figures[("http", 64)]
    report.targets += [
        Target("shm hand-off 64 MiB, share of memcpy", shm_ratio * 100, 40, True, "%", _pct),
        Target("http hand-off 64 MiB loopback", http_gbps, 1.0, True, "GB/s", _gb),
    ]


def _pct(v: float) -> str:
    return f"{v:.0f}"


def _gb(v: float) -> str:
    return f"{v:.2f}"
