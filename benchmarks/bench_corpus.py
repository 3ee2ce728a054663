"""A corpus against CTranslate2: ``generate_many`` against ``translate_batch``, tokens per second.

The opus-mt-fr-en shape (seeded random weights, ``_common.export_cached``) merged by onnxmerge
(and quantized with ``onnxmerge.quantize(weights="int8")``) on one side, converted by
ctranslate2's ``TransformersConverter`` with a synthetic vocabulary on the other, as
``bench_ctranslate2.py`` does. The corpus: seeded inputs of 5-64 ids whose lengths are drawn like
sentences' (log-normal around 20 ids), each ending in eos. Greedy and 4 beams, exactly
``NEW_TOKENS`` new tokens per input (eos forbidden before that on both sides), 2 threads, each
side, precision and case in a fresh process, alternated in the same run.

Each side's batching is its best on this machine: every candidate setting (``max_batch_size``
with ``batch_type`` ``examples`` or ``tokens``, one batch at a time or two at once, each with
half the threads: our ``parallel_batches=2``, CTranslate2's ``inter_threads=2``) translates the
whole corpus, each in a process of its own, and the fastest counts. Where a side's fastest is
the smallest or largest ``max_batch_size`` tried with as many batches at once, half or twice it
is tried too, on both sides, until it is not (``widen``): the grid must not hide a side's best.
A sample of the corpus would not do: its batches are cut from a few inputs, with more padding
than the corpus' length-sorted ones, which favours small batches.
Reported per case and setting: tokens per second (new tokens of the corpus over the corpus' wall
time) and the peak resident memory of the process translating the corpus; for the fastest, the
share of sampled inputs whose tokens equal those the same side generates for that input alone,
and the share of positions where both sides agree; and our fastest setting whose peak stays
within the memory target, against CTranslate2's fastest. Our session opens through a session cache
written beforehand (what every load after the first does); for greedy float32 that runs the int8
greedy head, which gives the float head's tokens (``docs/runtime.md``).

And the ceiling float32 sets: the floating-point operations of the weights' matrix products that
the corpus takes at the least on either side (``matrix_work``), over each side's time, against
this machine's rate for one float32 matrix product of the LM head's shape in onnxruntime,
measured in the same run (``matmul_rate``): the share of that rate each side reaches, and the
share that the speed target would need.

Then the int8 file quantized with one activation scale per row (``activation_scale="row"``), per
case at our int8 file's fastest batching, beside the int8 file run again at that batching: its
speed against the int8 file's and CTranslate2's int8, and how often its tokens equal alone.

Usage: python benchmarks/bench_corpus.py [--quick] [--inputs 1000]
    [--out benchmarks/out/corpus.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _anchor, _common  # noqa: E402
from benchmarks.bench_ctranslate2 import (  # noqa: E402
    anchor_probe,
    convert_ctranslate2,
    quantize_ours,
    reference_run,
    token_name,
)

NEW_TOKENS = 24
CASES = (("greedy", 1), ("beam4", 4))
# (batch type, max_batch_size, batches at once); a setting is named "examples 64" or, with
# two batches at once, "examples 64 x2".
CANDIDATES = (
    ("examples", 32, 1),
    ("examples", 64, 1),
    ("examples", 128, 1),
    ("examples", 256, 1),
    ("tokens", 1024, 1),
    ("examples", 32, 2),
    ("examples", 64, 2),
    ("examples", 128, 2),
    ("examples", 256, 2),
)
# --quick checks the pipeline, not which batching wins: each batch type, each way of running.
QUICK_CANDIDATES = (("examples", 16, 1), ("tokens", 1024, 2))
ROW = "int8 row"  # the int8 file with one activation scale per row
ALONE_SAMPLE = 24  # inputs generated alone as well, spread over the corpus
SHAPE = ("d_model", "vocab_size", "encoder_layers", "decoder_layers")
SHAPE += ("encoder_ffn_dim", "decoder_ffn_dim")
TARGETS = {  # ours / CTranslate2 tokens per second, at least; peak memory, at most
    "float32": {"greedy": 1.2, "beam4": 1.2, "peak_rss": 1.2},
    "int8": {"greedy": 1.2, "beam4": 1.0, "peak_rss": 1.2},
}


def corpus(count: int, config: dict, longest: int = 64) -> list[list[int]]:
    """Seeded inputs of 5 to ``longest`` ids, lengths log-normal around 20, ending in eos."""
    import numpy as np

    rng = np.random.default_rng(_common.SEED)
    lengths = np.clip(np.rint(rng.lognormal(np.log(20), 0.55, size=count)), 5, longest)
    low, high = 2, int(config["vocab_size"]) - 1
    return [
        [*rng.integers(low, high, size=int(n) - 1).tolist(), int(config["eos_token_id"])]
        for n in lengths
    ]


def matrix_work(shape: dict, lengths: list[int], beams: int) -> float:
    """Floating-point operations of the weights' matrix products that generating ``NEW_TOKENS``
    tokens for inputs of ``lengths`` takes at the least: every encoder layer on every source id,
    each decoder layer's cross-attention keys and values once per source id, and per decoder
    row and step the decoder's projections and the LM head, one row per input at the first
    step (the prompt) and ``beams`` after. Attention's own products, the norms and the search
    are left out."""
    d = shape["d_model"]
    per_source_id = shape["encoder_layers"] * (4 * d * d + 2 * d * shape["encoder_ffn_dim"])
    per_source_id += shape["decoder_layers"] * 2 * d * d
    per_row_step = shape["decoder_layers"] * (6 * d * d + 2 * d * shape["decoder_ffn_dim"])
    per_row_step += d * shape["vocab_size"]
    row_steps = len(lengths) * (1 + (NEW_TOKENS - 1) * beams)
    return 2.0 * (sum(lengths) * per_source_id + row_steps * per_row_step)


def matmul_rate(shape: dict, threads: int, rows: int = 256) -> float:
    """Floating-point operations per second of one float32 ``Gemm`` of the LM head's shape
    (``rows`` by ``d_model`` times ``d_model`` by ``vocab_size``) in onnxruntime with ``threads``
    threads: the best of 5 runs after one to warm up (``_common.timed_runs``)."""
    import numpy as np
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    d, vocab = shape["d_model"], shape["vocab_size"]
    rng = np.random.default_rng(_common.SEED)
    weight = (rng.standard_normal((vocab, d)) * 0.02).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)],
        "head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, vocab])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    session = onnxruntime.InferenceSession(
        onnx.shape_inference.infer_shapes(model).SerializeToString(),
        options,
        providers=["CPUExecutionProvider"],
    )
    feeds = {"x": rng.standard_normal((rows, d)).astype(np.float32)}
    times, _ = _common.timed_runs(lambda: session.run(None, feeds), 5)
    return 2.0 * rows * d * vocab / min(times)


def ceiling(precision: dict, work: dict[str, float], rate: float) -> dict:
    """Per case, each side's rate of the weights' matrix products over its whole run, as a
    share of ``rate``; and the share that the speed target would need ours to reach."""
    found = {}
    for case, operations in work.items():
        shares = {
            side: operations / precision[side]["cases"][case]["s"] / rate
            for side in ("ours", "ctranslate2")
        }
        found[case] = {
            "work_gflop": operations / 1e9,
            "shares": shares,
            "target_needs": precision["targets"][case] * shares["ctranslate2"],
        }
    return found


def setting_name(batch_type: str, size: int, parallel: int) -> str:
    return f"{batch_type} {size}" + (f" x{parallel}" if parallel > 1 else "")


def parse_setting(name: str) -> tuple[str, int, int]:
    batch_type, size, *at_once = name.split()
    return batch_type, int(size), int(at_once[0][1:]) if at_once else 1


def beyond_edge(runs: dict[str, dict], largest: int) -> str | None:
    """Where the fastest of ``runs`` (results by setting name) is an ``examples`` size at the
    edge of those tried with as many batches at once, the setting past that edge (half the
    smallest, twice the largest) not tried yet; None where the fastest lies between two tried
    sizes, or past the edge there is nothing to try (below 1 input, above ``largest``)."""
    fastest = max(runs, key=lambda k: runs[k]["tokens_per_s"])
    batch_type, size, parallel = parse_setting(fastest)
    if batch_type != "examples":
        return None
    sizes = sorted(s for t, s, p in map(parse_setting, runs) if t == batch_type and p == parallel)
    past = size // 2 if size == sizes[0] else size * 2 if size == sizes[-1] else 0
    if not 1 <= past <= largest:
        return None
    name = setting_name(batch_type, past, parallel)
    return None if name in runs else name


def widen(
    tried: dict[str, dict[str, dict]],
    run: Callable[[str, str], dict],
    deciding: Sequence[str],
    largest: int,
    most: int = 3,
) -> list[str]:
    """Settings beyond the grid, added to every side of ``tried`` (``run(side, setting)``, the
    sides alternated) while the fastest of a side in ``deciding`` is at the grid's edge, at
    most ``most`` of them: a side's best must lie between two tried sizes, or the grid hid a
    faster one. The names added, in order."""
    added: list[str] = []
    while len(added) < most:
        past = next(
            (n for n in (beyond_edge(tried[s], largest) for s in deciding) if n is not None), None
        )
        if past is None:
            break
        for side in tried:
            tried[side][past] = run(side, past)
        added.append(past)
    return added


def sampled(count: int) -> list[int]:
    step = max(1, count // ALONE_SAMPLE)
    return list(range(0, count, step))[:ALONE_SAMPLE]


# -- the child processes ---------------------------------------------------------------------------


FORCED = (NEW_TOKENS, NEW_TOKENS)  # (min, max) new tokens per input


class _Ours:
    def __init__(
        self,
        path: str,
        threads: int,
        session_cache: str | None,
        parallel: int,
        new_tokens: tuple[int, int],
        keep_rows: bool,
    ):
        import onnxmerge
        from onnxmerge._ort import shared_pool_threads
        from onnxmerge.runtime import Accelerations

        self.parallel = parallel
        self.new_tokens = new_tokens
        self.model = onnxmerge.Seq2SeqModel(
            path,
            threads=shared_pool_threads(parallel, threads),
            session_cache=session_cache,
            # kept: to the batch's end, as transformers runs
            accelerations=Accelerations(drop_finished=not keep_rows),
        )

    def run(self, inputs, beams: int, batch_type: str, size: int) -> list[list[int]]:
        import numpy as np

        results = self.model.generate_many(
            (np.asarray(i, np.int64) for i in inputs),
            max_batch_size=size,
            batch_type=batch_type,
            parallel_batches=self.parallel,
            num_beams=beams,
            min_new_tokens=self.new_tokens[0],
            max_new_tokens=self.new_tokens[1],
        )
        return [r[0, 1:].tolist() for r in results]


class _CTranslate2:
    def __init__(
        self, path: str, threads: int, config: dict, parallel: int, new_tokens: tuple[int, int]
    ):
        import ctranslate2

        self.translator = ctranslate2.Translator(
            path, device="cpu", inter_threads=parallel, intra_threads=threads // parallel
        )
        self.config = config
        self.new_tokens = new_tokens
        self.index = {token_name(i, config): i for i in range(int(config["vocab_size"]))}

    def run(self, inputs, beams: int, batch_type: str, size: int) -> list[list[int]]:
        source = [[token_name(i, self.config) for i in row] for row in inputs]
        out = self.translator.translate_batch(
            source,
            beam_size=beams,
            min_decoding_length=self.new_tokens[0],
            max_decoding_length=self.new_tokens[1],
            length_penalty=1.0,
            max_batch_size=size,
            batch_type=batch_type,
        )
        return [[self.index[t] for t in r.hypotheses[0]] for r in out]


def _runner(
    side: str,
    path: str,
    config: dict,
    threads: int,
    cache: str | None,
    parallel: int = 1,
    new_tokens: tuple[int, int] = FORCED,
    keep_rows: bool = False,
):
    if side == "ours":
        return _Ours(path, threads, cache, parallel, new_tokens, keep_rows)
    return _CTranslate2(path, threads, config, parallel, new_tokens)


def translate(
    side: str,
    path: str,
    config: dict,
    count: int,
    threads: int,
    cache: str | None,
    case: str,
    batching: str,
    new_tokens: tuple[int, int] = FORCED,
    keep_rows: bool = False,
):
    """The corpus in one case and batching, in a process of its own: its time and peak memory.
    ``new_tokens`` are the (min, max) new tokens per input; ``keep_rows``: ours runs ended rows
    to the batch's end."""
    batch_type, size, parallel = parse_setting(batching)
    runner = _runner(side, path, config, threads, cache, parallel, new_tokens, keep_rows)
    beams = dict(CASES)[case]
    inputs = corpus(count, config)
    runner.run(inputs[:8], beams, "examples", 8)  # warm-up
    start = time.perf_counter()
    tokens = runner.run(inputs, beams, batch_type, size)
    seconds = time.perf_counter() - start
    return {
        "s": seconds,
        "tokens_per_s": sum(map(len, tokens)) / seconds,
        "tokens": tokens,
        "peak_rss_mb": _common.self_rss_bytes()["peak_rss_bytes"] / 1e6,
    }


