"""What the autoscaling tests through ``omni-up`` with an autoscaled stage (stage 1 of the
synthetic pipeline unless told otherwise) share: the deployment (:func:`autoscaled_up`, stopped
with SIGTERM and checked for leftover processes and shared memory), the autoscaled pool as the
control plane and omni-up's children show it (:meth:`Up.sample`), and a timeline of it sampled
on a thread (:class:`Timeline`)."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.procs import ManagedProcess, clean_env, descendants, free_port, pid_alive
from tests.sidecar.topology import post_json, shm_segments

READY = r"omni-up ready: http://127\.0\.0\.1:\d+"
PIPELINE = "synthetic"


@dataclass(frozen=True)
class Sample:
    """The autoscaled pool as the control plane and omni-up's children show it at one time."""

    t: float  # seconds since the timeline started
    desired: int
    ready: int
    reason: str  # of the last decision
    utilization: float
    queue_wait_ms: float | None
    pods: int
    first_audio_p95_ms: float | None = None
    realtime_factor_p5: float | None = None


class Up:
    def __init__(
        self,
        proc: ManagedProcess,
        port: int,
        cp_port: int,
        pipeline: str = PIPELINE,
        stage: int = 1,
    ) -> None:
        self.proc = proc
        self.pipeline = pipeline
        self.stage = stage
        self.url = f"http://127.0.0.1:{port}"
        self.cp = f"http://127.0.0.1:{cp_port}"

    def scale(self) -> dict[str, object]:
        url = f"{self.cp}/v1/pipelines/{self.pipeline}/stages/{self.stage}/scale"
        with urllib.request.urlopen(url, timeout=2) as resp:
            body: dict[str, object] = json.loads(resp.read())
        return body

    def stage_pods(self) -> set[int]:
        """Running sidecars of the autoscaled stage among omni-up's children (draining ones
        included; not the API server)."""
        pid = self.proc.pid
        pods = set()
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            ours = "--headless" in argv and argv[argv.index("--stage-id") + 1] == str(self.stage)
            if ours and pid_alive(int(child)):
                pods.add(int(child))
        return pods

    def generate(self, seed: int, timeout: float = 60.0) -> tuple[int, bytes]:
        return post_json(f"{self.url}/v1/generate", {"prompt": "x", "seed": seed}, timeout)

    def sample(self, t: float = 0.0) -> Sample:
        body = self.scale()
        decision = body.get("decision")
        decision = decision if isinstance(decision, dict) else {}
        inputs = decision.get("inputs") or {}
        desired = body.get("desired")
        wait = inputs.get("queue_wait_ms")
        p95 = inputs.get("first_audio_p95_ms")
        p5 = inputs.get("realtime_factor_p5")
        return Sample(
            t=round(t, 2),
            desired=desired if isinstance(desired, int) else -1,
            ready=int(str(body.get("ready", 0))),
            reason=str(decision.get("reason", "")),
            utilization=float(inputs.get("utilization", 0.0)),
            queue_wait_ms=None if wait is None else float(wait),
            pods=len(self.stage_pods()),
            first_audio_p95_ms=None if p95 is None else float(p95),
            realtime_factor_p5=None if p5 is None else float(p5),
        )


class Timeline:
    """The pool sampled every 100 ms on a thread while the block runs (``with``)."""

    def __init__(self, up: Up) -> None:
        self.up = up
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline")
        self._t0 = time.monotonic()

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.up.sample(time.monotonic() - self._t0))
            self._stop.wait(0.1)

    def changes(self) -> str:
        """The samples where desired, ready or the pod count changed, and the range of the
        figures (for logs and failures)."""
        out, last = [], None
        for s in self.samples:
            key = (s.desired, s.ready, s.pods)
            if key != last:
                wait = "-" if s.queue_wait_ms is None else f"{s.queue_wait_ms:.0f}"
                p95 = "-" if s.first_audio_p95_ms is None else f"{s.first_audio_p95_ms:.0f}"
                p5 = "-" if s.realtime_factor_p5 is None else f"{s.realtime_factor_p5:.2f}"
                out.append(f"t={s.t:.1f}s desired={s.desired} ready={s.ready} pods={s.pods} "
                           f"reason={s.reason} utilization={s.utilization:.2f} "
                           f"queue_wait_ms={wait} first_audio_p95_ms={p95} "
                           f"realtime_factor_p5={p5}")  # fmt: skip
                last = key
        utilizations = [s.utilization for s in self.samples]
        busy = sum(u > 0 for u in utilizations)
        waits = [s.queue_wait_ms for s in self.samples if s.queue_wait_ms is not None]
        p95s = [s.first_audio_p95_ms for s in self.samples if s.first_audio_p95_ms is not None]
        out.append(f"utilization: max {max(utilizations, default=0.0):.2f}, above 0 in {busy} "
                   f"of {len(utilizations)} samples; queue_wait_ms: max "
                   f"{max(waits, default=0.0):.0f}; first_audio_p95_ms: max "
                   f"{max(p95s, default=0.0):.0f}")  # fmt: skip
        return "\n".join(out)


@contextmanager
def autoscaled_up(
    deploy: str,
    tmp: Path,
    env: Mapping[str, str] | None = None,
    pipeline: str = PIPELINE,
    stage: int = 1,
) -> Iterator[Up]:
    """``omni-up`` of ``pipeline`` with the deploy config ``deploy`` (its ``stage``
    autoscaled) and ``env`` for its children, until the block ends; then SIGTERM, exit 0, no
    process and no shared memory left behind."""
    path = tmp / "deploy.yaml"
    path.write_text(deploy)
    port, cp_port = free_port(), free_port()
    argv = [sys.executable, "-m", "omni_mesh.launcher.cli", "--pipeline", pipeline,
            "--port", str(port), "--cp-port", str(cp_port), "--deploy-config", str(path),
            "--drain-timeout", "10"]  # fmt: skip
    before = shm_segments()
    proc = ManagedProcess(argv, name="omni-up", env=clean_env(env), log_dir=tmp).start()
    try:
        proc.wait_for_output(READY, timeout=90)
        children = descendants(proc.pid)
        yield Up(proc, port, cp_port, pipeline, stage)
        children |= descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.describe()
        assert [p for p in children if pid_alive(p)] == []
        assert shm_segments() - before == set()
    finally:
        proc.cleanup()
