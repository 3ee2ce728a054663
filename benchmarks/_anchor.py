"""A plain reference for the runtime a benchmark compares against (its anchor, CTranslate2).

A benchmark's anchor side runs in a worker process the benchmark launched: with the environment
the benchmark inherited, the affinity it was given, the modules the worker imports, on a machine
that may be busy. Any of these can slow the anchor without slowing our side (CTranslate2's OpenMP
threads spin while they wait; on a machine where another process wants a core, its batch-1
greedy search ran 2.5-3x slower, onnxruntime's barely). So in the same run, beside each anchor
process, the benchmark runs the anchor's documented one-liner::

    ctranslate2.Translator(path, device="cpu", intra_threads=N).translate_batch(
        source, beam_size=1, max_decoding_length=32, min_decoding_length=32)

in a fresh interpreter with a clean environment (``CLEAN_VARIABLES`` only) and every processor
allowed, on the same model and the same source. ``check`` compares the best time of each: where
they differ by more than ``TOLERANCE`` plus the machine's spread (measured from the same
processes), the benchmark refuses to write figures (``refuse``).

``SLOWDOWN_VARIABLE`` multiplies the anchor side's timed calls (never the reference's, whose
environment is clean); it exists so that tests can see the refusal happen.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# Disagreement allowed beyond the spread between the processes of the same run.
TOLERANCE = 0.15
# What the reference process inherits: where to find programs and files, and the locale.
CLEAN_VARIABLES = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
# Variables that change how many threads a runtime starts, where they run and how they wait.
THREADING_PREFIXES = (
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "CT2_",
    "ONEDNN_",
    "DNNL_",
    "ORT_",
    "NUMEXPR_",
    "VECLIB_",
    "BLIS_",
)
SLOWDOWN_VARIABLE = "ONNXMERGE_BENCH_SLOW_ANCHOR"

_REFERENCE = r"""
import json, os, sys, time
spec = json.loads(sys.argv[1])
try:
    os.sched_setaffinity(0, range(os.cpu_count()))
except OSError:  # a container may allow fewer processors than it shows
    pass
import ctranslate2
translator = ctranslate2.Translator(spec["path"], device="cpu", intra_threads=spec["threads"])
def run():
    return translator.translate_batch(
        spec["source"], beam_size=spec["beams"], max_decoding_length=spec["new_tokens"],
        min_decoding_length=spec["new_tokens"])
run()
times = []
for _ in range(spec["repeats"]):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
print(json.dumps({"times": times, "affinity": sorted(os.sched_getaffinity(0)),
                  "ctranslate2": ctranslate2.__version__}))
