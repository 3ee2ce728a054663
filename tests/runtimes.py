"""Run merged models and generators in several ONNX runtimes, feeding only the public contract.

A :class:`Runner` wraps one runtime's session behind ``run(feeds) -> {output name: array}``.
:func:`greedy_steps` drives a merged ``model.onnx`` step by step (first step, then cached steps)
with exactly the inputs of docs/format.md, so that what it checks holds for any runtime and any
format version; :func:`run_generator` makes the one call a generator file needs.

The runtimes are optional packages: :func:`open_runner` raises :class:`RuntimeUnavailable` (with
the ``pip install`` to run) when one is missing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnxmerge import contract as c

RUNTIMES = ("onnxruntime", "openvino", "tract", "reference")
# The package each runtime comes from, as pip names it.
PACKAGES = {
    "onnxruntime": "onnxruntime",
    "openvino": "openvino",
    "tract": "tract",
    "reference": "onnx",
}
# The names the documentation gives them; onnxruntime-node is run by tests/js, not from Python.
TITLES = {
    "onnxruntime": "onnxruntime",
    "openvino": "OpenVINO (CPU)",
    "tract": "tract",
    "reference": "onnx ReferenceEvaluator",
    "node": "onnxruntime-node",
}

# What each runtime does with each kind of file, as tests/test_runtimes.py finds it and
# docs/runtimes.md shows it. A cell is RUNS (same tokens as onnxruntime, logits within the
# precision's tolerance), NOT_TESTED, or why the file does not run there.
FILE_KINDS = (
    "model.onnx fp32",
    "model.onnx int8",
    "model.onnx int8 row",
    "model.onnx int4",
    "greedy generator fp32",
    "greedy generator int8",
    "beam generator fp32",
    "beam generator int8",
)
RUNS = "runs"
NOT_TESTED = "not tested"
TWO_DECODER_IF = (
    "does not load: its `If` gives both branches' outputs one shape, and the two decoders' "
    "caches differ in length"
)
NO_LOOP = "does not load: its ONNX front end has no `Loop`"
# tract runs format 3 once each run's input sizes are bound (TractRunner), except these.
TRACT_NO_INT4 = 'does not load: it has no 4-bit type ("Unknown DatumType Int4")'
TRACT_EXCEPT = {
    "longt5": (
        "runs, except LongT5's files on a padded batch (a single input runs): tract's shape "
        "arithmetic cannot prove the two sides of its local attention's `Reshape` equal "
        '("Reshape volume mismatch")'
    ),
    "whisper": (
        "runs, except Whisper's files: its first step's encoder pasts must be of the encoder's "
        "output length, which the shape of no input gives (tract unifies both branches of the "
        "`If`)"
    ),
}
SUPPORT: dict[str, dict[str, str]] = {
    "onnxruntime": dict.fromkeys(FILE_KINDS, RUNS),
    "openvino": {
        **dict.fromkeys(FILE_KINDS, RUNS),
        "model.onnx int4": (
            "does not compile: its compressed-weight pass (ConvertFullyConnectedToFullyConnected"
            "Compressed) mis-sizes the MatMul of blocked int4 weights"
        ),
    },
    "tract": {
        "model.onnx fp32": RUNS,
        "model.onnx int8": RUNS,
        "model.onnx int8 row": RUNS,
        "model.onnx int4": TRACT_NO_INT4,
        **{kind: NO_LOOP for kind in FILE_KINDS if "generator" in kind},
    },
    "reference": dict.fromkeys(FILE_KINDS, RUNS),
    "node": dict.fromkeys(FILE_KINDS, RUNS),
}
_REFERENCE_WHISPER_INT8 = (
    "runs, except Whisper's int8 files: onnx's reference has no `DequantizeLinear` for "
    "opset 18, the opset of that export"
)
# Architectures of the test zoo a cell that says RUNS does not hold for, and why.
EXCEPT: dict[tuple[str, str], dict[str, str]] = {
    ("reference", "model.onnx int8"): {"whisper": _REFERENCE_WHISPER_INT8},
    ("reference", "model.onnx int8 row"): {"whisper": _REFERENCE_WHISPER_INT8},
    **{("tract", f"model.onnx {p}"): TRACT_EXCEPT for p in ("fp32", "int8", "int8 row")},
}
# Failures of the two-decoder form (format versions 1 and 2) that format 3 should not have.
TWO_DECODER_FORMATS = ("1", "2")
TWO_DECODER_FAILURES = frozenset({TWO_DECODER_IF})


class RuntimeUnavailable(ImportError):
    """The runtime's Python package is not installed (or has no wheel for this platform)."""


