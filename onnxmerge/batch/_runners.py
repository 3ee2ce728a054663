"""Where the conversions run: in this process, on a local process pool, or as Ray tasks.

Each runner takes the jobs and yields one :class:`ModelResult` per job as it finishes. Scheduling
is left to ``concurrent.futures`` and to Ray; the pool runner only holds back jobs whose declared
memory would not fit beside the running ones, and isolates the jobs that were running when a
worker process died so that the one that killed it is found and the others still convert.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from onnxmerge._ray_session import QUIET_INIT, ray_session
from onnxmerge.batch._sources import Job
from onnxmerge.batch._task import ModelResult, Options, convert_one, failed, proc_bytes
from onnxmerge.errors import MissingDependencyError

Task = Callable[[Job, str, Options], ModelResult]

WORKER_DIED = (
    "the worker process died while converting this model (killed for lack of memory, or a "
    "crash in native code); it was run alone to be sure. Declare more memory (--memory) or "
    "check the model with `onnxmerge merge`"
)


def available_memory() -> int | None:
    """MemAvailable of this machine, in bytes."""
    return proc_bytes("/proc/meminfo", "MemAvailable")


def run_serial(
    jobs: Sequence[Job], out_dir: Path, options: Options, *, task: Task = convert_one
) -> Iterator[ModelResult]:
    for job in jobs:
        yield task(job, str(out_dir), options)


def run_pool(
    jobs: Sequence[Job],
    out_dir: Path,
    options: Options,
    *,
    workers: int,
    memory_budget: int | None = None,
    task: Task = convert_one,
) -> Iterator[ModelResult]:
    """Convert on ``workers`` spawned processes, the declared memory of running jobs in budget."""
    budget = memory_budget or available_memory()
    queue = deque(jobs)
    suspects: deque[Job] = deque()
    while queue or suspects:
        # After a worker died, the jobs it may have been running are retried one at a time.
        source, width = (suspects, 1) if suspects else (queue, workers)
        in_flight_at_crash = yield from _drain(source, width, budget, out_dir, options, task)
        if len(in_flight_at_crash) == 1:
            yield failed(in_flight_at_crash[0], WORKER_DIED)
        else:
            suspects.extend(in_flight_at_crash)


def _drain(
    source: deque[Job],
    width: int,
    budget: int | None,
    out_dir: Path,
    options: Options,
    task: Task,
) -> Generator[ModelResult, None, list[Job]]:
    """Run ``source`` empty on one pool; return the jobs in flight if the pool broke."""
    in_flight: dict[Future, Job] = {}
    pool = ProcessPoolExecutor(max_workers=width, mp_context=multiprocessing.get_context("spawn"))
    try:
        while source or in_flight:
            used = sum(job.memory_bytes for job in in_flight.values())
            while (
                source
                and len(in_flight) < width
                and (not in_flight or budget is None or used + source[0].memory_bytes <= budget)
            ):
                job = source.popleft()
                in_flight[pool.submit(task, job, str(out_dir), options)] = job
                used += job.memory_bytes
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            broken = False
            for future in done:
                job = in_flight.pop(future)
                try:
                    yield future.result()
                except BrokenProcessPool:
                    in_flight[future] = job
                    broken = True
                except Exception as e:  # the job could not be sent to or back from a worker
                    yield failed(job, f"{type(e).__name__}: {e}")
            if broken:
                return list(in_flight.values())
        return []
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def run_ray(
    jobs: Sequence[Job],
    out_dir: Path,
    options: Options,
    *,
    address: str | None = None,
    task: Task = convert_one,
) -> Iterator[ModelResult]:
    """Convert as Ray tasks, each declaring one CPU and its memory; results stream as they end.

    Uses the Ray session of this process if there is one, else connects with ``ray.init(address)``
    (``None``: a cluster started on this machine, or a new local one) and disconnects at the end,
    with the process's signal handlers as they were.
    ``out_dir`` and the sources must be paths every node can reach (a shared folder).
    """
    try:
        import ray
    except ImportError as e:
        raise MissingDependencyError(
            "runner='ray' (--ray) needs Ray: pip install 'onnxmerge[ray]'"
        ) from e
    with ray_session(address, include_dashboard=False, **QUIET_INIT):
        largest = max(
            (n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")), default=0
        )
        remote = ray.remote(task)
        pending = {}
        for job in jobs:
            if largest and job.memory_bytes > largest:
                yield failed(
                    job,
                    f"declares {job.memory_bytes / 2**30:.1f} GiB of memory, more than any node "
                    f"of the cluster has ({largest / 2**30:.1f} GiB); add a larger node",
                )
                continue
            ref = remote.options(
                num_cpus=1, memory=job.memory_bytes, max_retries=0, name=f"convert {job.name}"
            ).remote(job, os.fspath(out_dir), options)
            pending[ref] = job
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                job = pending.pop(ref)
                try:
                    yield ray.get(ref)
                except ray.exceptions.RayError as e:
                    first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
                    yield failed(job, f"{type(e).__name__}: {first_line}")
