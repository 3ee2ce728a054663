"""Generation against CTranslate2: the merged file on onnxruntime against CTranslate2's model.

The same seeded PyTorch folder (opus-mt-fr-en shape, ``_common.export_cached``) is exported with
optimum and merged by the onnxmerge under test on one side, and converted by ctranslate2's
``TransformersConverter`` on the other (at float32 and at int8; the converter needs a tokenizer,
so a synthetic word-level vocabulary ``t0 ... tN`` is written into a copy of the folder). Both
sides get the same ids; each side runs in a fresh process with 2 threads: greedy and 4 beams at
batch 1 (32 source ids) and batch 8 (mixed lengths), exactly 32 new tokens (eos is forbidden
before that on both sides), load time (import + load, and each apart), resident memory after
the import and after load, and how often the generated tokens agree. Every ratio also comes with
its lowest and highest value over the rounds, as the spread between runs on a small machine.

Our files, each against CTranslate2 at its precision: the plain merged file (``float32``); the
same with its weights in a data file beside it (``float32 external data``, which onnxruntime maps
rather than parses); the export's files each through onnxruntime's transformer optimizer before
the merge (``float32 optimized``); the two-decoder form of format 2 (``float32 format 2``, the
reference for format 3); ``onnxmerge.quantize(..., weights="int8")`` of the four
(``int8``, ``int8 external data``, ``int8 optimized``); onnxruntime's
``quantize_dynamic(QInt8, EnableSubgraph)`` on the merged file (``int8 quantize_dynamic``), a
reference for onnxruntime's int8 kernels; and the plain float32 and int8 files opened through a
session cache whose entry was written before the timed runs (``float32 session cache``,
``int8 session cache``), what every load after the first costs; ``weights="int4"`` of the
plain file (``int4``), held against CTranslate2's int8; and the plain float32 and int8
files with their steps run by OpenVINO's CPU plug-in (``benchmarks/_openvino_backend.py``
under ``Seq2SeqModel``'s search, float32 arithmetic; ``float32
openvino``, ``int8 openvino``), each also against onnxruntime on the same file
(``vs_onnxruntime``), when the openvino package is installed.

Each round runs, beside each CTranslate2 process, CTranslate2's documented one-liner in a clean
process (``benchmarks/_anchor.py``); where the benchmark's CTranslate2 side disagrees with it by
more than the machine's spread allows, or other processes used the machine during the run,
nothing is written to ``--out`` and the run exits 3. Times are each side's best.

Usage: python benchmarks/bench_ctranslate2.py [--quick] [--out benchmarks/out/ctranslate2.json]
    [--repeats 5] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _anchor, _common  # noqa: E402

SOURCE_TOKENS = 32
NEW_TOKENS = 32
BATCH_LENGTHS = (32, 9, 27, 14, 31, 5, 20, 24)  # batch 8, mixed lengths
CASES = [("greedy", 1, 1), ("greedy", 8, 1), ("beam4", 1, 4), ("beam4", 8, 4)]
# Ratios beside the cases' times; the import is each runtime's (onnxruntime and numpy on our side),
# the same for every model a process loads.
RATIO_MEASURES = (
    "rss_after_load_mb",
    "rss_import_and_load_mb",
    "rss_added_by_load_mb",
    "load_s",
    "import_s",
    "load_without_import_s",
)
SIDE_MEASURES = (*RATIO_MEASURES, "rss_before_load_mb", "rss_after_import_mb")
TARGETS = {
    "float32": {
        "greedy_b1": 0.8,
        "beam4_b1": 0.6,
        "rss_import_and_load_mb": 1.05,
        "load_without_import_s": 2.0,
    },
    "int8": {"greedy_b1": 0.6, "beam4_b1": 0.8, "rss_import_and_load_mb": 1.15, "load_s": 1.0},
}
# Variants held to targets of their own; int4 is compared with CTranslate2's int8.
VARIANT_TARGETS = {"int4": {"greedy_b1": 0.5, "beam4_b1": 0.6, "rss_import_and_load_mb": 0.9}}


def token_name(i: int, config: dict) -> str:
    if i == config["eos_token_id"]:
        return "</s>"
    if i == config["pad_token_id"]:
        return "<pad>"
    return "<unk>" if i == 1 else f"t{i}"


def source_batches(config: dict) -> dict[int, list[list[int]]]:
    """Seeded source ids ending in eos, avoiding the special ids: batch 1 and batch 8."""
    import numpy as np

    rng = np.random.default_rng(_common.SEED)
    low, high = 2, int(config["vocab_size"]) - 1

    def row(n: int) -> list[int]:
        return [*rng.integers(low, high, size=n - 1).tolist(), int(config["eos_token_id"])]

    return {1: [row(SOURCE_TOKENS)], 8: [row(n) for n in BATCH_LENGTHS]}


# -- building both sides ---------------------------------------------------------------------------


def write_synthetic_tokenizer(folder: Path, config: dict) -> None:
    """A word-level tokenizer whose token ``i`` is ``t{i}`` (special ids keep their names)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token_name(i, config): i for i in range(int(config["vocab_size"]))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    ).save_pretrained(folder)


