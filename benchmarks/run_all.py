"""Reproduce every figure in the docs: run each benchmark, then write docs/benchmarks.md and charts.

    python benchmarks/run_all.py            # the full runs (the two corpus runs alone: 65 min)
    python benchmarks/run_all.py --quick    # tiny models, to check the pipeline (the test suite)
    python benchmarks/run_all.py --render   # only re-render docs from benchmarks/out/*.json
    python benchmarks/run_all.py --check docs/performance.md   # published ratios beside ours

Benchmarks that time CTranslate2 check it against its plain one-liner in the same run and check
that nothing else used the machine (``benchmarks/_anchor.py``); a run that fails either writes
no figures (its old JSON stays) and run_all exits 3 after the rest.

Each benchmark runs in its own process and writes JSON under the output folder; rendering reads
only those files, so the docs always show numbers that one command produced.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _anchor, _common  # noqa: E402

OUT = REPO_ROOT / "benchmarks" / "out"
DOCS = REPO_ROOT / "docs"


def _benchmarks(out: Path, quick: bool) -> dict[str, list[str]]:
    q = ["--quick"] if quick else []
    return {
        "merge": ["bench_merge.py", *q, "--out", str(out / "merge.json")],
        "sizes": [
            "bench_sizes.py",
            "--out",
            str(out / "sizes.json"),
            *(["--archs", "marian", "t5"] if quick else []),
        ],
        "generate": ["bench_generate.py", str(out / "generate.json"), *q],
        "generator": ["bench_generator.py", *q, "--out", str(out / "generator.json")],
        "web": ["bench_web.py", *q, "--out", str(out / "web.json")],
        "whisper": ["bench_whisper.py", *q, "--out", str(out / "whisper.json")],
        "pipeline": ["bench_pipeline.py", *q, "--out", str(out / "pipeline.json")],
        "quantize": ["bench_quantize.py", *q, "--out", str(out / "quantize.json")],
        "batch": ["bench_batch.py", *q, "--out", str(out / "batch.json")],
        "ctranslate2": ["bench_ctranslate2.py", *q, "--out", str(out / "ctranslate2.json")],
        "threads": ["bench_threads.py", *q, "--out", str(out / "threads.json")],
        "corpus": ["bench_corpus.py", *q, "--out", str(out / "corpus.json")],
        "corpus_ends": ["bench_corpus_ends.py", *q, "--out", str(out / "corpus_ends.json")],
        "serve": ["bench_serve.py", *q, "--out", str(out / "serve.json")],
        # Diagnoses, not comparisons: only when asked by --only.
        "profile": ["profile_generate.py", *q, "--out", str(out / "profile.json")],
        "greedy_gather": ["bench_greedy_gather.py", *q, "--out", str(out / "greedy_gather.json")],
        # Loads the machine on purpose (why figures need it quiet): only when asked by --only.
        "contention": ["bench_contention.py", *q, "--out", str(out / "contention.json")],
        # Exports a 2.4 GB model (about 10 minutes, 9 GB of cache): only when asked by --only.
        "large": ["bench_large.py", "--out", str(out / "large.json")],
    }


# Benchmarks that run only when named by --only.
ASKED_FOR = ("large", "profile", "greedy_gather", "contention")
# Left out of a --quick run of everything: their own tests run their quick variants
# (tests/test_bench_serve.py, tests/test_bench_pipeline.py).
QUICK_ELSEWHERE = ("serve", "pipeline")
# Benchmarks that time CTranslate2 and check it against its reference (``_anchor``).
ANCHORED = ("ctranslate2", "corpus", "corpus_ends", "serve")
# Exit status of a benchmark that refused to write figures (``_anchor.refuse``).
REFUSED = 3


def _check_benchmarks(out: Path, quick: bool) -> dict[str, list[str]]:
    """The shorter runs behind ``--check``: CTranslate2's README layouts only (two rounds of
    three repeats), and each corpus of 200 inputs."""
    q = ["--quick"] if quick else []
    return {
        "ctranslate2": [
            "bench_ctranslate2.py",
            *q,
            "--rounds",
            "2",
            "--repeats",
            "3",
            "--readme-only",
            "--out",
            str(out / "ctranslate2.json"),
        ],
        "corpus": ["bench_corpus.py", *q, "--inputs", "200", "--out", str(out / "corpus.json")],
        "corpus_ends": [
            "bench_corpus_ends.py",
            *q,
            "--inputs",
            "200",
            "--out",
            str(out / "corpus_ends.json"),
        ],
    }


def run(
    out: Path,
    quick: bool,
    only: list[str] | None,
    jobs: int = 1,
    benchmarks: dict[str, list[str]] | None = None,
) -> list[str]:
    """Run the chosen benchmarks (``_benchmarks`` unless given); the names of those that
    refused to write figures."""
    out.mkdir(parents=True, exist_ok=True)

    def one(name: str, argv: list[str]) -> bool:
        started = time.perf_counter()
        print(f"== {name}: {' '.join(argv)}", flush=True)
        done = subprocess.run(
            [sys.executable, str(REPO_ROOT / "benchmarks" / argv[0]), *argv[1:]], cwd=REPO_ROOT
        )
        if done.returncode not in (0, REFUSED):
            raise subprocess.CalledProcessError(done.returncode, argv)
        print(f"== {name}: {time.perf_counter() - started:.0f} s", flush=True)
        return done.returncode == REFUSED

    chosen = {
        name: argv
        for name, argv in (benchmarks or _benchmarks(out, quick)).items()
        if not (
            (only and name not in only)
            or (not only and name in ASKED_FOR)
            or (not only and quick and name in QUICK_ELSEWHERE)
        )
    }
    if jobs > 1:  # sharing the machine on purpose: record the anchor checks, refuse nothing
        for name in ANCHORED:
            if name in chosen:
                chosen[name] = [*chosen[name], "--anchor-check", "record"]
    # More than one at a time only to check the pipeline: measured runs need the machine alone.
    with ThreadPoolExecutor(jobs) as pool:
        refused = list(pool.map(one, chosen, chosen.values()))
    return [name for name, no in zip(chosen, refused, strict=True) if no]


WITHIN = 0.15  # how far a measured ratio may be from the README's, relatively


def check_table(readme: Path, measured: Path) -> tuple[list[str], bool]:
    """Each README figure against the same field in ``measured`` (a folder of results): the
    lines of a markdown table, and whether every figure was measured within ``WITHIN``."""
    from benchmarks import readme_figures

    figures = readme_figures.readme_figures(readme.read_text(encoding="utf-8"))
    results = {
        b: readme_figures.load_results(measured, b) for b in {f.table.benchmark for f in figures}
    }
    lines = [
        f"| figure | {readme.name} | measured | within {WITHIN:.0%} |",
        "|---|---:|---:|---|",
    ]
    agree = bool(figures)
    for figure in figures:
        found = results[figure.table.benchmark]
        value = readme_figures.measured_figure(figure, found)
        if value is None or figure.readme is None:
            verdict, shown = "not measured", "-"
        else:
            close = abs(value / figure.readme - 1) <= WITHIN
            verdict, shown = ("yes" if close else "**no**"), f"{value:.2f}×"
            if found and "refused" in found:  # shown, but a figure from it proves nothing
                verdict += " (refused run)"
        agree = agree and verdict == "yes"
        readme_value = "-" if figure.readme is None else f"{figure.readme:.2f}×"
        lines.append(f"| {figure.name} | {readme_value} | {shown} | {verdict} |")
    return lines, agree


def _load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _chart_sizes(merge: dict, img: Path) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = merge["variants"]
    layouts = list(next(iter(variants.values()))["layouts"])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(variants)
    for i, (variant, data) in enumerate(variants.items()):
        values = [data["layouts"][name]["bytes"] / 1e6 for name in layouts]
        bars = ax.barh(
            [y + i * width for y in range(len(layouts))],
            values,
            height=width,
            label=f"optimum export, LM head {'tied' if variant == 'tied' else 'copied'}",
        )
        ax.bar_label(bars, fmt="%.0f", padding=3, fontsize=8)
    checkpoint = next(iter(variants.values()))["checkpoint_bytes"] / 1e6
    ax.axvline(
        checkpoint, color="black", linestyle="--", linewidth=1, label="PyTorch model.safetensors"
    )
    ax.set_yticks([y + width / 2 for y in range(len(layouts))], layouts)
    ax.invert_yaxis()
    ax.set_xlabel("MB on disk (opus-mt-fr-en shape)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = img / "sizes.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def _chart_runtime(generate: dict, img: Path) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [
        ("rss_after_load_mb", "memory after load (MB)"),
        ("greedy_time", "greedy, 32 tokens (s)"),
        ("beam4_time", "4 beams, 32 tokens (s)"),
    ]
    fig, axes = plt.subplots(1, len(keys), figsize=(9, 2.8))
    for ax, (key, title) in zip(axes, keys, strict=True):
        values = [generate["optimum"][key], generate["ours"][key]]
        bars = ax.bar(["optimum", "onnxmerge"], values, color=["#999999", "#1f77b4"])
        ax.bar_label(bars, fmt="%.2f" if values[0] < 10 else "%.0f", fontsize=8)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = img / "runtime.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def _load_averages(environment: dict) -> str:
    start, end = environment.get("load_average_at_start"), environment["load_average_at_end"]
    one_minute = [f"{x[0]:.1f}" for x in (start, end) if x]
    return " at the start, ".join(one_minute) + " at the end (1-minute)"


def _ctranslate2_section(data: dict) -> list[str]:
    s = data["setting"]
    lines = [
        "## Generation against CTranslate2",
        "",
        f"{data['model']}, {s['threads']} threads, exactly {s['new_tokens']} new tokens; "
        f"batch 1 has {s['batch1_source_tokens']} source ids, batch 8 has lengths "
        f"{', '.join(map(str, s['batch8_source_lengths']))}. CTranslate2 converts the same "
        "PyTorch folder (`TransformersConverter`, float32 and int8). Our files: "
        f"{data['int8_ours']}. Times are seconds ({s['statistic']}); ratios are "
        "onnxmerge / CTranslate2, below 1 is better; agreement is the share of positions "
        "with the same token (the last, a forced eos on our side, left out). Both sides run "
        "in the same run, but CTranslate2's float32 path slows down far more than "
        "onnxruntime on an oversubscribed machine: from a loaded machine, the float32 "
        "ratios are lower than on a quiet one and are not a result. Load average of this "
        f"run: {_load_averages(data['environment'])}; processor: "
        f"{_common.processor_words(data['environment'])}.{_anchor.sentence(data)} "
        "`load_s` is import and load together, "
        "`import_s` the import alone (onnxruntime and numpy on our side), "
        "`load_without_import_s` the rest; `rss_after_load_mb` is the whole process, "
        "`rss_import_and_load_mb` what the import and the load add together, "
        "`rss_added_by_load_mb` what opening the model adds to the import. The range is the "
        f"lowest and highest ratio of the {s['rounds']} rounds.",
        "",
        "| precision | measure | CTranslate2 | onnxmerge | ratio | range | target "
        "| token agreement |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for precision, p in data["precisions"].items():
        for case, ratio in p["ratios"].items():
            if case in p["ours"]["cases"]:
                ours, theirs = p["ours"]["cases"][case]["s"], p["ctranslate2"]["cases"][case]["s"]
                agree = f"{p['token_agreement'][case]:.2f}"
            else:
                ours, theirs, agree = p["ours"][case], p["ctranslate2"][case], ""
            target = p["targets"].get(case)
            spread = p.get("ratio_ranges", {}).get(case)  # results written before ranges: none
            spread = f"{spread[0]:.2f}–{spread[1]:.2f}" if spread else ""
            lines.append(
                f"| {precision} | {case} | {theirs:.3f} | {ours:.3f} | **{ratio:.2f}x** "
                f"| {spread} | {'' if target is None else f'<= {target}x'} | {agree} |"
            )
    versus = {
        v: p["vs_onnxruntime"] for v, p in data["precisions"].items() if "vs_onnxruntime" in p
    }
    if versus:
        lines += [
            "",
            "The `openvino` rows run the plain files' steps in OpenVINO "
            f"{data['environment'].get('openvino')} (CPU, float32 arithmetic) under the same "
            "search; against onnxruntime on the same file (ratios OpenVINO / onnxruntime, "
            "below 1 is better):",
            "",
            "| variant | measure | ratio | range | token agreement |",
            "|---|---|---:|---:|---:|",
        ]
        for variant, d in versus.items():
            for case, ratio in d["ratios"].items():
                low, high = d["ratio_ranges"][case]
                agree = d["token_agreement"].get(case)
                lines.append(
                    f"| {variant} | {case} | **{ratio:.2f}x** | {low:.2f}–{high:.2f} | "
                    f"{'' if agree is None else f'{agree:.2f}'} |"
                )
    return [*lines, "", *_one_file_lines(data.get("one_file_vs_external_data", {}))]


def _one_file_lines(layouts: dict) -> list[str]:
    """The one file against the external-data layout, same run (``docs/format.md``)."""
    if not layouts:
        return []
    lines = [
        "The one file against its weights in a data file beside it, same run (ratios one file / "
        "external data; the target: the one file costs nothing more):",
        "",
        "| precision | measure | ratio | target | met |",
        "|---|---|---:|---:|---|",
    ]
    for precision, d in layouts.items():
        for measure, ratio in d["ratios"].items():
            met = "yes" if d["targets_met"][measure] else "no"
            lines.append(
                f"| {precision} | {measure} | **{ratio:.2f}x** | <= {d['targets'][measure]}x "
                f"| {met} |"
            )
    return [*lines, ""]


def _threads_section(data: dict) -> list[str]:
    memory = data["memory"]
    lines = [
        "## One model shared by threads",
        "",
        f"{data['model']}, greedy, {data['new_tokens']} new tokens, onnxruntime with "
        f"{data['onnxruntime_threads']} threads; every call's tokens checked against a "
        "serial call (`benchmarks/bench_threads.py`).",
        "",
        "| caller threads | calls | tokens/s | same tokens as serial |",
        "|---:|---:|---:|---|",
    ]
    for row in data["throughput"]:
        lines.append(
            f"| {row['caller_threads']} | {row['calls']} | {row['tokens_per_s']:.1f} | "
            f"{row['same_tokens_as_serial']} |"
        )
    first, last = memory["samples"][0], memory["samples"][-1]
    lines += [
        "",
        f"Resident memory over {memory['calls']} calls (greedy and 2 beams in turn): "
        f"{first['rss_mb']:.1f} MB after {first['calls']} calls, {last['rss_mb']:.1f} MB "
        f"after {last['calls']} ({memory['growth_after_first_tenth_mb']:+.1f} MB).",
        "",
    ]
    return lines


def _profile_section(data: dict) -> list[str]:
    lines = [
        "## Where the time of a token goes",
        "",
        f"{data['model']}, batch 1, {data['new_tokens']} new tokens, {data['threads']} "
        "threads (`benchmarks/profile_generate.py`; run with `--only profile`). Per-step "
        "times wrap `InferenceSession.run`; the operator split is onnxruntime's profiler "
        "over one `generate()`. Absolute times follow the machine's load; read the "
        "shares and the ratios.",
        "",
        "| precision | search | per token ms | first step ms | cached step ms | Python outside "
        "run | operators | outside operators (in run) | top operators (share of operator time) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    runs = [("float32", s, d) for s, d in data["searches"].items()]
    runs += [("int8", s, d) for s, d in data.get("searches_int8", {}).items()]
    for precision, search, d in runs:
        st, prof = d["steps"], d["onnxruntime_profile"]
        ops = prof["operators_ms"]
        top = list(prof["top_operators_ms"].items())[:6]
        top = ", ".join(f"{k} {v / ops:.0%}" for k, v in top)
        lines.append(
            f"| {precision} | {search} | {st['per_token_ms']:.1f} | "
            f"{st['first_step_s'] * 1e3:.1f} | "
            f"{st['cached_step_s'] * 1e3:.1f} | "
            f"{st['outside_run_s'] / st['wall_s']:.0%} | "
            f"{ops / prof['model_run_ms']:.0%} | "
            f"{prof['outside_operators_ms'] / prof['model_run_ms']:.0%} | {top} |"
        )
    unfolded = data.get("without_reshape_folding")
    if unfolded:
        folded = data["merge_rewrites"]["reshape_targets_folded"]
        lines += [
            "",
            f"The merge folds {folded} `Reshape` targets of the export's shape "
            "arithmetic into constants (`onnxmerge/reshape_targets.py`). The same export "
            "merged without that pass, in the same run:",
            "",
            "| search | operators per cached step | without folding | cached step ms | "
            "without folding | time with / without |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for search, d in data["searches"].items():
            u = unfolded[search]
            ops, ops_u = (x["onnxruntime_profile"]["operators_per_cached_step"] for x in (d, u))
            step, step_u = (x["steps"]["cached_step_s"] for x in (d, u))
            lines.append(
                f"| {search} | {ops:.0f} | {ops_u:.0f} | {step * 1e3:.1f} | "
                f"{step_u * 1e3:.1f} | {step / step_u:.2f}x |"
            )
    return [*lines, ""]


def _large_section(large: dict) -> list[str]:
    ours, theirs = large["onnxmerge"], large.get("optimum_merge_decoders", {})
    limited = large.get("limited_merge") or {}
    result = ours["result"]
    failed = theirs.get("result", {}).get("error")

    def gib(run: dict, key: str) -> str:
        value = run.get(key)
        return "-" if value is None else f"{value / 2**30:.2f}"

    def row(step: str, outcome: str, run: dict, wall: str) -> str:
        return (
            f"| {step} | {outcome} | {wall} | {gib(run, 'peak_private_bytes')} | "
            f"{gib(run, 'peak_anonymous_bytes')} |"
        )

    lines = [
        "## Past 2 GB (facebook/mbart-large-50 shape)",
        "",
        f"{large['export_input_bytes'] / 2**30:.2f} GiB of export files (optimum's own "
        "post-processing fails on this model and leaves the three files). Written by "
        "`benchmarks/bench_large.py` (run separately: its export takes about 10 "
        "minutes). Private memory counts the file pages a process alone maps (the weights "
        "the merge's output check reads as it runs the written file, the data file as it is "
        "written), which the kernel can drop or write back; anonymous memory is what no file "
        "backs.",
        "",
        "| step | outcome | wall s | peak private GiB | peak anonymous GiB |",
        "|---|---|---:|---:|---:|",
        row(
            "onnxmerge merge",
            f"{result['output_bytes'] / 2**30:.2f} GiB as model.onnx + model.onnx_data; "
            f"{result['shared']} tensors shared ({result['transposed']} transposed)",
            ours,
            f"{ours['wall_s']:.0f}",
        ),
    ]
    if limited.get("measured"):
        lines.append(
            row(
                f"onnxmerge merge in a {limited['limit_bytes'] / 2**30:.1f} GiB memory cgroup "
                "(page cache included), the export dropped from the page cache first",
                "crashed"
                if limited["crashed"]
                else "completes; the cgroup's peak charge "
                f"{limited['peak_charged_bytes'] / 2**30:.2f} GiB",
                limited,
                "-" if limited["crashed"] else f"{limited['wall_s']:.0f}",
            )
        )
    lines += [
        row(
            "check_model(full_check=True)",
            "passes" if large["checker"]["result"]["ok"] else "fails",
            large["checker"],
            f"{large['checker']['wall_s']:.1f}",
        ),
        row(
            "both branches against the export (onnxruntime)",
            f"max abs diff {large['verify']['result']['max_abs_diff']:.1e}",
            large["verify"],
            f"{large['verify']['wall_s']:.0f}",
        ),
    ]
    if theirs:
        outcome = "fails: " + failed if failed else "succeeds"
        lines.append(row("optimum merge_decoders", outcome, theirs, f"{theirs['wall_s']:.0f}"))
    lines.append("")
    return lines


def _markdown_of(script: str) -> Callable[[dict], list[str]]:
    """The ``markdown`` function of a benchmark script, imported when its results are there."""
    return lambda data: importlib.import_module(f"benchmarks.{script}").markdown(data)


def render(out: Path, docs: Path) -> Path:
    img = docs / "img"
    img.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Benchmarks",
        "",
        "Reproduce every number and chart here with `python benchmarks/run_all.py` (written by it;",
        "do not edit by hand). Models have the shapes of real checkpoints and seeded random "
        "weights;",
        "each side runs in a fresh process, on the same inputs, in the same run. Ratios are",
        "onnxmerge / optimum: below 1 is better. Every package runs from compiled bytecode, as",
        "an install leaves it: the benchmarks that measure load or memory compile onnxmerge's",
        "first (a source checkout under `PYTHONDONTWRITEBYTECODE` compiles it again in every",
        "process, 1.6 MB of the runtime's import that an installed package never pays).",
        "",
        "Where a benchmark times CTranslate2, each of its CTranslate2 processes is checked in the "
        "same run against CTranslate2's documented one-liner "
        "(`Translator(path, intra_threads=N).translate_batch(...)`) in a fresh process with a "
        "clean environment and every processor allowed; a run whose CTranslate2 side differs "
        "from it by more than 15% plus the run's own spread, or during which other processes "
        "used more than 0.15 cores on average, writes no figures "
        "(`benchmarks/_anchor.py`). `python benchmarks/run_all.py --check docs/performance.md` "
        "reruns shorter versions of those benchmarks and prints each published ratio beside "
        "what this machine measures.",
        "",
    ]
    merge = _load(out, "merge")
    if merge:
        lines += ["## Bytes on disk (opus-mt-fr-en shape)", ""]
        if chart := _chart_sizes(merge, img):
            lines += [f"![bytes on disk per layout](img/{chart})", ""]
        variants = merge["variants"]
        lines += [
            "| layout | " + " | ".join(f"export with LM head {v}" for v in variants) + " |",
            "|---|" + "---:|" * len(variants),
        ]
        for name in next(iter(variants.values()))["layouts"]:
            cells = [
                f"{_mb(d['layouts'][name]['bytes'])} "
                f"({d['layouts'][name]['ratio_to_safetensors']:.3f}x)"
                for d in variants.values()
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        checkpoint = next(iter(variants.values()))["checkpoint_bytes"]
        lines += [
            "| model.safetensors | " + " | ".join(_mb(checkpoint) for _ in variants) + " |",
            "",
            "## Merge time and memory",
            "",
            "onnxmerge merges encoder + decoder + decoder with past; optimum's "
            "`merge_decoders` merges only the two decoders (one file less).",
            "",
            "| export | tool | merge s | peak RSS MB | peak private MB |",
            "|---|---|---:|---:|---:|",
        ]
        for variant, data in variants.items():
            tm = data["merge_time_memory"]
            for tool, stats in tm.items():
                if "median" not in stats:
                    continue
                m = stats["median"]
                lines.append(
                    f"| {variant} | {tool} | {m['call_s']:.1f} | "
                    f"{m['peak_rss_bytes'] / 2**20:.0f} | "
                    f"{m['peak_private_bytes'] / 2**20:.0f} |"
                )
            ratios = tm.get("ratios_ours_over_optimum", {})
            if ratios:
                lines.append(
                    f"| {variant} | **ratio** | "
                    f"**{ratios.get('call_s', float('nan')):.2f}x** | "
                    f"**{ratios.get('peak_rss_bytes', float('nan')):.2f}x** | "
                    f"**{ratios.get('peak_private_bytes', float('nan')):.2f}x** |"
                )
        lines.append("")
    sizes = _load(out, "sizes")
    if sizes:
        lines += [
            "## Weights stored, per architecture",
            "",
            "Tensor bytes of each layout over the tensor bytes of the PyTorch checkpoint "
            "(tiny test models; 1.00x = every weight once).",
            "",
        ]
        from benchmarks.bench_sizes import markdown

        lines += [markdown(sizes["rows"]), ""]
    generate = _load(out, "generate")
    if generate:
        s = generate["setting"]
        lines += [
            "## Generation against optimum's ORTModelForSeq2SeqLM",
            "",
            f"opus-mt-fr-en shape, batch {s['batch']}, {s['source_tokens']} source tokens, "
            f"{s['new_tokens']} new tokens; optimum runs encoder_model.onnx + "
            "decoder_model_merged.onnx.",
            "",
        ]
        if chart := _chart_runtime(generate, img):
            lines += [f"![generation time and memory](img/{chart})", ""]
        lines += ["| measure | optimum | onnxmerge | ratio |", "|---|---:|---:|---:|"]
        for key, ratio in generate["ratios"].items():
            lines.append(
                f"| {key} | {generate['optimum'][key]:.3f} | {generate['ours'][key]:.3f} "
                f"| **{ratio:.2f}x** |"
            )
        lines += ["", f"Same tokens: {generate.get('same_tokens')}.", ""]
    generator = _load(out, "generator")
    if generator:
        lines += [
            "## The decoding loop inside the graph",
            "",
            f"{generator['model']}, greedy, {generator['runs'][0]['max_new_tokens']} new "
            "tokens, one `session.run` of the generator against `Seq2SeqModel.generate` "
            "on the merged file, taking turns in one process (`benchmarks/"
            "bench_generator.py`); CPU is the process's CPU time over all its threads.",
            "",
            "| batch | Python runtime tok/s | in-graph loop tok/s | in-graph / Python "
            "time | in-graph / Python CPU | same tokens | file size vs merged |",
            "|---:|---:|---:|---:|---:|---|---:|",
        ]
        for r in generator["runs"]:
            cpu = f"{r['cpu_ratio']:.2f}x" if "cpu_ratio" in r else ""
            lines.append(
                f"| {r['batch']} | {r['python_runtime_tokens_per_s']:.1f} | "
                f"{r['in_graph_loop_tokens_per_s']:.1f} | {1 / r['speedup']:.2f}x | "
                f"{cpu} | {r['identical_tokens']} | +{r['generator_extra_bytes']} B |"
            )
        lines.append("")
    sections = {
        "web": _markdown_of("bench_web"),
        "whisper": _markdown_of("bench_whisper"),
        "pipeline": _markdown_of("bench_pipeline"),
        "batch": lambda data: [
            "## Converting a zoo (`onnxmerge batch`)",
            "",
            *_markdown_of("bench_batch")(data),
            "",
        ],
        "ctranslate2": _ctranslate2_section,
        "threads": _threads_section,
        "corpus": _markdown_of("bench_corpus"),
        "corpus_ends": _markdown_of("bench_corpus_ends"),
        "profile": _profile_section,
        "greedy_gather": _markdown_of("bench_greedy_gather"),
        "quantize": _markdown_of("bench_quantize"),
        "serve": _markdown_of("bench_serve"),
        "contention": _markdown_of("bench_contention"),
        "large": _large_section,
    }
    for name, section in sections.items():
        data = _load(out, name)
        if data:
            lines += section(data)
    target = docs / "benchmarks.md"
    target.write_text("\n".join(lines))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models; checks the pipeline")
    parser.add_argument("--render", action="store_true", help="only render the docs from JSON")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(_benchmarks(OUT, quick=False)),
    )
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the JSON results")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="benchmarks run at a time (with --quick; figures need 1)",
    )
    parser.add_argument("--docs", type=Path, default=DOCS, help="folder for benchmarks.md")
    parser.add_argument(
        "--check",
        type=Path,
        metavar="README",
        help="rerun the benchmarks behind README's ratios against CTranslate2 (shorter runs; "
        "tiny models with --quick) into a scratch folder, and print each figure beside what "
        "this machine measures; exits 1 where one differs by more than 15%%",
    )
    parser.add_argument(
        "--measured",
        type=Path,
        help="with --check: compare with the results in this folder instead of running",
    )
    args = parser.parse_args(argv)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    if args.check:
        return _check(args)
    refused = []
    if not args.render:
        refused = run(args.out, args.quick, args.only, args.jobs if args.quick else 1)
    print(f"wrote {render(args.out, args.docs)}")
    if refused:
        print(f"refused to write figures (their JSON is as it was): {', '.join(refused)}")
        return REFUSED
    return 0


def _check(args: argparse.Namespace) -> int:
    """``--check``: the README's figures beside this machine's (run now unless ``--measured``)."""
    import tempfile

    measured = args.measured
    if measured is None:
        measured = Path(tempfile.mkdtemp(prefix="readme-check-"))
        only = [n for n in (args.only or ANCHORED) if n in ANCHORED]
        refused = run(measured, args.quick, only, 1, _check_benchmarks(measured, args.quick))
        for name in refused:
            print(f"{name} refused to measure (see {measured}/{name}.refused.json)")
    lines, agree = check_table(args.check, measured)
    print("\n".join(lines))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