class Runner:
    """One runtime's session over one file."""

    name = ""
    # Whether the inputs a step does not read may be zero-length (docs/format.md allows it).
    zero_length_stand_ins = True

    def __init__(self, path: Path):
        self.path = path

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError


class OnnxruntimeRunner(Runner):
    name = "onnxruntime"

    def __init__(self, path: Path):
        super().__init__(path)
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.log_severity_level = 3
        # The 4-bit kernels it fuses int4 weights into compute in float32, as the others do
        # (by default they quantize the activations to int8).
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
        self.session = ort.InferenceSession(
            os.fspath(path), options, providers=["CPUExecutionProvider"]
        )
        self.outputs = [o.name for o in self.session.get_outputs()]

    def run(self, feeds):
        return dict(zip(self.outputs, self.session.run(None, dict(feeds)), strict=True))


class OpenVinoRunner(Runner):
    name = "openvino"

    def __init__(self, path: Path):
        super().__init__(path)
        import openvino as ov

        # OpenVINO computes in bfloat16 where the processor has it, unless told otherwise.
        config = {"INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": "f32"}
        self.compiled = ov.Core().compile_model(os.fspath(path), "CPU", config)
        self.request = self.compiled.create_infer_request()
        # A port may carry several tensor names; the graph output's is the one to report.
        graph_outputs = _output_names(path)
        self.outputs = [
            next(n for n in graph_outputs if n in o.get_names()) for o in self.compiled.outputs
        ]

    def run(self, feeds):
        results = self.request.infer(dict(feeds), share_inputs=False, share_outputs=False)
        # Results are keyed by output port; the order is the model's.
        return dict(zip(self.outputs, results.values(), strict=True))


class TractRunner(Runner):
    name = "tract"
    # tract binds each symbolic dimension to one size per run: a zero-length input_ids beside an
    # attention_mask of the same declared dims clashes ("L=0 != 5"), so stand-ins get the sizes
    # of the inputs that are read.
    zero_length_stand_ins = False
    _TYPES = {"int64": "i64", "float32": "f32", "float16": "f16", "bool": "bool"}

    def __init__(self, path: Path):
        super().__init__(path)
        import tract

        model = tract.onnx().load(os.fspath(path))
        self.inputs = [model.input_name(i) for i in range(model.input_count())]
        # tract names an output after the node that makes it; the graph's names come in order.
        self.outputs = _output_names(path)
        self._by_shapes: dict[tuple, Any] = {}

    def _runnable(self, arrays: list[np.ndarray]) -> Any:
        """The model typed and optimized for these inputs' shapes: inside an ``If``, tract finds
        the outer graph's symbols unbound ("Undetermined symbol"), so each run's sizes are bound
        before it types the model."""
        import tract

        key = tuple((a.shape, a.dtype.name) for a in arrays)
        if key not in self._by_shapes:
            model = tract.onnx().load(os.fspath(self.path))
            for i, array in enumerate(arrays):
                fact = [*map(str, array.shape), self._TYPES[array.dtype.name]]
                model.set_input_fact(i, ",".join(fact))
            self._by_shapes[key] = model.into_model().into_runnable()
        return self._by_shapes[key]

    def run(self, feeds):
        arrays = [np.ascontiguousarray(feeds[n]) for n in self.inputs]
        results = self._runnable(arrays).run(arrays)
        return {n: v.to_numpy() for n, v in zip(self.outputs, results, strict=True)}


class ReferenceRunner(Runner):
    name = "reference"

    def __init__(self, path: Path):
        super().__init__(path)
        from onnx.reference import ReferenceEvaluator

        self.evaluator = ReferenceEvaluator(os.fspath(path))
        self.outputs = list(self.evaluator.output_names)

    def run(self, feeds):
        return dict(zip(self.outputs, self.evaluator.run(None, dict(feeds)), strict=True))


def _output_names(path: Path) -> list[str]:
    return [o.name for o in onnx.load(os.fspath(path), load_external_data=False).graph.output]


_RUNNERS: dict[str, Callable[[Path], Runner]] = {
    "onnxruntime": OnnxruntimeRunner,
    "openvino": OpenVinoRunner,
    "tract": TractRunner,
    "reference": ReferenceRunner,
}