def convert_ctranslate2(pytorch_dir: Path, scratch: Path, config: dict) -> dict[str, Path]:
    import ctranslate2

    source = scratch / "pytorch-with-tokenizer"
    source.mkdir()
    for item in pytorch_dir.iterdir():
        (source / item.name).symlink_to(item.resolve())
    write_synthetic_tokenizer(source, config)
    out = {}
    for precision, quantization in (("float32", None), ("int8", "int8")):
        out[precision] = scratch / f"ct2-{precision}"
        converter = ctranslate2.converters.TransformersConverter(str(source))
        converter.convert(str(out[precision]), quantization=quantization)
    return out


def quantize_ours(merged: Path, target: Path) -> str:
    """Our int8 file; returns how it was made."""
    import onnxmerge

    onnxmerge.quantize(merged, target, weights="int8")
    return "onnxmerge.quantize(weights='int8')"


def quantize_int4(merged: Path, target: Path) -> str:
    import onnxmerge

    onnxmerge.quantize(merged, target, weights="int4")
    return "onnxmerge.quantize(weights='int4'), against CTranslate2's int8"


def quantize_dynamic_stand_in(merged: Path, target: Path) -> str:
    """onnxruntime's own int8 on the merged file: kernels to compare ours with, not a format."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        merged, target, weight_type=QuantType.QInt8, extra_options={"EnableSubgraph": True}
    )
    return "onnxruntime quantize_dynamic(QInt8, EnableSubgraph) on the merged file"


def optimize_for_onnxruntime(onnx_dir: Path, target_dir: Path) -> Path:
    """Each export file through onnxruntime's transformer optimizer (model type ``bart``, as
    optimum maps Marian), the rest of the folder copied; returns the new folder."""
    from onnxruntime.transformers.optimizer import optimize_model

    config = json.loads((onnx_dir / "config.json").read_text())
    target_dir.mkdir(parents=True)
    for item in onnx_dir.iterdir():
        if item.suffix == ".onnx" or item.name.endswith(".onnx_data"):
            continue
        if item.is_file():
            shutil.copy2(item, target_dir / item.name)
    for name in ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"):
        optimized = optimize_model(
            os.fspath(onnx_dir / name),
            model_type="bart",
            num_heads=int(config["encoder_attention_heads"]),
            hidden_size=int(config["d_model"]),
        )
        optimized.save_model_to_file(os.fspath(target_dir / name))
    return target_dir


def build_ours(
    onnx_dir: Path, scratch: Path, references: bool = True
) -> tuple[dict[str, tuple[str, Path]], dict]:
    """Our files, by variant name: ``(precision, path)``, and how each was made; without
    ``references``, no int8 file made from the optimized one or by ``quantize_dynamic``."""
    import onnxmerge

    plain = onnxmerge.merge_seq2seq(onnx_dir, scratch / "plain" / "model.onnx")
    external = onnxmerge.merge_seq2seq(
        onnx_dir, scratch / "external" / "model.onnx", external_data=True
    )
    optimized_dir = optimize_for_onnxruntime(onnx_dir, scratch / "optimized-export")
    optimized = onnxmerge.merge_seq2seq(optimized_dir, scratch / "optimized" / "model.onnx")
    files = {
        "float32": ("float32", plain),
        "float32 external data": ("float32", external),
        "float32 optimized": ("float32", optimized),
    }
    made_by = {
        "float32": "merge_seq2seq of the export",
        "float32 format 2": "merge_seq2seq(format_version=2): the two decoders under the If",
        "float32 external data": "merge_seq2seq(external_data=True): model.onnx + model.onnx_data",
        "float32 optimized": "each export file through optimize_model(model_type='bart'), merged",
    }
    two_decoders = None
    if references:
        two_decoders = onnxmerge.merge_seq2seq(
            onnx_dir, scratch / "format-2" / "model.onnx", format_version=2
        )
        files["float32 format 2"] = ("float32", two_decoders)
    makers = [
        ("int8", plain, quantize_ours),
        # quantize keeps the source's layout: the weights go to model.onnx_data
        ("int8 external data", external, quantize_ours),
    ]
    if references:
        makers += [
            ("int8 format 2", two_decoders, quantize_ours),
            ("int4", plain, quantize_int4),
            ("int8 optimized", optimized, quantize_ours),
            ("int8 quantize_dynamic", plain, quantize_dynamic_stand_in),
        ]
    for variant, source, maker in makers:
        target = scratch / variant.replace(" ", "-") / "model.onnx"
        target.parent.mkdir()
        try:
            made_by[variant] = maker(source, target)
        except onnxmerge.OnnxMergeError as error:  # e.g. a fused graph quantize does not know
            made_by[variant] = f"not made: {error}"
            continue
        if source is two_decoders:
            made_by[variant] += " on the format 2 file"
        elif source is not plain:
            made_by[variant] += (
                f" on the {'optimized' if source is optimized else 'external data'} file"
            )
        files[variant] = ("int8", target)
    return files, {v: made_by[v] for v in made_by}


# Variants that open a file of another variant through a session cache, written before the timed
# runs: what every load after the first costs.
SESSION_CACHED = {"float32 session cache": "float32", "int8 session cache": "int8"}


def warm_session_caches(ours: dict, made_by: dict, folder: Path) -> dict[str, Path]:
    """Add the session-cache variants to ``ours`` and write their cache entries; their folders."""
    import onnxmerge

    caches = {}
    for variant, base in SESSION_CACHED.items():
        if base not in ours:
            continue
        ours[variant] = ours[base]
        caches[variant] = folder / variant.replace(" ", "-")
        model = onnxmerge.Seq2SeqModel(ours[base][1], session_cache=caches[variant])
        greedy = "; greedy steps through its int8 head" if model._session.greedy_head else ""
        made_by[variant] = (
            f"the {base} file, loaded with session_cache= (entry written beforehand{greedy})"
        )
    return caches


# Variants that open the one file of another variant by path, as before the skeleton opening:
# onnxruntime parses the weights rather than mapping them (Accelerations(mapped_open=False)).
BY_PATH = {"float32 by path": "float32", "int8 by path": "int8"}


def add_by_path(ours: dict, made_by: dict) -> None:
    """Add the by-path variants of the one-file variants in ``ours``."""
    for variant, base in BY_PATH.items():
        if base in ours:
            ours[variant] = ours[base]
            made_by[variant] = f"the {base} file, opened by path: its weights parsed, not mapped"


# The one file against its weights in a data file (``docs/format.md``): it must cost nothing.
ONE_FILE_TARGETS = {"rss_import_and_load_mb": 1.05, "load_s": 1.15, "greedy_b1": 1.05}


def one_file_against_external_data(precisions: dict) -> dict:
    """Per precision, the one file's measures over the external-data layout's, same run."""
    out = {}
    for precision in ("float32", "int8"):
        one, two = precisions.get(precision), precisions.get(f"{precision} external data")
        if one is None or two is None:
            continue
        ratios = {
            "rss_import_and_load_mb": one["ours"]["rss_import_and_load_mb"]
            / two["ours"]["rss_import_and_load_mb"],
            "load_s": one["ours"]["load_s"] / two["ours"]["load_s"],
            "greedy_b1": one["ours"]["cases"]["greedy_b1"]["s"]
            / two["ours"]["cases"]["greedy_b1"]["s"],
        }
        met = {k: ratios[k] <= v for k, v in ONE_FILE_TARGETS.items()}
        out[precision] = {"ratios": ratios, "targets": ONE_FILE_TARGETS, "targets_met": met}
    return out


# -- the child processes ---------------------------------------------------------------------------


def _padded(rows: list[list[int]], pad: int):
    import numpy as np

    width = max(map(len, rows))
    ids = np.full((len(rows), width), pad, dtype=np.int64)
    mask = np.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = row
        mask[r, : len(row)] = 1
    return ids, mask


def _side(
    load_s: float, import_s: float, rss_before: int, rss_imported: int, rss: int, cases: dict
) -> dict:
    """One side's measurements, as both workers report them."""
    return {
        "load_s": load_s,
        "import_s": import_s,
        "rss_before_load_mb": rss_before / 1e6,
        "rss_after_import_mb": rss_imported / 1e6,
        "rss_after_load_mb": rss / 1e6,
        "cases": cases,
    }