def alone(
    side: str, path: str, config: dict, count: int, threads: int, cache: str | None, case: str
):
    """The sampled inputs' tokens, each generated alone."""
    runner = _runner(side, path, config, threads, cache)
    inputs = corpus(count, config)
    beams = dict(CASES)[case]
    return {str(i): runner.run([inputs[i]], beams, "examples", 1)[0] for i in sampled(count)}


def side_worker(
    side: str,
    path: Path,
    config: dict,
    count: int,
    threads: int,
    cache: Path | None,
    case: str,
    batching: str | None = None,
    new_tokens: tuple[int, int] = FORCED,
    keep_rows: bool = False,
):
    """A worker: the corpus with ``batching`` (``translate``'s options), or without it the
    sampled inputs alone."""
    parallel = parse_setting(batching)[2] if batching else 1
    # CTranslate2 as its users run it: OpenMP's default wait policy (its threads spin while they
    # wait, which on a busy machine slows it several times: MachineUse refuses such a run).
    env = dict(os.environ, OMP_NUM_THREADS=str(threads // parallel))
    argv = [sys.executable, __file__, "--worker", side, "--path", str(path)]
    argv += ["--config", json.dumps(config), "--inputs", str(count), "--threads", str(threads)]
    argv += ["--session-cache", str(cache)] if cache else []
    argv += ["--case", case] + (["--batching", batching] if batching else [])
    argv += ["--new-tokens", *map(str, new_tokens)] + (["--keep-rows"] if keep_rows else [])
    result = subprocess.run(
        argv, check=True, capture_output=True, text=True, env=env, cwd=REPO_ROOT
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    if "anchor_probe" in measured:  # the same work at once in a plain process
        measured["reference"] = reference_run(path, config, PROBE_REPEATS, threads // parallel)
    return measured


# Timed calls of the anchor's reference work in each CTranslate2 corpus worker and beside it.
PROBE_REPEATS = 5


def anchor_checks(ct2_results: dict[str, list[dict]]) -> dict:
    """The reference check of each group of CTranslate2 workers (by name) that ran the probe:
    their probes against the reference processes run beside them."""
    checks = {}
    for name, results in ct2_results.items():
        probed = [r for r in results if "anchor_probe" in r]
        if probed:
            checks[name] = {
                **_anchor.check(
                    [r["anchor_probe"] for r in probed], [r["reference"]["times"] for r in probed]
                ),
                "reference_affinity": probed[0]["reference"]["affinity"],
            }
    return checks


def partial_path(out: Path) -> Path:
    """Where a run keeps what it has measured so far: beside ``out``, which keeps the last
    complete run's figures until this one passes its checks."""
    return out.with_name(out.stem + ".partial.json")


def probed_group(precision: str, batching: str, threads: int) -> str:
    """The check a corpus worker's probe belongs to: its precision and its threads per
    translator (the probe runs with that many)."""
    return f"{precision}, intra_threads={threads // parse_setting(batching)[2]}"


def _run_side(sides: dict[str, tuple], case: str, side: str, batching: str | None = None) -> dict:
    """``side_worker`` for ``side``, whose file and options ``sides`` holds: the corpus with
    ``batching``, or without it the sampled inputs alone."""
    return side_worker(side, *sides[side], case, batching)


def best_of(tried: dict[str, dict], alone_tokens: dict[str, list[int]]) -> dict:
    """A case's fastest setting with its tokens, every setting's speed and peak, and how many
    sampled inputs got their alone tokens."""
    name = max(tried, key=lambda k: tried[k]["tokens_per_s"])
    best = tried[name]
    same = [int(i) for i, t in alone_tokens.items() if best["tokens"][int(i)] == t]
    return {
        **best,
        "batching": name,
        "settings": {k: {n: v for n, v in r.items() if n != "tokens"} for k, r in tried.items()},
        "same_as_alone": len(same) / len(alone_tokens),
        "differs_alone": [int(i) for i in alone_tokens if int(i) not in same],
    }


def side_results(cases: dict[str, dict]) -> dict:
    """One side's cases and the larger peak of its fastest settings."""
    return {"peak_rss_mb": max(c["peak_rss_mb"] for c in cases.values()), "cases": cases}


# -- the parent ------------------------------------------------------------------------------------


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions with the same token, the last left out (ours ends with the forced eos
    there, as transformers does; CTranslate2 has no such option)."""
    pairs = [
        (x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra[:-1], rb[:-1], strict=True)
    ]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else 1.0


def compare(ours: dict, theirs: dict, targets: dict) -> dict:
    ratios = {
        case: ours["cases"][case]["tokens_per_s"] / theirs["cases"][case]["tokens_per_s"]
        for case in ours["cases"]
    }
    ratios["peak_rss"] = ours["peak_rss_mb"] / theirs["peak_rss_mb"]
    met = {k: (ratios[k] <= v if k == "peak_rss" else ratios[k] >= v) for k, v in targets.items()}
    agree = {
        case: agreement(ours["cases"][case]["tokens"], theirs["cases"][case]["tokens"])
        for case in ours["cases"]
    }
    return {
        "ratios": ratios,
        "targets": targets,
        "targets_met": met,
        "token_agreement": agree,
        "within_peak": within_peak(ours, theirs, targets["peak_rss"]),
    }


def fastest_within(settings: dict[str, dict], peak_rss_mb: float) -> str | None:
    """The fastest of ``settings`` whose peak stays within ``peak_rss_mb``; None if none does."""
    fitting = [k for k, r in settings.items() if r["peak_rss_mb"] <= peak_rss_mb]
    return max(fitting, key=lambda k: settings[k]["tokens_per_s"], default=None)


def within_peak(ours: dict, theirs: dict, peak_ratio: float) -> dict:
    """Per case, our fastest setting whose peak stays within ``peak_ratio`` times CTranslate2's
    (the larger of its fastest settings'), and its speed against CTranslate2's fastest: the one
    setting that answers both targets at once, where the fastest needs more memory."""
    found = {}
    for case, result in ours["cases"].items():
        settings = result["settings"]
        name = fastest_within(settings, peak_ratio * theirs["peak_rss_mb"])
        if name is None:
            found[case] = None
            continue
        found[case] = {
            "batching": name,
            "tokens_per_s": settings[name]["tokens_per_s"],
            "peak_rss_mb": settings[name]["peak_rss_mb"],
            "ratio": settings[name]["tokens_per_s"] / theirs["cases"][case]["tokens_per_s"],
            "peak_ratio": settings[name]["peak_rss_mb"] / theirs["peak_rss_mb"],
        }
    return found


def compare_row_scales(int8: dict, sides: dict[str, tuple]) -> dict:
    """Per case, at the int8 file's fastest batching: the int8 file and the row-scaled one, run
    one after the other, and the row-scaled one's sampled inputs alone."""
    cases = {}
    for case in int8["ours"]["cases"]:
        batching = int8["ours"]["cases"][case]["batching"]
        per_batch = side_worker(*sides["int8"], case, batching)
        per_row = side_worker(*sides[ROW], case, batching)
        found = best_of({batching: per_row}, side_worker(*sides[ROW], case))
        theirs = int8["ctranslate2"]["cases"][case]["tokens_per_s"]
        cases[case] = {
            "batching": batching,
            "tokens_per_s": per_row["tokens_per_s"],
            "peak_rss_mb": per_row["peak_rss_mb"],
            "per_batch_tokens_per_s": per_batch["tokens_per_s"],
            "vs_per_batch": per_row["tokens_per_s"] / per_batch["tokens_per_s"],
            "vs_ctranslate2": per_row["tokens_per_s"] / theirs,
            "same_as_alone": found["same_as_alone"],
            "differs_alone": found["differs_alone"],
            "per_batch_same_as_alone": int8["ours"]["cases"][case]["same_as_alone"],
        }
    return {"file": "onnxmerge.quantize(weights='int8', activation_scale='row')", "cases": cases}


def row_scales_markdown(data: dict) -> list[str]:
    if "row_scales" not in data:
        return []
    lines = [
        'int8 with one activation scale per row (`activation_scale="row"`, '
        "[quantization.md](quantization.md#activation-scales-per-batch-or-per-row)), at our int8 "
        "file's fastest batching, beside the int8 file (one scale per batch) run again at that "
        "batching just before it; *alone* as above:",
        "",
        "| search | batching | per batch tokens/s | per row tokens/s | per row / per batch "
        "| per row / CTranslate2 int8 | peak MB per row | alone: per batch | alone: per row |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case, r in data["row_scales"]["cases"].items():
        lines.append(
            f"| {case} | {r['batching']} | {r['per_batch_tokens_per_s']:.1f} "
            f"| {r['tokens_per_s']:.1f} | **{r['vs_per_batch']:.2f}x** "
            f"| {r['vs_ctranslate2']:.2f}x | {r['peak_rss_mb']:.0f} "
            f"| {r['per_batch_same_as_alone']:.2f} | {r['same_as_alone']:.2f} |"
        )
    return [*lines, ""]


def _without_tokens(side: dict) -> dict:
    cases = {k: {n: v for n, v in c.items() if n != "tokens"} for k, c in side["cases"].items()}
    return {**side, "cases": cases}


def _shared_note(environment: dict) -> str:
    start = environment.get("load_average_at_start")
    if not start or start[0] <= environment.get("cpu_count", 1):
        return ""
    return (
        " The machine was shared (a load above its CPU count): both sides ran in the same "
        "conditions, but each got a fraction of the processor, so these ratios are those of a "
        "loaded machine, not of a quiet one."
    )


def _column_order(setting: str) -> tuple[int, bool, int]:
    """One batch at a time before two at once, examples before tokens, small batches first."""
    batch_type, size, at_once = parse_setting(setting)
    return at_once, batch_type == "tokens", size


def widened_note(widened: dict[str, dict[str, list[str]]] | None) -> str:
    """What ``widen`` added to the grid in a run, for the text beside its tables."""
    if widened is None:  # a run from before the grid was widened
        return ""
    added = [
        f"{precision} {case}: {', '.join(names)}"
        for precision, cases in widened.items()
        for case, names in cases.items()
        if names
    ]
    text = (
        "; where a side's fastest was the smallest or largest size tried with as many batches "
        "at once, half or twice that size was tried too, on every side, until it was not, three "
        "at most"
    )
    return text + (f" (added: {'; '.join(added)})" if added else " (none was)")


def ceiling_markdown(data: dict) -> list[str]:
    """What the float32 matrix products allow: each side's share of this machine's rate."""
    c = data["float32_ceiling"]
    lines = [
        "float32: the weights' matrix products that the corpus takes at the least on either "
        "side (every encoder layer on every source id, the cross-attention keys and values "
        "once per source id, and per decoder row and step the projections and the LM head), "
        "over each side's whole run, against this machine's rate for one float32 `Gemm` of "
        "the LM head's shape in onnxruntime (256 rows, the same threads, measured in the same "
        f"run): {c['matmul_gflops']:.0f} GFLOP/s. A share near 100% leaves no time to gain "
        "without fewer products. Ours can pass 100% in greedy search, whose int8 head leaves "
        "most of the LM head's float products out (docs/runtime.md).",
        "",
        "| search | matrix products, GFLOP | CTranslate2: share of the rate "
        "| onnxmerge: share of the rate | the speed target needs |",
        "|---|---:|---:|---:|---:|",
    ]
    for case, r in c["cases"].items():
        lines.append(
            f"| {case} | {r['work_gflop']:.0f} | {r['shares']['ctranslate2']:.0%} "
            f"| {r['shares']['ours']:.0%} | **{r['target_needs']:.0%}** |"
        )
    return lines


def markdown(data: dict) -> list[str]:
    """The section of docs/benchmarks.md."""
    from benchmarks.run_all import _load_averages

    s = data["setting"]
    ids = s["source_ids"]
    lines = [
        "## A corpus against CTranslate2 (`generate_many`)",
        "",
        f"{data['model']}, {s['inputs']} inputs of {ids['min']}-{ids['max']} source ids "
        f"({ids['total']} in all, lengths drawn like sentences', fixed seed), exactly "
        f"{s['new_tokens_per_input']} new tokens each, {s['threads']} threads "
        "(`benchmarks/bench_corpus.py`). Ours: "
        f"{s['ours']}; CTranslate2: {s['ctranslate2']}. Each side's batching is the fastest of "
        f"{', '.join(s['candidates'])} (x2: two batches at once, each with half the threads), "
        "each over the whole corpus in a process of its own (the third table has them all; a "
        f"sample would favour small batches){widened_note(s.get('widened'))}. Tokens/s is "
        "new tokens over the corpus' wall time; the ratio is onnxmerge / CTranslate2, above 1 is "
        "better (for memory, below 1). *Alone* is the share of "
        f"{s['alone_sample']} sampled inputs whose tokens equal those the same side generates "
        "for that input alone; *agreement* the share of positions where both sides agree (the "
        "last, a forced eos on our side, left out). Load average of this run: "
        f"{_load_averages(data['environment'])}; "
        f"processor: {_common.processor_words(data['environment'])}."
        + _anchor.sentence(data)
        + _shared_note(data["environment"]),
        "",
        "| precision | search | CTranslate2 tokens/s (batching) | onnxmerge tokens/s (batching) "
        "| ratio | target | peak MB: CTranslate2 / onnxmerge | alone: CTranslate2 "
        "| alone: onnxmerge | agreement |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for precision, p in data["precisions"].items():
        for case, ratio in p["ratios"].items():
            target = p["targets"].get(case)
            if case == "peak_rss":
                ours, theirs = p["ours"]["peak_rss_mb"], p["ctranslate2"]["peak_rss_mb"]
                lines.append(
                    f"| {precision} | peak memory, the larger case | {theirs:.0f} MB | "
                    f"{ours:.0f} MB | **{ratio:.2f}x** | <= {target}x | | | | |"
                )
                continue
            ours, theirs = p["ours"]["cases"][case], p["ctranslate2"]["cases"][case]
            lines.append(
                f"| {precision} | {case} | {theirs['tokens_per_s']:.1f} ({theirs['batching']}) "
                f"| {ours['tokens_per_s']:.1f} ({ours['batching']}) | **{ratio:.2f}x** "
                f"| >= {target}x | {theirs['peak_rss_mb']:.0f} / {ours['peak_rss_mb']:.0f} "
                f"| {theirs['same_as_alone']:.2f} | {ours['same_as_alone']:.2f} "
                f"| {p['token_agreement'][case]:.2f} |"
            )
    lines += ["", *ceiling_markdown(data)] if "float32_ceiling" in data else []
    lines += [
        "",
        "Our fastest setting whose peak stays within the memory target (the larger of "
        "CTranslate2's two peaks times the target), against CTranslate2's fastest:",
        "",
        "| precision | search | onnxmerge tokens/s (batching) | ratio | target "
        "| peak MB: onnxmerge | peak ratio |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for precision, p in data["precisions"].items():
        for case, point in p.get("within_peak", {}).items():
            target = p["targets"].get(case)
            if point is None:
                lines.append(f"| {precision} | {case} | none fits | | >= {target}x | | |")
                continue
            lines.append(
                f"| {precision} | {case} | {point['tokens_per_s']:.1f} ({point['batching']}) "
                f"| **{point['ratio']:.2f}x** | >= {target}x | {point['peak_rss_mb']:.0f} "
                f"| {point['peak_ratio']:.2f}x |"
            )
    ran = {
        name
        for p in data["precisions"].values()
        for side in ("ctranslate2", "ours")
        for case in p[side]["cases"].values()
        for name in case["settings"]
    }
    columns = sorted(ran, key=_column_order)
    lines += [
        "",
        "Every setting, tokens/s (peak memory); empty where a setting was not tried:",
        "",
        "| precision | search | side | " + " | ".join(columns) + " |",
        "|---|---|---|" + "---:|" * len(columns),
    ]
    for precision, p in data["precisions"].items():
        for case in p["ours"]["cases"]:
            for side in ("ctranslate2", "ours"):
                tried = p[side]["cases"][case]["settings"]
                cells = [
                    f"{tried[c]['tokens_per_s']:.0f} ({tried[c]['peak_rss_mb']:.0f} MB)"
                    if c in tried
                    else ""
                    for c in columns
                ]
                name = "CTranslate2" if side == "ctranslate2" else "onnxmerge"
                lines.append(f"| {precision} | {case} | {name} | " + " | ".join(cells) + " |")
    return [*lines, "", *row_scales_markdown(data)]


def main(argv: list[str] | None = None) -> int:
    parser = _common.arguments(__doc__, "corpus", "tiny Marian model, 48 inputs")
    parser.add_argument("--inputs", type=int, default=1000, help="inputs in the corpus")
    _common.worker_arguments(parser)
    parser.add_argument("--case", choices=[c for c, _ in CASES], help=argparse.SUPPRESS)
    parser.add_argument("--batching", help=argparse.SUPPRESS)
    parser.add_argument("--new-tokens", type=int, nargs=2, default=FORCED, help=argparse.SUPPRESS)
    parser.add_argument("--keep-rows", action="store_true", help=argparse.SUPPRESS)
    _anchor.add_argument(parser)
    args = parser.parse_args(argv)
    _common.compile_bytecode()
    if args.worker:
        config = json.loads(args.config)
        given = (args.worker, args.path, config, args.inputs, args.threads, args.session_cache)
        if args.batching:
            result = translate(*given, args.case, args.batching, args.new_tokens, args.keep_rows)
            if args.worker == "ctranslate2":  # after the corpus, whose peak memory it left
                threads = args.threads // parse_setting(args.batching)[2]
                result["anchor_probe"] = anchor_probe(args.path, config, PROBE_REPEATS, threads)
        else:
            result = alone(*given, args.case)
        print(json.dumps(result))
        return 0
    candidates = QUICK_CANDIDATES if args.quick else CANDIDATES
    if args.quick:
        args.inputs = min(args.inputs, 48)
    load_at_start = os.getloadavg()
    machine = _anchor.MachineUse()
    started = time.perf_counter()
    export, config = _common.marian_export(args.quick, args.cache_dir)
    import onnxmerge

    scratch = Path(tempfile.mkdtemp(prefix="bench-corpus-"))
    try:
        float_path = onnxmerge.merge_seq2seq(export.onnx_dir, scratch / "float32" / "model.onnx")
        int8_path = scratch / "int8" / "model.onnx"
        int8_path.parent.mkdir()
        quantize_ours(float_path, int8_path)
        row_path = scratch / "int8-row" / "model.onnx"
        row_path.parent.mkdir()
        onnxmerge.quantize(float_path, row_path, weights="int8", activation_scale="row")
        ours = {"float32": float_path, "int8": int8_path, ROW: row_path}
        caches = {}
        for precision, path in ours.items():  # entries written before the timed runs
            caches[precision] = scratch / f"session-cache-{precision.replace(' ', '-')}"
            onnxmerge.Seq2SeqModel(path, session_cache=caches[precision])
        ct2 = convert_ctranslate2(export.pytorch_dir, scratch, config)
        precisions = {}
        probed: dict[str, list[dict]] = {}
        widened: dict[str, dict[str, list[str]]] = {"float32": {}, "int8": {}}
        for precision in ("float32", "int8"):
            sides = {
                "ctranslate2": (ct2[precision], config, args.inputs, args.threads, None),
                "ours": (ours[precision], config, args.inputs, args.threads, caches[precision]),
            }
            cases: dict[str, dict] = {side: {} for side in sides}
            for case, _ in CASES:
                run = functools.partial(_run_side, sides, case)
                tried: dict[str, dict] = {side: {} for side in sides}
                for candidate in candidates:
                    name = setting_name(*candidate)
                    for side in sides:  # alternated, setting by setting
                        tried[side][name] = run(side, name)
                if not args.quick:  # the quick run checks the pipeline, not the grid
                    widened[precision][case] = widen(tried, run, list(sides), args.inputs)
                for name, result in tried["ctranslate2"].items():
                    group = probed_group(precision, name, args.threads)
                    probed.setdefault(group, []).append(result)
                for side in sides:
                    cases[side][case] = best_of(tried[side], run(side))
            theirs = side_results(cases["ctranslate2"])
            mine = side_results(cases["ours"])
            precisions[precision] = {
                **compare(mine, theirs, TARGETS[precision]),
                "ours": _without_tokens(mine),
                "ctranslate2": _without_tokens(theirs),
            }
            _common.write_results(partial_path(args.out), {"precisions": precisions})
        sides = {
            "int8": ("ours", ours["int8"], config, args.inputs, args.threads, caches["int8"]),
            ROW: ("ours", ours[ROW], config, args.inputs, args.threads, caches[ROW]),
        }
        row_scales = compare_row_scales(precisions["int8"], sides)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    import ctranslate2
    import onnxruntime

    lengths = [len(i) for i in corpus(args.inputs, config)]
    full = _common.marian_config(args.quick)()
    shape = {k: int(getattr(full, k)) for k in SHAPE}
    rate = matmul_rate(shape, args.threads)
    work = {case: matrix_work(shape, lengths, beams) for case, beams in CASES}
    results = {
        "benchmark": "corpus",
        "model": "tiny Marian" if args.quick else "opus-mt-fr-en shape",
        "setting": {
            "inputs": args.inputs,
            "source_ids": {"min": min(lengths), "max": max(lengths), "total": sum(lengths)},
            "new_tokens_per_input": NEW_TOKENS,
            "threads": args.threads,
            "candidates": [setting_name(*c) for c in candidates],
            "widened": None if args.quick else widened,
            "alone_sample": len(sampled(args.inputs)),
            "ours": "Seq2SeqModel(threads=threads - x + 1).generate_many(max_batch_size, "
            "batch_type, parallel_batches=x) through a session cache written beforehand",
            "ctranslate2": "Translator(inter_threads=x, intra_threads=threads / x)"
            ".translate_batch(max_batch_size, batch_type), OpenMP's default wait policy",
            "peak_rss": "VmHWM of the process translating the corpus, one per side, precision, "
            "case and setting; the larger of the two cases' fastest settings",
        },
        "precisions": precisions,
        "row_scales": row_scales,
        "float32_ceiling": {
            "matmul_gflops": rate / 1e9,
            "cases": ceiling(precisions["float32"], work, rate),
        },
        "seconds": time.perf_counter() - started,
        "environment": _common.environment(
            load_at_start, onnxruntime=onnxruntime.__version__, ctranslate2=ctranslate2.__version__
        ),
    }
    status = _anchor.finish(args.out, results, anchor_checks(probed), machine, args.anchor_check)
    if status:
        return status
    for case, c in results["float32_ceiling"]["cases"].items():
        shares = {side: f"{share:.0%}" for side, share in c["shares"].items()}
        print(
            f"float32 {case}: {c['work_gflop']:.4g} GFLOP of matrix products; share of the "
            f"machine's rate: {shares}; the target needs {c['target_needs']:.0%}"
        )
    for precision, data in precisions.items():
        ratios = {k: round(v, 2) for k, v in data["ratios"].items()}
        print(f"{precision}: ours/ctranslate2 {ratios}; targets met {data['targets_met']}")
        for case, point in data["within_peak"].items():
            if point is not None:
                print(
                    f"  {case} within the memory target: {point['batching']}, "
                    f"{point['ratio']:.2f}x at {point['peak_ratio']:.2f}x the peak"
                )
    for case, r in row_scales["cases"].items():
        print(
            f"int8 row scales, {case} at {r['batching']}: {r['vs_per_batch']:.2f}x the int8 "
            f"file, {r['vs_ctranslate2']:.2f}x CTranslate2's int8, alone {r['same_as_alone']:.2f}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