def version(runtime: str) -> str:
    """The installed version of ``runtime``'s package; raises :class:`RuntimeUnavailable`."""
    from importlib import metadata

    try:
        return metadata.version(PACKAGES[runtime])
    except metadata.PackageNotFoundError as error:
        raise RuntimeUnavailable(
            f"{runtime} is not installed: pip install {PACKAGES[runtime]}"
        ) from error


def open_runner(runtime: str, path: str | os.PathLike) -> Runner:
    """A :class:`Runner` of ``runtime`` (one of :data:`RUNTIMES`) over the file at ``path``."""
    if runtime not in _RUNNERS:
        raise ValueError(f"unknown runtime {runtime!r}; known: {', '.join(RUNTIMES)}")
    version(runtime)
    return _RUNNERS[runtime](Path(path))


# ---------------------------------------------------------------------------------------------
# merged model, step by step


@dataclass(frozen=True)
class MergedFile:
    """What the contract says about a merged file: enough to feed it."""

    path: Path
    info: c.ContractInfo
    inputs: dict[str, tuple[int, tuple]]  # name -> (ONNX elem type, dims: int, name or None)

    @property
    def format_version(self) -> str:
        return self.info.format_version


def read_merged(path: str | os.PathLike) -> MergedFile:
    model = onnx.load(os.fspath(path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    inputs = {
        i.name: (
            i.type.tensor_type.elem_type,
            tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in i.type.tensor_type.shape.dim
            ),
        )
        for i in model.graph.input
    }
    info = c.read_contract(meta, list(inputs), [o.name for o in model.graph.output], path)
    return MergedFile(Path(path), info, inputs)


def _numpy_type(elem_type: int) -> np.dtype:
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type)


def _first_step_pasts(
    merged: MergedFile, rows: int, sizes: Mapping[str, int]
) -> dict[str, np.ndarray]:
    """The pasts of the first step: zero-length decoder pasts; encoder pasts, which it does not
    read, zero-length too, or of the length ``sizes`` gives their declared dimension."""
    feeds = {}
    for name, (elem_type, dims) in merged.inputs.items():
        if c.is_past_name(name):
            heads, head_dim = dims[1], dims[3]
            if not isinstance(heads, int) or not isinstance(head_dim, int):
                raise ValueError(f"{merged.path}: {name} does not declare heads and head_dim")
            length = sizes.get(dims[2], 0) if ".encoder." in name else 0
            feeds[name] = np.zeros((rows, heads, length, head_dim), _numpy_type(elem_type))
    return feeds


def _placeholders(merged: MergedFile, rows: int) -> dict[str, np.ndarray]:
    """Zero-length stand-ins for the encoder inputs a cached step does not read."""
    feeds = {}
    for name in merged.info.encoder_inputs:
        if name == c.ATTENTION_MASK:
            continue
        elem_type, dims = merged.inputs[name]
        middle = [d if isinstance(d, int) else 1 for d in dims[1:-1]]
        feeds[name] = np.zeros((rows, *middle, 0), _numpy_type(elem_type))
    return feeds