# Variants that run the file of another variant in OpenVINO rather than onnxruntime.
OPENVINO = {"float32 openvino": "float32", "int8 openvino": "int8"}


def add_openvino(ours: dict, made_by: dict) -> None:
    """Add the OpenVINO variants to ``ours`` when the openvino package is installed."""
    import importlib.util

    if importlib.util.find_spec("openvino") is None:
        return
    for variant, base in OPENVINO.items():
        if base in ours:
            ours[variant] = ours[base]
            made_by[variant] = f"the {base} file, its steps run by OpenVINO (CPU, float32)"


def worker_ours(
    path: str,
    config: dict,
    repeats: int,
    threads: int,
    session_cache: str | None = None,
    backend: str = "onnxruntime",
    by_path: bool = False,
) -> dict:
    rss_before = _common.self_rss_bytes()["rss_bytes"]
    start = time.perf_counter()
    if backend == "openvino":
        import openvino  # noqa: F401 - part of the import, as onnxruntime's below
    else:
        import onnxruntime  # noqa: F401 - imported by the first load otherwise; part of the import

    import onnxmerge
    from onnxmerge._ort import session_options

    imported = time.perf_counter()
    rss_imported = _common.self_rss_bytes()["rss_bytes"]
    options = session_options()
    options.intra_op_num_threads = threads
    if backend == "onnxruntime":
        from onnxmerge.runtime import Accelerations

        opening = Accelerations(mapped_open=not by_path)
        model = onnxmerge.Seq2SeqModel(
            path, session_options=options, session_cache=session_cache, accelerations=opening
        )
    else:  # the same search on another runtime's steps
        from benchmarks._openvino_backend import openvino_model

        model = openvino_model(path, threads)
    load_s = time.perf_counter() - start
    import_s = imported - start
    rss = _common.self_rss_bytes()["rss_bytes"]
    cases = {}
    for name, batch, beams in CASES:
        ids, mask = _padded(source_batches(config)[batch], config["pad_token_id"])

        def run(ids=ids, mask=mask, beams=beams):
            return _common.generate_exactly(model, ids, mask, beams, NEW_TOKENS)

        median, times, out = _common.median_time(run, repeats)
        cases[f"{name}_b{batch}"] = {
            "s": median,
            "times": times,
            "tokens": [r[1:].tolist() for r in out],
        }
    # The file onnxruntime read: the session-cache variants must have read their entry.
    side = _side(load_s, import_s, rss_before, rss_imported, rss, cases)
    return {**side, "opened": str(model._session.opened)}


