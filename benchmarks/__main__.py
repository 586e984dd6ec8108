"""``python -m benchmarks NAME [--quick] [--reps N] [--profile DIR] [--write-doc FILE]``.

NAME is one of ``hop``, ``handoff``, ``scaling``, ``control-plane``, ``peer``, ``streaming``,
``autoscale``, ``overload``, ``vllm``, ``omni``, ``realtime``, ``pd``, ``pd-thinker``, ``image``
(and the others of ``benchmarks.NAMES``) or ``all``.
``--write-doc`` replaces the generated part of a markdown file (between the BEGIN/END
GENERATED markers) with this run's tables, the command and the machine.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import time
import traceback
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import FrameType
from typing import Any, cast

import uvloop

from benchmarks import NAMES
from benchmarks.common import ROOT, Options, Report
from benchmarks.fabric import kill_everything, shm_segments
from benchmarks.measure import NoiseMeter, git_revision, machine_summary, md_table

BEGIN = "<!-- BEGIN GENERATED: python -m benchmarks all --write-doc docs/benchmarks.md -->"
END = "<!-- END GENERATED -->"

MODULES = {
    "hop": "benchmarks.hop",
    "handoff": "benchmarks.handoff",
    "scaling": "benchmarks.scaling",
    "control-plane": "benchmarks.control_plane",
    "peer": "benchmarks.peer",
    "streaming": "benchmarks.streaming",
    "autoscale": "benchmarks.autoscale",
    "overload": "benchmarks.overload",
    "vllm": "benchmarks.vllm",
    "omni": "benchmarks.omni",
    "realtime": "benchmarks.realtime",
    "pd": "benchmarks.pd",
    "pd-thinker": "benchmarks.pd_thinker",
    "omni-handoff": "benchmarks.omni_handoff",
    "omni-thinkers": "benchmarks.omni_thinkers",
    "vllm-core": "benchmarks.vllm_core",
    "image": "benchmarks.image",
    "service": "benchmarks.service",
}


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_one(name: str, opts: Options) -> Report:
    module = importlib.import_module(MODULES[name])
    bench = cast(Callable[[Options], Coroutine[Any, Any, Report]], module.bench)
    print(f"\n== {name}{' (quick)' if opts.quick else ''}\n", flush=True)
    t0 = time.monotonic()
    noise = NoiseMeter()
    report = uvloop.run(bench(opts))
    report.seconds = time.monotonic() - t0
    foreign = noise.foreign_cores()
    report.notes.append(
        f"Machine noise: processes outside this benchmark used {foreign:.2f} of the 2 cores "
        "on average while it ran (/proc/stat busy time minus the benchmark's own CPU time)."
    )
    print(report.notes[-1], flush=True)
    return report


def summary(reports: list[Report]) -> str:
    rows = [[r.name, *t.row()] for r in reports for t in r.targets]
    return md_table(["benchmark", "target", "measured", "bound", "verdict"], rows, title="Targets")


def _section(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def _summary_from_sections(sections: dict[str, str]) -> str:
    """The Targets rows of every benchmark section present, as one table."""
    rows: list[list[str]] = []
    for name in NAMES:
        text = sections.get(name, "")
        _, found, rest = text.partition("#### Targets")
        if not found:
            continue
        for line in rest.strip().splitlines()[2:]:
            if not line.startswith("|"):
                break
            rows.append([name, *(c.strip() for c in line.strip().strip("|").split("|"))])
    return md_table(["benchmark", "target", "measured", "bound", "verdict"], rows, title="Targets")


def write_doc(path: Path, reports: list[Report], command: str, machine: str) -> None:
    """Replace the sections of ``reports`` in the generated part of ``path`` (other
    benchmarks' sections stay), then rebuild the header and the targets summary."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip() + "\n\n" + BEGIN + "\n" + END + "\n"
    head, _, rest = text.partition(BEGIN)
    generated, _, tail = rest.partition(END)
    sections: dict[str, str] = {}
    for name in NAMES:
        start, stop = _section(name)
        if start in generated and stop in generated:
            sections[name] = generated.split(start, 1)[1].split(stop, 1)[0].strip("\n")
    stamp = f"{time.strftime('%Y-%m-%d %H:%M %Z')}, git {git_revision(ROOT)}"
    for r in reports:
        sections[r.name] = f"_Run {stamp}: `{command}`. Machine: {machine}._\n\n" + r.markdown()
    body = [BEGIN, "", _summary_from_sections(sections)]
    for name in NAMES:
        if name in sections:
            start, stop = _section(name)
            body += [start, sections[name], stop, ""]
    body.append(END)
    path.write_text(head + "\n".join(body) + tail)
    print(f"wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("name", choices=[*NAMES, "all"])
    p.add_argument("--quick", action="store_true", help="short runs (each under a minute)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per figure")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR", help="py-spy profiles")
    p.add_argument("--write-doc", type=Path, default=None, metavar="FILE")
    args = p.parse_args(argv)
    opts = Options(quick=args.quick, reps=args.reps, profile_dir=args.profile)
    names = list(NAMES) if args.name == "all" else [args.name]
    signal.signal(signal.SIGTERM, _on_sigterm)
    machine = machine_summary()
    command = "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:])
    shm_before = shm_segments()
    reports: list[Report] = []
    failed: list[str] = []
    try:
        for name in names:
            try:
                reports.append(run_one(name, opts))
            except Exception as exc:  # one failing benchmark must not stop the others
                traceback.print_exc()
                print(f"\n[{name}] FAILED: {exc}\n", file=sys.stderr, flush=True)
                failed.append(name)
            finally:
                kill_everything()
            if args.write_doc is not None and reports and reports[-1].name == name:
                write_doc(args.write_doc, reports[-1:], command, machine)
    finally:
        kill_everything()
    leaked = shm_segments() - shm_before
    if leaked:
        print(f"warning: /dev/shm segments left behind: {sorted(leaked)}", file=sys.stderr)
    print(f"\nMachine: {machine}\n")
    if reports:
        print(summary(reports))
    return 1 if failed or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