"""


def threading_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables of ``environ`` (this process's by default) that change threading."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith(THREADING_PREFIXES)}


def affinity() -> list[int] | None:
    """The processors this process may run on (None where the system does not say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None


def clean_environment() -> dict[str, str]:
    """The reference process's environment: ``CLEAN_VARIABLES`` of this one, nothing else."""
    return {k: os.environ[k] for k in CLEAN_VARIABLES if k in os.environ}


def slowed(run: Callable[[], Any]) -> Callable[[], Any]:
    """``run``, each call made ``SLOWDOWN_VARIABLE`` times as long when it is set (for tests)."""
    factor = float(os.environ.get(SLOWDOWN_VARIABLE, "1"))
    if factor == 1:
        return run

    def slow() -> Any:
        start = time.perf_counter()
        result = run()
        time.sleep((factor - 1) * (time.perf_counter() - start))
        return result

    return slow


def reference(
    path: str | os.PathLike,
    source: Sequence[Sequence[str]],
    *,
    threads: int,
    beams: int,
    new_tokens: int,
    repeats: int,
) -> dict[str, Any]:
    """The documented one-liner on ``path``, in a fresh process with a clean environment and
    every processor allowed: each timed call's seconds, its affinity and environment."""
    spec = {
        "path": os.fspath(path),
        "source": [list(s) for s in source],
        "threads": threads,
        "beams": beams,
        "new_tokens": new_tokens,
        "repeats": repeats,
    }
    env = clean_environment()
    result = subprocess.run(
        [sys.executable, "-c", _REFERENCE, json.dumps(spec)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(path).parent,
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    return {**measured, "environment": sorted(env)}


def _spread(processes: Sequence[Sequence[float]]) -> float:
    """How much the same work's time varies on this machine now, in processes of one kind:
    the larger of the spread within a process (median over best) and between processes (their
    bests' highest over lowest), less one."""
    bests = [min(times) for times in processes]
    within = max(statistics.median(times) / min(times) for times in processes)
    return max(within, max(bests) / min(bests)) - 1


def check(
    anchor: Sequence[Sequence[float]],
    reference_runs: Sequence[Sequence[float]],
    tolerance: float = TOLERANCE,
) -> dict[str, Any]:
    """Whether the anchor side's times agree with the reference's.

    Args:
        anchor: the timed calls of each anchor process, one list per process.
        reference_runs: the same of each reference process.
        tolerance: the disagreement allowed beyond the machine's spread.

    Returns:
        The best of each, their ratio (anchor / reference), the spread, the threshold
        (``tolerance`` plus the spread) and ``agrees``: the ratio within the threshold
        either way.
    """
    anchor_s = min(min(times) for times in anchor)
    reference_s = min(min(times) for times in reference_runs)
    spread = max(_spread(anchor), _spread(reference_runs))  # each side against itself
    ratio = anchor_s / reference_s
    threshold = tolerance + spread
    return {
        "anchor_s": anchor_s,
        "reference_s": reference_s,
        "ratio": ratio,
        "spread": spread,
        "threshold": threshold,
        "agrees": max(ratio, 1 / ratio) - 1 <= threshold,
        "processes": {"anchor": len(anchor), "reference": len(reference_runs)},
    }


# Cores' worth of processor time that other processes may take, on average, during a run whose
# figures are written: on a busy machine CTranslate2 slows down several times more than onnxruntime,
# and the reference, run on the same machine, slows down with it.
MAX_OTHER_CORES = 0.15


def _processor_seconds(cpus: Sequence[int] | None) -> tuple[float, float]:
    """Seconds the processors ``cpus`` (every one when None) spent busy since boot, stolen time
    included (/proc/stat), and this process's CPU seconds with its reaped children's."""
    busy = 0.0
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu":
                    continue
                if cpus is not None and int(name[3:]) not in cpus:
                    continue
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
                busy += user + nice + system + irq + softirq + steal
    except OSError:
        busy = float("nan")
    times = os.times()
    own = times.user + times.system + times.children_user + times.children_system
    return busy / os.sysconf("SC_CLK_TCK"), own


class MachineUse:
    """What else ran on this run's processors while it ran: started at the run's start,
    ``record()`` at its end. The run's own processes (this one and every child it waited for)
    are left out."""

    def __init__(self) -> None:
        self.cpus = affinity()
        self.started = time.perf_counter()
        self.busy, self.own = _processor_seconds(self.cpus)

    def record(self) -> dict[str, Any]:
        """Wall seconds, cores used by this run and by everything else, on average."""
        wall = time.perf_counter() - self.started
        busy, own = _processor_seconds(self.cpus)
        own_s, all_s = own - self.own, busy - self.busy
        return {
            "wall_s": wall,
            "processors": self.cpus,
            "own_cores": own_s / wall,
            "other_cores": max(0.0, all_s - own_s) / wall,
            "max_other_cores": MAX_OTHER_CORES,
        }


def refusal(checks: dict[str, dict[str, Any]], machine: dict[str, Any] | None = None) -> str | None:
    """Why figures from a run with these checks (by name) and this ``MachineUse`` record must
    not be written; None if they may."""
    reasons = []
    if machine is not None and not machine["other_cores"] <= machine["max_other_cores"]:
        reasons.append(
            f"other processes used {machine['other_cores']:.2f} cores on average during the run "
            f"(at most {machine['max_other_cores']} allowed): the machine was not quiet"
        )
    failed = [
        f"{name}: the anchor took {c['ratio']:.2f}x the reference's time "
        f"({c['anchor_s']:.4f} s against {c['reference_s']:.4f} s; allowed "
        f"{1 + c['threshold']:.2f}x either way, the machine's spread being {c['spread']:.0%})"
        for name, c in checks.items()
        if not c["agrees"]
    ]
    if failed:
        reasons.append(
            "the anchor side ran unlike its plain reference in this run, so its figures are not "
            "what its users see: " + "; ".join(failed)
        )
    return "; and ".join(reasons) or None


def add_argument(parser: Any) -> None:
    """``--anchor-check``: ``refuse`` (write no figures when a check fails) or ``record``
    (write them with the checks' outcome, for pipeline checks that share the machine)."""
    parser.add_argument(
        "--anchor-check",
        choices=("refuse", "record"),
        default="refuse",
        help="when the anchor's reference check or the machine's quiet fails: write nothing "
        "(refuse) or write the results with the reason (record)",
    )


def finish(
    out: Path,
    results: dict[str, Any],
    checks: dict[str, dict[str, Any]],
    machine: MachineUse,
    mode: str,
) -> int:
    """Record the checks and the machine's use in ``results``; write them to ``out`` unless a
    check fails in ``refuse`` mode (then ``refuse``). Returns the exit status."""
    results["reference_checks"] = checks
    results["machine_use"] = machine.record()
    reason = refusal(checks, results["machine_use"])
    if reason and mode == "refuse":
        return refuse(out, results, reason)
    results["anchor_check"] = {"mode": mode, "failed": reason}
    if reason:
        print(f"recorded, not refused: {reason}", file=sys.stderr)
    from benchmarks import _common

    _common.write_results(out, results)
    return 0


def refuse(out: Path, results: dict[str, Any], reason: str) -> int:
    """Keep ``out`` as it was; write ``results`` beside it as ``NAME.refused.json`` with the
    reason, say so, and return the exit status of a refused run."""
    from benchmarks import _common

    target = out.with_name(out.stem + ".refused.json")
    _common.write_results(target, {**results, "refused": reason})
    print(f"refused to write {out}: {reason}\n(results kept in {target})", file=sys.stderr)
    return 3


def sentence(results: dict[str, Any]) -> str:
    """What docs/benchmarks.md says of a run's checks: each group's anchor time against its
    plain reference, and the machine's use by other processes."""
    checks = results.get("reference_checks")
    if checks is None:
        return (
            " This run predates the reference check: CTranslate2 was not timed beside its plain "
            "one-liner, and the machine's quiet was not measured."
        )
    parts = [
        f"{name} {c['anchor_s']:.4f} s against {c['reference_s']:.4f} s ({c['ratio']:.2f}x)"
        for name, c in checks.items()
    ]
    use = results["machine_use"]
    return (
        " CTranslate2's greedy batch-1 time in the benchmark's processes against its plain "
        f"one-liner in clean processes beside them: {'; '.join(parts)}; other processes used "
        f"{use['other_cores']:.2f} cores on average during the run."
    )