def _symbol_sizes(merged: MergedFile, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """The size each symbolic dimension takes in ``feeds``."""
    sizes = {}
    for name, value in feeds.items():
        for dim, size in zip(merged.inputs[name][1], value.shape, strict=False):
            if isinstance(dim, str):
                sizes[dim] = size
    return sizes


def decoder_start_token(merged: MergedFile) -> int:
    for source in (merged.info.generation_config, merged.info.config):
        start = source.get("decoder_start_token_id")
        if isinstance(start, int):
            return start
    raise ValueError(f"{merged.path} names no decoder_start_token_id")


@dataclass(frozen=True)
class Steps:
    """``tokens``: ``[rows, 1 + steps]``, the start token first; ``logits``: one
    ``[rows, vocab]`` array per step (the last position)."""

    tokens: np.ndarray
    logits: list[np.ndarray]


def greedy_steps(
    runner: Runner, merged: MergedFile, encoder_inputs: Mapping[str, np.ndarray], steps: int
) -> Steps:
    """``steps`` greedy steps (argmax, no stopping at eos): the first with
    ``use_cache_branch = false`` and zero-length pasts, the others with the cache fed back.

    Inputs a step does not read get zero-length stand-ins, or for a runner that cannot take
    them, stand-ins of the sizes of the inputs read (the encoder inputs themselves on cached
    steps); the contract allows either."""
    rows = next(iter(encoder_inputs.values())).shape[0]
    layers = merged.info.num_layers
    tokens = np.full((rows, 1), decoder_start_token(merged), np.int64)
    zero = runner.zero_length_stand_ins
    sizes = {} if zero else _symbol_sizes(merged, encoder_inputs)
    feeds = {
        **encoder_inputs,
        c.DECODER_INPUT_IDS: tokens,
        c.USE_CACHE_BRANCH: np.zeros(1, np.bool_),
        **_first_step_pasts(merged, rows, sizes),
    }
    mask = encoder_inputs.get(c.ATTENTION_MASK)
    encoder_past: dict[str, np.ndarray] = {}
    all_logits = []
    for step in range(steps):
        out = runner.run(feeds)
        logits = out[c.LOGITS][:, -1]
        all_logits.append(np.asarray(logits, np.float32))
        tokens = np.concatenate([tokens, logits.argmax(-1)[:, None].astype(np.int64)], axis=1)
        if step == 0:
            encoder_past = {
                past: out[present]
                for past, present in zip(
                    c.past_names(layers, "encoder"), c.present_names(layers, "encoder"), strict=True
                )
            }
        feeds = {
            **(_placeholders(merged, rows) if zero else encoder_inputs),
            c.DECODER_INPUT_IDS: tokens[:, -1:],
            c.USE_CACHE_BRANCH: np.ones(1, np.bool_),
            **encoder_past,
            **{
                past: out[present]
                for past, present in zip(
                    c.past_names(layers, "decoder"), c.present_names(layers, "decoder"), strict=True
                )
            },
        }
        if mask is not None:
            feeds[c.ATTENTION_MASK] = mask
    return Steps(tokens, all_logits)


# ---------------------------------------------------------------------------------------------
# generator files


def run_generator(
    runner: Runner, encoder_inputs: Mapping[str, np.ndarray], max_new_tokens: int
) -> dict[str, np.ndarray]:
    """One call of a generator file: ``sequences`` (and ``sequences_scores`` for beam search)."""
    return runner.run({**encoder_inputs, "max_new_tokens": np.array(max_new_tokens, np.int64)})


def generator_search(path: str | os.PathLike) -> dict:
    model = onnx.load(os.fspath(path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    return json.loads(meta[c.META_GENERATOR])


# ---------------------------------------------------------------------------------------------
# the table of docs/runtimes.md

COLUMNS = ("onnxruntime", "openvino", "tract", "reference", "node")


def expected(runtime: str, kind: str, arch: str) -> str:
    """The cell of :data:`SUPPORT` for one architecture's file."""
    cell = SUPPORT[runtime][kind]
    return EXCEPT.get((runtime, kind), {}).get(arch, cell) if cell == RUNS else cell


def support_table() -> str:
    """:data:`SUPPORT` as the Markdown table docs/runtimes.md shows: file kinds down, runtimes
    across; a failure reads "no (n)" and a cell with exceptions "runs (n)", with the reasons in
    the numbered list :func:`support_notes` gives."""
    reasons = _reasons()
    lines = [
        "| file | " + " | ".join(TITLES[r] for r in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for kind in FILE_KINDS:
        cells = []
        for runtime in COLUMNS:
            cell = SUPPORT[runtime][kind]
            if cell == RUNS and (runtime, kind) in EXCEPT:
                numbers = [reasons.index(r) + 1 for r in EXCEPT[runtime, kind].values()]
                cell = "runs (" + ", ".join(map(str, numbers)) + ")"
            elif cell not in (RUNS, NOT_TESTED):
                cell = f"no ({reasons.index(cell) + 1})"
            cells.append(cell)
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def versions_table(versions: dict[str, str]) -> str:
    """The runtimes' packages and the versions tested, ``versions`` by runtime name."""
    packages = {**PACKAGES, "node": "onnxruntime-node (npm, tests/js)"}
    lines = ["| runtime | package | version tested |", "|---|---|---|"]
    lines += [f"| {TITLES[r]} | {packages[r]} | {versions[r]} |" for r in COLUMNS]
    return "\n".join(lines)


def support_notes() -> str:
    return "\n".join(f"{i}. {reason}." for i, reason in enumerate(_reasons(), 1))


def _reasons() -> list[str]:
    found: list[str] = []
    for runtime in COLUMNS:
        for kind in FILE_KINDS:
            cell = SUPPORT[runtime][kind]
            cells = EXCEPT.get((runtime, kind), {}).values() if cell == RUNS else [cell]
            found += [c for c in cells if c not in (RUNS, NOT_TESTED) and c not in found]
    return found