def worker_ctranslate2(path: str, config: dict, repeats: int, threads: int) -> dict:
    rss_before = _common.self_rss_bytes()["rss_bytes"]
    start = time.perf_counter()
    import ctranslate2

    imported = time.perf_counter()
    rss_imported = _common.self_rss_bytes()["rss_bytes"]
    translator = ctranslate2.Translator(path, device="cpu", inter_threads=1, intra_threads=threads)
    load_s = time.perf_counter() - start
    import_s = imported - start
    rss = _common.self_rss_bytes()["rss_bytes"]
    index = {token_name(i, config): i for i in range(int(config["vocab_size"]))}
    cases = {}
    for name, batch, beams in CASES:
        source = [[token_name(i, config) for i in row] for row in source_batches(config)[batch]]

        def run(source=source, beams=beams):
            return translator.translate_batch(
                source,
                beam_size=beams,
                max_decoding_length=NEW_TOKENS,
                min_decoding_length=NEW_TOKENS,
                length_penalty=1.0,
                max_batch_size=0,
            )

        median, times, out = _common.median_time(_anchor.slowed(run), repeats)
        cases[f"{name}_b{batch}"] = {
            "s": median,
            "times": times,
            "tokens": [[index[t] for t in r.hypotheses[0]] for r in out],
        }
    return _side(load_s, import_s, rss_before, rss_imported, rss, cases)


