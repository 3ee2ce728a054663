"""Shared helpers for the benchmarks: reference models, exports on disk, measured child processes.

Models are built from transformers configs with seeded random weights, saved with
``save_pretrained`` and exported with optimum's ``main_export``, so each export folder is what a
user has after ``optimum-cli export onnx``. Exports are cached under ``.cache/bench/`` keyed by the
config, the export variant and the versions of the packages that shape the files.

Export variants (optimum's post-export tied-weight pass, which runs only when ``accelerate`` is
importable):

- ``tied``: the pass runs; the tied LM head becomes a ``Transpose`` of the embedding.
- ``untied``: the pass is switched off, as for a user without ``accelerate``; the LM head is its
  own initializer, a copy of ``embedding^T``, in each decoder file.

Measured runs happen in a fresh interpreter (``run_in_subprocess``), so the peak memory of one run
is not hidden by what an earlier run allocated.

Nothing here imports torch, transformers or optimum at module level: a child process that only
merges should not pay for them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import _anchor
from onnxmerge._ort import processor
from tests import exports
from tests.exports import export_onnx, staging

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "bench"
OUT_DIR = REPO_ROOT / "benchmarks" / "out"
# Bump to invalidate cached exports after a change in how models are built or exported.
CACHE_VERSION = "1"
EXPORT_VARIANTS = ("tied", "untied")
_VERSIONED = ("torch", "transformers", "optimum", "optimum-onnx", "onnx", "accelerate")
SEED = 0

ENCODER_FILE = "encoder_model.onnx"
DECODER_FILE = "decoder_model.onnx"
DECODER_WITH_PAST_FILE = "decoder_with_past_model.onnx"
DECODER_MERGED_FILE = "decoder_model_merged.onnx"
# What optimum writes before merging its decoders, and what onnxmerge merges.
SEPARATE_FILES = (ENCODER_FILE, DECODER_FILE, DECODER_WITH_PAST_FILE)
CHECKPOINT_FILE = "model.safetensors"


# ---------------------------------------------------------------- reference configs


def _marian_config(vocab: int, d_model: int, layers: int, heads: int, ffn: int, positions: int):
    from transformers import MarianConfig

    return MarianConfig(
        vocab_size=vocab,
        decoder_vocab_size=vocab,
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        max_position_embeddings=positions,
        pad_token_id=vocab - 1,
        decoder_start_token_id=vocab - 1,
        eos_token_id=0,
        forced_eos_token_id=0,
        activation_function="swish",
        scale_embedding=True,
        static_position_embeddings=True,
        share_encoder_decoder_embeddings=True,
    )


def opus_mt_config() -> Any:
    """The shape of Helsinki-NLP/opus-mt-fr-en (about 75 M parameters, 298.7 MB of safetensors)."""
    return _marian_config(vocab=59514, d_model=512, layers=6, heads=8, ffn=2048, positions=512)


def _ending(config: Any) -> Any:
    """``config`` with an untied head and a raised eos logit (``eos_logit_bias``, applied by
    ``build_pytorch``): random weights tied to the head make every output repeat its first
    token; untied, the outputs wander, and the bias ends them at different lengths, as
    translations do."""
    config.tie_word_embeddings = False
    config.eos_logit_bias = ENDS_EOS_BIAS
    return config


# Calibrated so that eos, once allowed, is the largest logit at about one step in ten.
ENDS_EOS_BIAS = 1.5


def opus_mt_ends_config() -> Any:
    """The opus-mt-fr-en shape whose outputs end at different lengths (``_ending``)."""
    return _ending(opus_mt_config())


def tiny_marian_config() -> Any:
    """A Marian model small enough to build, export and merge in seconds."""
    return _marian_config(vocab=200, d_model=32, layers=2, heads=4, ffn=64, positions=64)


def tiny_marian_ends_config() -> Any:
    """``opus_mt_ends_config`` at the tiny Marian's size, to check the pipeline."""
    return _ending(tiny_marian_config())


def marian_config(quick: bool) -> Callable[[], Any]:
    """The config factory of the reference model: the tiny Marian under ``--quick``."""
    return tiny_marian_config if quick else opus_mt_config


# ---------------------------------------------------------------- exports on disk


@dataclass(frozen=True)
class Export:
    """One cached export: the PyTorch checkpoint folder and the folder optimum wrote."""

    key: str
    variant: str
    pytorch_dir: Path
    onnx_dir: Path

    @property
    def checkpoint(self) -> Path:
        return self.pytorch_dir / CHECKPOINT_FILE


