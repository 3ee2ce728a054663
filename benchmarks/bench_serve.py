"""Serving under load: `onnxmerge serve` against the server a user writes over CTranslate2.

A closed-loop load generator over loopback: ``concurrency`` clients (1, 8, 32, 64), each sending
its next request as soon as its last one is answered, until a fixed number of requests is
answered. Every request is ``POST /v1/generate`` with ``input_ids`` (a seeded sentence of 5-64
ids ending in eos) and exactly ``NEW_TOKENS`` new tokens (greedy; ``min_new_tokens`` =
``max_new_tokens``, CTranslate2's ``min_decoding_length`` = ``max_decoding_length``), so both
sides do the same work whatever the random model would say. The model is the opus-mt-fr-en
shape (``_common.opus_mt_config``), merged by onnxmerge and converted by CTranslate2's
``TransformersConverter``, at float32 and int8 (``bench_ctranslate2``'s conversions).

Three servers per precision, in the same run under the same load, each its own process pinned
to the same ``--threads`` processors:

- ``ours``: ``onnxmerge serve`` (``--max-batch-size 32 --batch-wait-ms 5``), with
  onnxruntime's default threads (one per processor the process may use: the pinned ones);
- ``ours_unbatched``: the same with ``--max-batch-size 1`` (batching off), at concurrency 32
  only, where the targets compare it (one request at a time at every level would take most of
  a precision's two minutes);
- ``ctranslate2``: ``benchmarks/_ct2_server.py``: FastAPI, one ``Translator`` with
  ``intra_threads=--threads``, the same batching window and batch size over ``translate_batch``.

Measured per server and concurrency: requests/s, new tokens/s, latency p50/p95/p99, and the
server process's peak resident memory (psutil, sampled every 20 ms). Float32 answers of ``ours``
at concurrency 32 are compared with ``ours_unbatched``'s (each input alone). The CTranslate2
server process runs the anchor check's work before serving and is checked against CTranslate2's
plain one-liner in a clean process (``benchmarks/_anchor.py``); figures are written only from a
quiet machine where the two agree.

``--quick``: the tiny Marian model, a few requests per level; it writes nothing unless ``--out``
is given. ``--sizing``: print docs/serve.md's fleet-sizing table from the results file.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _anchor, _common  # noqa: E402
from benchmarks import bench_ctranslate2 as ct2_bench  # noqa: E402

CONCURRENCY = (1, 8, 32, 64)
REQUESTS = {1: 16, 8: 64, 32: 128, 64: 128}
QUICK_REQUESTS = {1: 4, 8: 16, 32: 32, 64: 64}
# Batching off answers one request at a time: run only where the targets compare it, so that a
# precision stays under two minutes.
UNBATCHED_CONCURRENCY = (32,)
NEW_TOKENS = 32
QUICK_NEW_TOKENS = 8
LENGTHS = (5, 64)
QUICK_LENGTHS = (5, 32)  # the tiny model has 64 positions
MAX_BATCH_SIZE = 32
BATCH_WAIT_MS = 5.0
SERVERS = ("ours", "ours_unbatched", "ctranslate2")
TARGETS = {  # at concurrency 32
    "new_tokens_per_s_vs_ctranslate2": 1.2,  # at least
    "p99_vs_ctranslate2": 1.0,  # at most
    "peak_rss_vs_ctranslate2": 1.2,  # at most
    "batching_on_vs_off": 3.0,  # at least
}
FLEET_REQUESTS_PER_S = 1000
FLEET_UTILISATION = 0.7  # replicas run at 70% of their measured capacity, for bursts


def sentences(count: int, lengths: tuple[int, int], config: dict) -> list[list[int]]:
    """Seeded source ids of 5-64 tokens ending in eos, avoiding the special ids."""
    import numpy as np

    rng = np.random.default_rng(_common.SEED)
    low, high = 2, int(config["vocab_size"]) - 1
    rows = []
    for _ in range(count):
        n = int(rng.integers(lengths[0], lengths[1] + 1))
        rows.append([*rng.integers(low, high, size=n - 1).tolist(), int(config["eos_token_id"])])
    return rows


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- the servers -----------------------------------------------------------------------------------


def server_command(side: str, path: Path, port: int, threads: int, config: dict, probe: Path):
    if side == "ctranslate2":
        return [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "_ct2_server.py"),
            f"--path={path}",
            f"--config={json.dumps(config)}",
            f"--port={port}",
            f"--threads={threads}",
            f"--max-batch-size={MAX_BATCH_SIZE}",
            f"--batch-wait-ms={BATCH_WAIT_MS}",
            f"--probe-out={probe}",
        ]
    batch = MAX_BATCH_SIZE if side == "ours" else 1
    return [
        sys.executable,
        "-m",
        "onnxmerge",
        "serve",
        f"model={path}",
        f"--port={port}",
        f"--max-batch-size={batch}",
        f"--batch-wait-ms={BATCH_WAIT_MS}",
        "--max-queue=4096",
        "--request-timeout-s=600",
        "--log-level=warning",
    ]


def start_server(command: list[str], cpus: list[int], port: int, timeout: float) -> Any:
    """The server's process, once ``/health`` answers 200."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(
        command,
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            error = process.stderr.read().decode() if process.stderr else ""
            raise RuntimeError(f"{command[1:4]} exited: {error[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return process
        except OSError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{command[1:4]} was not healthy within {timeout} s")


def stop_server(process: Any) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class PeakMemory(threading.Thread):
    """The highest resident memory of a process (and its children), sampled every 20 ms."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        import psutil

        self.process = psutil.Process(pid)
        self.peak = 0
        self.threads = 0
        self.done = threading.Event()

    def sample(self) -> None:
        import psutil

        try:
            rss = self.process.memory_info().rss
            rss += sum(c.memory_info().rss for c in self.process.children(recursive=True))
            threads = self.process.num_threads()
        except psutil.Error:
            return
        self.peak = max(self.peak, rss)
        self.threads = max(self.threads, threads)

    def run(self) -> None:
        while not self.done.wait(0.02):
            self.sample()

    def stop(self) -> int:
        self.done.set()
        self.join()
        self.sample()
        return self.peak


# -- the load --------------------------------------------------------------------------------------


async def _post(reader: Any, writer: Any, body: bytes) -> tuple[int, bytes]:
    """One keep-alive HTTP/1.1 POST of JSON to /v1/generate: the status and the body."""
    writer.write(
        b"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next(
        int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length")
    )
    return status, await reader.readexactly(length)


async def _load(port: int, bodies: list[bytes], concurrency: int) -> list[tuple[float, int, Any]]:
    """Closed loop: ``concurrency`` clients, each on its own connection, send the next body as
    soon as their last is answered. Each answer's latency, status and tokens, in body order."""
    answers: list[Any] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i in next_index:
                start = time.perf_counter()
                status, raw = await _post(reader, writer, bodies[i])
                answer = json.loads(raw)
                tokens = answer.get("tokens") if status == 200 else answer
                answers[i] = (time.perf_counter() - start, status, tokens)
        finally:
            writer.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return answers


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def measure(port: int, pid: int, bodies: list[bytes], concurrency: int, new_tokens: int) -> dict:
    """One level of load on one server: throughput, latency percentiles, peak memory."""
    memory = PeakMemory(pid)
    memory.start()
    start = time.perf_counter()
    answers = asyncio.run(_load(port, bodies, concurrency))
    wall = time.perf_counter() - start
    peak = memory.stop()
    ok = [a for a in answers if a[1] == 200]
    failed = [a for a in answers if a[1] != 200]
    latencies = [a[0] for a in ok]
    return {
        "requests": len(bodies),
        "errors": len(bodies) - len(ok),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "new_tokens_per_s": len(ok) * new_tokens / wall,
        "latency_p50_s": percentile(latencies, 50) if ok else None,
        "latency_p95_s": percentile(latencies, 95) if ok else None,
        "latency_p99_s": percentile(latencies, 99) if ok else None,
        "peak_rss_mb": peak / 1e6,
        "server_threads": memory.threads,  # the most seen: how many threads each runtime started
        "first_error": None if not failed else {"status": failed[0][1], "body": failed[0][2]},
        "tokens": [a[2] if a[1] == 200 else None for a in answers],
    }


def run_server(side: str, path: Path, plan: dict, config: dict, probe: Path) -> dict:
    """Start one server, run every level of load on it, stop it."""
    port = free_port()
    command = server_command(side, path, port, plan["threads"], config, probe)
    process = start_server(command, plan["cpus"], port, plan["start_timeout_s"])
    try:
        bodies_all = [
            json.dumps(
                {
                    "input_ids": ids,
                    "min_new_tokens": plan["new_tokens"],
                    "max_new_tokens": plan["new_tokens"],
                }
            ).encode()
            for ids in plan["sentences"]
        ]
        levels = {}
        for concurrency, count in plan["requests"].items():
            if side == "ours_unbatched" and concurrency not in UNBATCHED_CONCURRENCY:
                continue
            levels[str(concurrency)] = measure(
                port, process.pid, bodies_all[:count], concurrency, plan["new_tokens"]
            )
        return levels
    finally:
        stop_server(process)


# -- the comparison --------------------------------------------------------------------------------


def agreement(levels: dict, alone: dict, new_tokens: int) -> float:
    """The share of ``levels``' answers equal to the same input's answer alone."""
    same = total = 0
    for level, single_level in alone.items():
        for mine, single in zip(levels[level]["tokens"], single_level["tokens"], strict=True):
            total += 1
            same += mine is not None and mine == single
    return same / total if total else float("nan")


def ratios(sides: dict, concurrency: int = 32) -> dict:
    key = str(concurrency)
    ours, off, theirs = (sides[s].get(key) for s in SERVERS)
    if any(m is None or m["errors"] for m in (ours, off, theirs)):
        return {}  # a side that failed requests has no figures to compare (see first_error)
    return {
        "new_tokens_per_s_vs_ctranslate2": ours["new_tokens_per_s"] / theirs["new_tokens_per_s"],
        "p99_vs_ctranslate2": ours["latency_p99_s"] / theirs["latency_p99_s"],
        "peak_rss_vs_ctranslate2": ours["peak_rss_mb"] / theirs["peak_rss_mb"],
        "batching_on_vs_off": ours["new_tokens_per_s"] / off["new_tokens_per_s"],
    }


def summarise(sides: dict, new_tokens: int, precision: str) -> dict:
    """The per-level figures without the tokens, the agreement and the ratios at 32."""
    out: dict[str, Any] = {"sides": {}, "ratios": ratios(sides), "targets": TARGETS}
    # float32 answers must equal each input's alone; int8 ones may differ where an input's
    # batch sets its activation scale (docs/quantization.md), so there it is a share measured.
    out["ours_equals_alone"] = agreement(sides["ours"], sides["ours_unbatched"], new_tokens)
    for side, levels in sides.items():
        out["sides"][side] = {
            level: {k: v for k, v in m.items() if k != "tokens"} for level, m in levels.items()
        }
    return out


def markdown(data: dict) -> list[str]:
    """docs/benchmarks.md's section: every server and level, then the ratios at 32."""
    lines = [
        "## Serving under load (`onnxmerge serve`)",
        "",
        f"opus-mt-fr-en shape, `POST /v1/generate` over loopback, closed loop, exactly "
        f"{data['new_tokens']} new tokens a request, each server pinned to {data['threads']} "
        f"processors, batches of up to {data['max_batch_size']} within "
        f"{data['batch_wait_ms']} ms (`benchmarks/bench_serve.py`; `ours_unbatched` is "
        "`--max-batch-size 1`, at 32 only). Processor: "
        f"{_common.processor_words(data['environment'])}.{_anchor.sentence(data)}",
        "",
        "| precision | server | concurrency | requests/s | new tokens/s | p50 | p95 | p99 "
        "| peak memory |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for precision, result in data["precisions"].items():
        for side, levels in result["sides"].items():
            for level, m in levels.items():
                if m.get("latency_p99_s") is None:
                    continue
                lines.append(
                    f"| {precision} | {side} | {level} | {m['requests_per_s']:.1f} | "
                    f"{m['new_tokens_per_s']:.0f} | {m['latency_p50_s'] * 1000:.0f} ms | "
                    f"{m['latency_p95_s'] * 1000:.0f} ms | {m['latency_p99_s'] * 1000:.0f} ms | "
                    f"{m['peak_rss_mb']:.0f} MB |"
                )
    lines += [
        "",
        "At concurrency 32 (targets: tokens/s at least, the others at most):",
        "",
        "| precision | measure | ratio | target | answers equal to each input alone |",
        "|---|---|---:|---:|---:|",
    ]
    for precision, result in data["precisions"].items():
        same = result.get("ours_equals_alone")
        for measure, ratio in result["ratios"].items():
            same_cell = "" if same is None else f"{same:.0%}"
            lines.append(
                f"| {precision} | {measure} | **{ratio:.2f}x** | {TARGETS[measure]}x "
                f"| {same_cell} |"
            )
    return [*lines, ""]


# -- building the models -------------------------------------------------------------------------


def build_models(quick: bool, cache_dir: Path, scratch: Path) -> tuple[dict, dict, dict]:
    """Ours (merged float32, quantized int8) and CTranslate2's (float32, int8), and the ids."""
    import onnxmerge

    export, config = _common.marian_export(quick, cache_dir)
    (scratch / "float32").mkdir()
    merged = onnxmerge.merge_seq2seq(export.onnx_dir, scratch / "float32" / "model.onnx")
    int8 = scratch / "int8" / "model.onnx"
    int8.parent.mkdir()
    ct2_bench.quantize_ours(merged, int8)
    ours = {"float32": merged, "int8": int8}
    return ours, ct2_bench.convert_ctranslate2(export.pytorch_dir, scratch, config), config


def anchor_check(ct2_path: Path, probe: Path, config: dict, threads: int) -> dict:
    """The CTranslate2 server process's probe times against the plain one-liner's."""
    repeats = 5
    reference = ct2_bench.reference_run(ct2_path, config, repeats, threads)
    times = json.loads(probe.read_text(encoding="utf-8"))
    return {**_anchor.check([times], [reference["times"]]), "reference_runs": [reference]}


def run_precision(precision: str, paths: dict, config: dict, plan: dict, scratch: Path) -> dict:
    started = time.perf_counter()
    probe = scratch / f"probe-{precision}.json"
    sides = {}
    for side in SERVERS:
        path = paths["ctranslate2"] if side == "ctranslate2" else paths["ours"]
        sides[side] = run_server(side, path, plan, config, probe)
    result = summarise(sides, plan["new_tokens"], precision)
    result["wall_s"] = time.perf_counter() - started
    result["anchor_check"] = anchor_check(paths["ctranslate2"], probe, config, plan["threads"])
    return result


# -- the fleet-sizing table ----------------------------------------------------------------------


def sizing_table(results: dict | None, concurrency: int = 32) -> str:
    """docs/serve.md's table: replicas (of ``threads`` cores each) for a fleet answering
    ``FLEET_REQUESTS_PER_S`` requests/s, from each precision's measured requests/s per server
    at ``concurrency``; every cell a placeholder where there are no results."""
    header = (
        "| precision | requests/s per replica | p99 latency | peak memory per replica "
        f"| replicas for {FLEET_REQUESTS_PER_S:,}/s at {FLEET_UTILISATION:.0%} | cores |\n"
        "|---|---|---|---|---|---|\n"
    )
    if results is None:
        return header + "".join(
            f"| {p} | (not measured) | (not measured) | (not measured) | (not measured) "
            "| (not measured) |\n"
            for p in ("float32", "int8")
        )
    rows = []
    threads = results["threads"]
    for precision, result in results["precisions"].items():
        m = result["sides"]["ours"][str(concurrency)]
        replicas = math.ceil(FLEET_REQUESTS_PER_S / (m["requests_per_s"] * FLEET_UTILISATION))
        rows.append(
            f"| {precision} | {m['requests_per_s']:.1f} | {m['latency_p99_s'] * 1000:.0f} ms "
            f"| {m['peak_rss_mb']:.0f} MB | {replicas} | {replicas * threads} |\n"
        )
    return header + "".join(rows)


def _plan(args: Any) -> dict:
    requests = QUICK_REQUESTS if args.quick else REQUESTS
    threads = args.threads
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    if len(cpus) < threads:
        raise SystemExit(f"--threads {threads}: only {len(cpus)} processors may be used")
    return {
        "threads": threads,
        "cpus": cpus,
        "requests": {c: requests[c] for c in CONCURRENCY},
        "new_tokens": QUICK_NEW_TOKENS if args.quick else NEW_TOKENS,
        "start_timeout_s": 120 if args.quick else 600,
    }


def main(argv: list[str] | None = None) -> int:
    parser = _common.arguments(__doc__, "serve", "tiny Marian model, a few requests a level")
    parser.add_argument("--threads", type=int, default=2, help="processors of each server")
    parser.add_argument("--cache-dir", type=Path, default=_common.DEFAULT_CACHE_DIR)
    parser.add_argument("--sizing", action="store_true", help="print the fleet-sizing table")
    _anchor.add_argument(parser)
    explicit_out = any(a == "--out" or a.startswith("--out=") for a in (argv or sys.argv[1:]))
    args = parser.parse_args(argv)
    _common.compile_bytecode()
    if args.sizing:
        known = json.loads(args.out.read_text("utf-8")) if args.out.exists() else None
        print(sizing_table(known), end="")
        return 0
    plan = _plan(args)
    load_at_start = os.getloadavg()
    machine = _anchor.MachineUse()
    scratch = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    try:
        ours, ct2, config = build_models(args.quick, args.cache_dir, scratch)
        lengths = QUICK_LENGTHS if args.quick else LENGTHS
        plan["sentences"] = sentences(max(plan["requests"].values()), lengths, config)
        precisions = {}
        for precision in ("float32", "int8"):
            paths = {"ours": ours[precision], "ctranslate2": ct2[precision]}
            precisions[precision] = run_precision(precision, paths, config, plan, scratch)
            print(f"{precision}: {json.dumps(precisions[precision]['ratios'])}", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results = {
        "quick": args.quick,
        "threads": plan["threads"],
        "new_tokens": plan["new_tokens"],
        "requests": plan["requests"],
        "max_batch_size": MAX_BATCH_SIZE,
        "batch_wait_ms": BATCH_WAIT_MS,
        "precisions": precisions,
        "environment": _common.environment(load_at_start, ctranslate2=version("ctranslate2")),
    }
    if args.quick and not explicit_out:
        print(json.dumps(results, indent=2, default=str))
        return 0
    checks = {p: r["anchor_check"] for p, r in precisions.items()}
    return _anchor.finish(args.out, results, checks, machine, args.anchor_check)


if __name__ == "__main__":
    sys.exit(main())