def reference_run(path: Path, config: dict, repeats: int, threads: int) -> dict:
    """CTranslate2's documented one-liner on ``path``, greedy at batch 1 on the same source as
    the ``greedy_b1`` case, in a clean process (``_anchor.reference``)."""
    source = [[token_name(i, config) for i in row] for row in source_batches(config)[1]]
    return _anchor.reference(
        path, source, threads=threads, beams=1, new_tokens=NEW_TOKENS, repeats=repeats
    )


def anchor_probe(path: str, config: dict, repeats: int, threads: int) -> list[float]:
    """The reference's work (``reference_run``) in this process, through the same one-liner:
    its timed calls. A worker that times CTranslate2 on other work runs it too, so that its
    process's conditions are checked against the reference's."""
    import ctranslate2

    source = [[token_name(i, config) for i in row] for row in source_batches(config)[1]]
    translator = ctranslate2.Translator(path, device="cpu", intra_threads=threads)

    def run():
        return translator.translate_batch(
            source, beam_size=1, max_decoding_length=NEW_TOKENS, min_decoding_length=NEW_TOKENS
        )

    return _common.timed_runs(_anchor.slowed(run), repeats)[0]


def reference_checks(ct2_runs: dict[str, list[dict]], references: dict[str, list[dict]]) -> dict:
    """Each precision's anchor check: CTranslate2's ``greedy_b1`` times in the benchmark's
    workers against the same work in the reference processes."""
    return {
        precision: {
            **_anchor.check(
                [r["cases"]["greedy_b1"]["times"] for r in runs],
                [r["times"] for r in references[precision]],
            ),
            "reference_runs": references[precision],
        }
        for precision, runs in ct2_runs.items()
    }


def worker_process(
    side: str,
    path: Path,
    config: dict,
    repeats: int,
    threads: int,
    session_cache: Path | None,
    backend: str = "onnxruntime",
    by_path: bool = False,
) -> dict:
    """A fresh process of ``side``'s worker (``ours`` or ``ctranslate2``) on ``path``: its
    measurements."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cache = ["--session-cache", str(session_cache)] if session_cache else []
    if backend != "onnxruntime":
        cache += ["--backend", backend]
    if by_path:
        cache.append("--open-by-path")
    result = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            side,
            "--path",
            str(path),
            "--config",
            json.dumps(config),
            "--repeats",
            str(repeats),
            "--threads",
            str(threads),
            *cache,
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- the parent ------------------------------------------------------------------------------------


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions with the same token, over the first ``NEW_TOKENS - 1`` of each row.

    The last position is left out: the model's ``forced_eos_token_id`` makes ours (as
    transformers) end with eos there, and CTranslate2 has no such option.
    """
    n = NEW_TOKENS - 1
    pairs = [
        (x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra[:n], rb[:n], strict=True)
    ]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else 1.0


def _derived(run: dict) -> dict:
    """A run's measures: its own, and what loading the model adds to the import."""
    return {
        **run,
        "load_without_import_s": run["load_s"] - run["import_s"],
        "rss_added_by_load_mb": run["rss_after_load_mb"] - run["rss_after_import_mb"],
        "rss_import_and_load_mb": run["rss_after_load_mb"] - run["rss_before_load_mb"],
    }


# Times take the best of a side's processes (the machine's noise only adds time); memory the median.
BEST_MEASURES = ("load_s", "import_s", "load_without_import_s")


def _summary(runs: list[dict]) -> dict:
    """One side over its processes: each case's best time (over every timed run), the best load
    and import times, the median of each memory measure."""
    runs = [_derived(r) for r in runs]
    out = {
        k: (min if k in BEST_MEASURES else statistics.median)(r[k] for r in runs)
        for k in SIDE_MEASURES
    }
    out["cases"] = {
        case: {
            "s": min(_best(r["cases"][case]) for r in runs),
            "tokens": runs[0]["cases"][case]["tokens"],
        }
        for case in runs[0]["cases"]
    }
    return out