def timed_runs(fn: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    """``fn()`` once to warm up (onnxruntime allocates and tunes on the first run), then
    ``repeats`` timed runs: the seconds of each and the last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return times, result


def median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float], Any]:
    """The median of :func:`timed_runs`, its times and the last result."""
    times, result = timed_runs(fn, repeats)
    return statistics.median(times), times, result


def package_versions() -> dict[str, str]:
    return exports.package_versions(_VERSIONED)


# Instruction sets that decide which int8 and float kernels both runtimes pick.
_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")


def cpu_description() -> dict[str, Any]:
    """The processor's model name and the kernel-relevant instruction sets (Linux), so that runs
    on different machines are told apart."""
    model, flags = processor()
    listed = None if flags is None else [f for f in _CPU_FLAGS if f in flags]
    return {"model": model, "flags": listed}


def processor_words(environment: dict[str, Any]) -> str:
    """The processor a results file was measured on, with its instruction sets: two processors
    of one name and vendor gave ratios 17-27% apart."""
    cpu = environment.get("cpu")
    if not cpu:
        return "not recorded"
    if cpu.get("flags") is None:
        return f"{cpu['model']} (instruction sets not read)"
    return f"{cpu['model']} ({', '.join(cpu['flags']) or 'no AVX2'})"


def environment(load_at_start: tuple[float, ...], **versions: str | None) -> dict[str, Any]:
    """Where a run measured: Python, cores, processor, the load average at its start (given) and
    now, the processors this process may run on, the environment variables that change
    threading (the workers inherit both), whether onnxmerge ran from compiled bytecode
    (``compile_bytecode``), then ``versions`` (package name to version)."""
    return {
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_description(),
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        "affinity": _anchor.affinity(),
        "threading_environment": _anchor.threading_environment(),
        "onnxmerge_bytecode": "compiled" if _bytecode_compiled() else "source",
        **versions,
    }


def _package_sources() -> list[Path]:
    import onnxmerge

    return sorted(Path(onnxmerge.__file__).parent.rglob("*.py"))


def compile_bytecode() -> None:
    """Compile onnxmerge's modules to bytecode, as installing the package does. A source
    checkout run with ``PYTHONDONTWRITEBYTECODE`` (CI and this machine set it) compiles them
    again in every process: the time, and 1.6 MB of resident memory for the runtime's import,
    that an installed package never pays, while the packages of the other side of a comparison
    are installed compiled."""
    if _bytecode_compiled():  # a worker process of a run that compiled it
        return
    import compileall

    import onnxmerge

    compileall.compile_dir(str(Path(onnxmerge.__file__).parent), quiet=1)


def _bytecode_compiled() -> bool:
    """Whether every module of onnxmerge has bytecode no older than its source."""
    import importlib.util

    for source in _package_sources():
        compiled = Path(importlib.util.cache_from_source(str(source)))
        if not compiled.is_file() or compiled.stat().st_mtime < source.stat().st_mtime:
            return False
    return True


def generate_exactly(model: Any, ids: Any, mask: Any, beams: int, new_tokens: int) -> Any:
    """``model.generate`` (onnxmerge's or transformers' API) for exactly ``new_tokens`` tokens."""
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        num_beams=beams,
        min_new_tokens=new_tokens,
        max_new_tokens=new_tokens,
    )


# ---------------------------------------------------------------- command line and results


def arguments(doc: str, name: str, quick_help: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: ``--quick``, and ``--out`` (``benchmarks/out/NAME.json``
    by default)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=OUT_DIR / f"{name}.json", help="JSON results")
    return parser


def worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a benchmark that runs each side in a worker process of its own script:
    ``--threads``, ``--cache-dir``, and the hidden ones the parent passes to a worker."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--worker", choices=("ours", "ctranslate2"), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--session-cache", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)


def write_results(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")


def cache_key(config: Any, variant: str) -> str:
    payload = json.dumps(
        {
            "cache_version": CACHE_VERSION,
            "seed": SEED,
            "variant": variant,
            "config": config.to_dict(),
            "versions": package_versions(),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def export_cached(
    config_factory: Callable[[], Any],
    variant: str = "tied",
    cache_dir: str | os.PathLike | None = None,
    *,
    task: str = "text2text-generation-with-past",
) -> Export:
    """Build, save and export the model of ``config_factory()`` once; return the cached folders.

    The PyTorch checkpoint is shared by the variants of one config; each variant has its own
    export folder. A folder is published by renaming a finished staging folder, so an interrupted
    run leaves nothing that looks complete.
    """
    if variant not in EXPORT_VARIANTS:
        raise ValueError(f"unknown export variant {variant!r}; choose one of {EXPORT_VARIANTS}")
    cache_dir = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    config = config_factory()
    name = getattr(config_factory, "__name__", "model").removesuffix("_config")
    model_key = cache_key(config, "pytorch")
    pytorch_dir = cache_dir / f"{name}-{model_key}" / "pytorch"
    key = cache_key(config, f"{variant}:{task}")
    onnx_dir = cache_dir / f"{name}-{model_key}" / f"onnx-{variant}-{key}"
    if not (pytorch_dir / CHECKPOINT_FILE).exists():
        with staging(pytorch_dir) as folder:
            build_pytorch(config, folder)
    if not (onnx_dir / ENCODER_FILE).exists():
        with staging(onnx_dir) as folder:
            _run_main_export(pytorch_dir, folder, variant, task)
    return Export(key=key, variant=variant, pytorch_dir=pytorch_dir, onnx_dir=onnx_dir)


def marian_export(quick: bool, cache_dir: Path | None = None) -> tuple[Export, dict[str, int]]:
    """The cached tied export of the reference model (the tiny one under ``--quick``) and the
    config ids a worker needs: ``vocab_size``, ``pad_token_id``, ``eos_token_id``."""
    factory = marian_config(quick)
    export = export_cached(factory, "tied", cache_dir)
    full = factory()
    ids = ("vocab_size", "pad_token_id", "eos_token_id")
    return export, {k: int(getattr(full, k)) for k in ids}


def build_pytorch(config: Any, out_dir: Path) -> None:
    """Save a seeded random model of ``config`` with ``save_pretrained``."""
    import torch
    from transformers import AutoModelForSeq2SeqLM, GenerationConfig

    torch.manual_seed(SEED)
    model = AutoModelForSeq2SeqLM.from_config(config).eval()
    bias = getattr(config, "eos_logit_bias", None)
    if bias is not None:
        with torch.no_grad():
            model.final_logits_bias[0, config.eos_token_id] = bias
    model.generation_config = GenerationConfig.from_model_config(config)
    model.save_pretrained(out_dir)


def _run_main_export(pytorch_dir: Path, out_dir: Path, variant: str, task: str) -> None:
    export_onnx(pytorch_dir, out_dir, task, tied=variant == "tied")


def files_bytes(folder: Path, names: Sequence[str]) -> int:
    """Bytes of the named files plus any external data files beside them (``<name>_data``)."""
    total = 0
    for name in names:
        path = folder / name
        total += path.stat().st_size
        for data in (folder / f"{name}_data", folder / f"{name}.data"):
            if data.exists():
                total += data.stat().st_size
    return total


# ---------------------------------------------------------------- measured child processes


def _proc_fields_bytes(path: str, keys: Sequence[str]) -> dict[str, int] | None:
    """The ``kB`` fields ``keys`` of a /proc file, in bytes (0 where absent); None once the
    file is gone."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except (OSError, ValueError):
        return None
    found = dict.fromkeys(keys, 0)
    for line in text.splitlines():
        field, _, rest = line.partition(":")
        if field in found:
            found[field] += int(rest.split()[0]) * 1024
    return found


def _read_proc_kib(path: str, keys: Sequence[str]) -> int | None:
    """Sum of the ``kB`` fields ``keys`` of a /proc file, in bytes; None once it is gone."""
    found = _proc_fields_bytes(path, keys)
    return None if found is None else sum(found.values())


def self_rss_bytes() -> dict[str, int | None]:
    """This process's current and peak resident set size."""
    return {
        "rss_bytes": _read_proc_kib("/proc/self/status", ("VmRSS",)),
        "peak_rss_bytes": _read_proc_kib("/proc/self/status", ("VmHWM",)),
    }


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux ``clear_refs`` 5); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _PrivateMemorySampler(threading.Thread):
    """Samples a process's smaps_rollup and keeps two peaks: Private_Clean + Private_Dirty
    (``peak``: pages no other process maps, file pages read or written through a mapping
    included, which the kernel can drop or write back), and Anonymous (``peak_anonymous``:
    memory no file backs, which it cannot)."""

    def __init__(self, pid: int, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.path = f"/proc/{pid}/smaps_rollup"
        self.interval_s = interval_s
        self.peak = 0
        self.peak_anonymous = 0
        self.samples = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            # One read a sample: the kernel walks every mapping of the process for it.
            found = _proc_fields_bytes(self.path, ("Private_Clean", "Private_Dirty", "Anonymous"))
            if found is None:
                if self.samples:
                    return
            else:
                self.samples += 1
                private = found["Private_Clean"] + found["Private_Dirty"]
                self.peak = max(self.peak, private)
                self.peak_anonymous = max(self.peak_anonymous, found["Anonymous"])
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join()


_CHILD = r"""
import importlib, json, sys, time
sys.path[:0] = json.loads(sys.argv[2])
spec = json.loads(sys.argv[1])
for name in spec["preload"]:
    importlib.import_module(name)
from benchmarks import _common
module_name, _, fn_name = spec["fn"].partition(":")
fn = getattr(importlib.import_module(module_name), fn_name)
before = _common.self_rss_bytes()
start = time.perf_counter()
value = fn(*spec["args"], **spec["kwargs"])
call_s = time.perf_counter() - start
after = _common.self_rss_bytes()
with open(spec["result_path"], "w", encoding="utf-8") as f:
    json.dump({"call_s": call_s, "baseline_rss_bytes": before["rss_bytes"],
               "peak_rss_bytes": after["peak_rss_bytes"], "result": value}, f, default=str)
"""


# What run_in_subprocess measures, besides the call's result and log.
MEASURED_KEYS = (
    "wall_s",
    "call_s",
    "peak_rss_bytes",
    "baseline_rss_bytes",
    "peak_call_rss_bytes",
    "peak_private_bytes",
    "peak_anonymous_bytes",
    "maxrss_bytes",
)


def run_in_subprocess(
    fn_path: str,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    preload: Sequence[str] = (),
    sample_interval_s: float = 0.01,
    timeout_s: float | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Call ``module:function`` with JSON-able arguments in a fresh interpreter and measure it.

    ``preload`` modules are imported before the measured call, so ``call_s`` and the baseline
    leave out import costs; ``wall_s`` is the whole process. Returns ``wall_s``, ``call_s``,
    ``peak_rss_bytes`` (VmHWM of the child: the whole process, imports included),
    ``baseline_rss_bytes`` (RSS just before the call), ``peak_call_rss_bytes`` (peak minus
    baseline), ``peak_private_bytes`` (sampled peak of Private_Clean + Private_Dirty: file
    pages mapped by the child alone count), ``peak_anonymous_bytes`` (sampled peak of Anonymous:
    the memory no file backs), ``maxrss_bytes`` (the kernel's ru_maxrss of the reaped child) and
    ``result`` (the function's return value, round-tripped through JSON). ``preexec_fn`` runs in
    the child before it starts (to join a memory cgroup, say).
    """
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        result_path = Path(tmp) / "result.json"
        spec = {
            "fn": fn_path,
            "args": list(args),
            "kwargs": dict(kwargs or {}),
            "preload": list(preload),
            "result_path": str(result_path),
        }
        paths = [str(REPO_ROOT)]
        env = dict(os.environ, PYTHONHASHSEED="0")
        start = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(spec), json.dumps(paths)],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )
        sampler = _PrivateMemorySampler(child.pid, sample_interval_s)
        sampler.start()
        output: list[bytes] = []
        reader = threading.Thread(target=lambda: output.append(child.stdout.read()), daemon=True)
        reader.start()
        deadline = None if timeout_s is None else start + timeout_s
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if deadline is not None and time.perf_counter() > deadline:
                child.kill()
                pid, status, usage = os.wait4(child.pid, 0)
                break
            time.sleep(0.005)
        wall_s = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        sampler.stop()
        reader.join()
        log = b"".join(output).decode(errors="replace")
        if child.returncode != 0 or not result_path.exists():
            raise RuntimeError(
                f"{fn_path} failed in a child process (exit {child.returncode}):\n{log}"
            )
        measured = json.loads(result_path.read_text(encoding="utf-8"))
    measured.update(
        wall_s=wall_s,
        maxrss_bytes=usage.ru_maxrss * 1024,
        peak_private_bytes=sampler.peak or None,
        peak_anonymous_bytes=sampler.peak_anonymous or None,
        private_samples=sampler.samples,
        peak_call_rss_bytes=measured["peak_rss_bytes"] - measured["baseline_rss_bytes"],
        log=log[-4000:],
    )
    return measured


def median_runs(runs: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, Any]:
    """Median of each numeric key over the runs (None where a run lacks it)."""
    out: dict[str, Any] = {}
    for key in keys:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def repeat_in_subprocess(
    fn_path: str,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    repeats: int = 3,
    preload: Sequence[str] = (),
    before_each: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """``run_in_subprocess`` ``repeats`` times; the medians plus every run."""
    runs = []
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        runs.append(run_in_subprocess(fn_path, args, kwargs, preload=preload))
    return {"median": median_runs(runs, MEASURED_KEYS), "runs": runs}


def mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"