def _best(case: dict) -> float:
    """A case's best time in one process (its median where a run kept no times)."""
    return min(case.get("times") or [case["s"]])


def _ratios(ours: dict, theirs: dict) -> dict:
    ratios = {c: _best(ours["cases"][c]) / _best(theirs["cases"][c]) for c in ours["cases"]}
    ratios.update({k: ours[k] / theirs[k] for k in RATIO_MEASURES})
    return ratios


def ratio_ranges(ours_runs: list[dict], theirs_runs: list[dict]) -> dict:
    """The lowest and highest ratio over the rounds, each round's processes taken together."""
    per_round = [
        _ratios(_derived(a), _derived(b)) for a, b in zip(ours_runs, theirs_runs, strict=True)
    ]
    return {k: [min(r[k] for r in per_round), max(r[k] for r in per_round)] for k in per_round[0]}


def compare(ours: dict, theirs: dict) -> dict:
    ratios = _ratios(ours, theirs)
    agreement = {
        case: _agreement(ours["cases"][case]["tokens"], theirs["cases"][case]["tokens"])
        for case in ours["cases"]
    }
    return {"ratios": ratios, "token_agreement": agreement}


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = _common.arguments(__doc__, "ctranslate2", "tiny Marian model, one round")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case and process")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per side")
    _common.worker_arguments(parser)
    parser.add_argument("--backend", default="onnxruntime", help=argparse.SUPPRESS)
    parser.add_argument("--open-by-path", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--readme-only",
        action="store_true",
        help="only the layouts README.md quotes (no format 2, int4, references or OpenVINO)",
    )
    _anchor.add_argument(parser)
    args = parser.parse_args(argv)
    _common.compile_bytecode()
    if args.worker:
        work_args = (args.path, json.loads(args.config), args.repeats, args.threads)
        if args.worker == "ours":
            worked = worker_ours(
                *work_args,
                session_cache=args.session_cache,
                backend=args.backend,
                by_path=args.open_by_path,
            )
            print(json.dumps(worked))
        else:
            print(json.dumps(worker_ctranslate2(*work_args)))
        return 0
    if args.quick:  # enough repeats of the tiny model for the reference check's spread
        args.repeats, args.rounds = min(args.repeats, 3), 1

    load_at_start = os.getloadavg()
    machine = _anchor.MachineUse()
    export, config = _common.marian_export(args.quick, args.cache_dir)
    scratch = Path(tempfile.mkdtemp(prefix="bench-ctranslate2-"))
    try:
        # The int8 references only matter at full size; the quick run checks the pipeline.
        references = not (args.quick or args.readme_only)
        ours, made_by = build_ours(export.onnx_dir, scratch, references=references)
        ct2 = convert_ctranslate2(export.pytorch_dir, scratch, config)
        caches = warm_session_caches(ours, made_by, scratch / "session-cache")
        add_by_path(ours, made_by)
        if not args.readme_only:
            add_openvino(ours, made_by)
        runs = {v: [] for v in ours}
        ct2_runs = {p: [] for p in ct2}
        references = {p: [] for p in ct2}
        for _ in range(args.rounds):  # alternate, so load on the machine hits all sides alike
            for precision, path in ct2.items():
                ct2_runs[precision].append(
                    worker_process("ctranslate2", path, config, args.repeats, args.threads, None)
                )
                references[precision].append(
                    reference_run(path, config, max(args.repeats, 3), args.threads)
                )
                for variant, (variant_precision, ours_path) in ours.items():
                    if variant_precision == precision:
                        runs[variant].append(
                            worker_process(
                                "ours",
                                ours_path,
                                config,
                                args.repeats,
                                args.threads,
                                caches.get(variant),
                                "openvino" if variant in OPENVINO else "onnxruntime",
                                variant in BY_PATH,
                            )
                        )
        for variant in caches:
            if any(r["opened"] == str(ours[variant][1]) for r in runs[variant]):
                raise RuntimeError(f"{variant}: a timed load did not read the cache entry")
        # Apart: a variant and a precision can share a name ("float32").
        ours_mb = {
            v: _common.files_bytes(path.parent, [path.name]) / 1e6 for v, (_, path) in ours.items()
        }
        ct2_mb = {p: (path / "model.bin").stat().st_size / 1e6 for p, path in ct2.items()}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    theirs = {p: _summary(r) for p, r in ct2_runs.items()}
    precisions = {}
    for variant, (precision, _) in ours.items():
        mine = _summary(runs[variant])
        result = compare(mine, theirs[precision])
        targets = VARIANT_TARGETS.get(variant, TARGETS[precision])
        precisions[variant] = {
            "precision": precision,
            "made_by": made_by[variant],
            "ours": mine,
            "ctranslate2": theirs[precision],
            **result,
            "ratio_ranges": ratio_ranges(runs[variant], ct2_runs[precision]),
            "files_mb": {"ours": ours_mb[variant], "ctranslate2": ct2_mb[precision]},
            "targets": targets,
            "targets_met": {k: result["ratios"][k] <= v for k, v in targets.items()},
            "runs": {"ours": runs[variant], "ctranslate2": ct2_runs[precision]},
        }
        if variant in OPENVINO:
            onnxruntime_side = _summary(runs[OPENVINO[variant]])
            precisions[variant]["vs_onnxruntime"] = {
                **compare(mine, onnxruntime_side),
                "ratio_ranges": ratio_ranges(runs[variant], runs[OPENVINO[variant]]),
            }
    import ctranslate2
    import onnxruntime

    results = {
        "benchmark": "ctranslate2",
        "model": "tiny Marian" if args.quick else "opus-mt-fr-en shape",
        "setting": {
            "threads": args.threads,
            "new_tokens": NEW_TOKENS,
            "batch1_source_tokens": SOURCE_TOKENS,
            "batch8_source_lengths": BATCH_LENGTHS,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "statistic": "best of each side: a case's fastest timed run over every process "
            "(the machine's noise only adds time); load and import times the fastest process, "
            "memory the median process",
            "reference_check": "each round, beside each CTranslate2 worker, CTranslate2's "
            "one-liner Translator(path, intra_threads=threads).translate_batch(...) at greedy "
            "batch 1 in a fresh process with a clean environment and every processor allowed; "
            f"figures are written only where the two agree within {_anchor.TOLERANCE:.0%} "
            "plus the machine's spread",
            "load_s": "import + load, in a fresh process",
            "import_s": "the import alone (onnxmerge with onnxruntime and numpy; ctranslate2)",
            "load_without_import_s": "load_s - import_s: opening the model",
            "rss": "VmRSS after load, whole process",
            "rss_added_by_load_mb": "VmRSS after load - VmRSS after the import",
            "rss_import_and_load_mb": "VmRSS after load - VmRSS before the import: what "
            "importing the runtime and opening the model add",
            "ratio_ranges": "lowest and highest ratio over the rounds",
        },
        "int8_ours": "; ".join(f"{v}: {p['made_by']}" for v, p in precisions.items()),
        "precisions": precisions,
        "one_file_vs_external_data": one_file_against_external_data(precisions),
        # CTranslate2's float32 path slows down far more than onnxruntime when the machine is
        # oversubscribed: read the ratios together with the load.
        "environment": _common.environment(
            load_at_start,
            onnxruntime=onnxruntime.__version__,
            ctranslate2=ctranslate2.__version__,
            openvino=_version("openvino"),
        ),
    }
    checks = reference_checks(ct2_runs, references)
    for precision, c in checks.items():
        print(
            f"ctranslate2 {precision} greedy_b1: {c['anchor_s']:.4f} s in the workers, "
            f"{c['reference_s']:.4f} s in the plain reference ({c['ratio']:.2f}x; allowed "
            f"{1 + c['threshold']:.2f}x)"
        )
    status = _anchor.finish(args.out, results, checks, machine, args.anchor_check)
    if status:
        return status
    for precision, data in precisions.items():
        summary = {k: round(v, 2) for k, v in data["ratios"].items()}
        agree = {k: round(v, 2) for k, v in data["token_agreement"].items()}
        print(f"{precision}: ratios ours/ctranslate2 {summary}; token agreement {agree}")
        if "vs_onnxruntime" in data:
            versus = {k: round(v, 2) for k, v in data["vs_onnxruntime"]["ratios"].items()}
            same = data["vs_onnxruntime"]["token_agreement"]
            print(f"{precision}: ratios openvino/onnxruntime {versus}; token agreement {same}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
