"""Merged models and generators in other ONNX runtimes than onnxruntime, equal to onnxruntime.

Each test checks one cell of ``tests.runtimes.SUPPORT`` (the table of
docs/runtimes.md): a cell that says the file runs must give the same tokens as onnxruntime (and
``Seq2SeqModel.generate`` for generators) with logits within the precision's tolerance; a cell
that gives a reason must still fail there. Failures of the two-decoder form (format versions 1
and 2) are expected failures on those versions only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests import runtimes as rt
from tests import zoo as tiny_zoo
from tests.zoo import ARCHITECTURES

# The tests that build files are marked `export` through their fixtures (conftest.py). onnx's
# reference casts the masks' -inf to integers and takes log(0) in T5's position buckets, harmlessly.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning"),
]

REPO = Path(__file__).resolve().parents[1]
JS_DIR = Path(__file__).parent / "js"
WITH_PAST = tuple(a for a in ARCHITECTURES if a != "vision-encoder-decoder")
OTHER_RUNTIMES = ("openvino", "tract", "reference")
# Steps run on every input; a budget of 1 new token is the first of them.
STEPS = 4
BUDGETS = (1, 4)
# Runtimes sum in their own order. Quantized files quantize activations at run time
# (DynamicQuantizeLinear): OpenVINO's int8 kernels round some of them to the next code, which
# moves logits by up to about 2% of their largest magnitude (mT5, BlenderbotSmall); the bound of
# a quantized file is therefore relative to that magnitude, the float one absolute.
LOGITS_TOLERANCE = {"fp32": 1e-4, "int8": 0.03, "int8 row": 0.03, "int4": 0.03}
# A file's precision in these tests: quantize's options.
QUANTIZED = {
    "int8": {"weights": "int8"},
    "int8 row": {"weights": "int8", "activation_scale": "row"},
    "int4": {"weights": "int4"},
}
SCORES_TOLERANCE = 1e-4
# The generators are checked on fewer architectures (int8 on the first only): each OpenVINO
# compile of a Loop costs a few seconds. Whisper brings float encoder inputs, T5 relative bias.
GENERATOR_ARCHITECTURES = ("marian", "t5", "whisper")


class _Files:
    """Merged, quantized and generator files of the zoo, and onnxruntime's answers, made once."""

    def __init__(self, tiny_export, root: Path):
        self.tiny_export = tiny_export
        self.root = root
        self.cache: dict = {}

    def _once(self, key, make):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def merged(self, arch: str, precision: str = "fp32") -> Path:
        import onnxmerge

        def make():
            if precision == "fp32":
                return onnxmerge.merge_seq2seq(
                    self.tiny_export(arch).onnx_dir, self.root / f"{arch}.onnx"
                )
            name = f"{arch}-{precision.replace(' ', '-')}.onnx"
            return onnxmerge.quantize(self.merged(arch), self.root / name, **QUANTIZED[precision])

        return self._once(("merged", arch, precision), make)

    def generator(self, arch: str, search: str, precision: str) -> Path:
        from onnxmerge.generator import build_generator

        path = self.root / f"{arch}-{precision}-{search}.onnx"
        return self._once(
            ("generator", arch, search, precision),
            lambda: build_generator(self.merged(arch, precision), path, search=search),
        )

    def inputs(self, arch: str) -> list[dict[str, np.ndarray]]:
        """A single input and a padded batch of three."""
        export = self.tiny_export(arch)
        return self._once(
            ("inputs", arch),
            lambda: [
                tiny_zoo.sample_encoder_inputs(export, batch=1, seq=5, seed=0),
                tiny_zoo.sample_encoder_inputs(export, batch=3, seq=6, seed=1),
            ],
        )

    def steps(self, arch: str, precision: str) -> list[rt.Steps]:
        """onnxruntime's greedy steps on every input."""

        def make():
            path = self.merged(arch, precision)
            runner, merged = rt.open_runner("onnxruntime", path), rt.read_merged(path)
            return [rt.greedy_steps(runner, merged, x, STEPS) for x in self.inputs(arch)]

        return self._once(("steps", arch, precision), make)

    def generated(self, arch: str, search: str, precision: str) -> list[dict]:
        """Per input and budget: Seq2SeqModel.generate's tokens, onnxruntime's generator outputs."""
        import onnxmerge

        def make():
            model = onnxmerge.Seq2SeqModel(self.merged(arch, precision))
            generator = rt.open_runner("onnxruntime", self.generator(arch, search, precision))
            beams = rt.generator_search(self.generator(arch, search, precision))["num_beams"]
            found = []
            for inputs in self.inputs(arch):
                for budget in BUDGETS:
                    found.append(
                        {
                            "inputs": inputs,
                            "budget": budget,
                            "tokens": model.generate(
                                inputs, max_new_tokens=budget, num_beams=beams
                            ),
                            "onnxruntime": rt.run_generator(generator, inputs, budget),
                        }
                    )
            return found

        return self._once(("generated", arch, search, precision), make)


@pytest.fixture(scope="module")
def files(tiny_export, tmp_path_factory) -> _Files:
    pytest.importorskip(
        "onnxruntime", reason="onnxruntime is the reference: pip install onnxruntime"
    )
    return _Files(tiny_export, tmp_path_factory.mktemp("runtimes"))


def _runner(runtime: str, path: Path) -> rt.Runner:
    try:
        return rt.open_runner(runtime, path)
    except rt.RuntimeUnavailable as error:
        pytest.skip(f"{error} (no wheel for this platform?)")


def _expect(request, runtime: str, kind: str, arch: str, format_version: str | None) -> str:
    """The cell of SUPPORT; marks the test an expected failure where the two-decoder form is
    the reason and the file has that form."""
    try:
        rt.version(runtime)
    except rt.RuntimeUnavailable as error:
        pytest.skip(f"{error} (no wheel for this platform?)")
    cell = rt.expected(runtime, kind, arch)
    if cell in rt.TWO_DECODER_FAILURES:
        if format_version in rt.TWO_DECODER_FORMATS:
            from tract.bindings import TractError  # the only runtime of these cells

            request.applymarker(
                pytest.mark.xfail(strict=False, raises=TractError, reason=f"{runtime} {cell}")
            )
        return rt.RUNS
    return cell


def _check_steps(files: _Files, runtime: str, arch: str, precision: str) -> None:
    path = files.merged(arch, precision)
    runner, merged = _runner(runtime, path), rt.read_merged(path)
    for inputs, expected in zip(files.inputs(arch), files.steps(arch, precision), strict=True):
        got = rt.greedy_steps(runner, merged, inputs, STEPS)
        np.testing.assert_array_equal(got.tokens, expected.tokens)
        for step, (a, b) in enumerate(zip(got.logits, expected.logits, strict=True)):
            tolerance = LOGITS_TOLERANCE[precision] * (1 if precision == "fp32" else abs(b).max())
            np.testing.assert_allclose(
                a, b, atol=tolerance, rtol=0, err_msg=f"step {step}, {inputs}"
            )


def _step_cases() -> list[tuple[str, str, str]]:
    """(arch, precision, runtime): every architecture where a file should run (or should once
    the two-decoder form is gone); a failure that stays is witnessed on the first one only."""
    cases = []
    for runtime in OTHER_RUNTIMES:
        for precision in ("fp32", *QUANTIZED):
            cell = rt.SUPPORT[runtime][f"model.onnx {precision}"]
            runs = cell == rt.RUNS or cell in rt.TWO_DECODER_FAILURES
            cases += [(arch, precision, runtime) for arch in (WITH_PAST if runs else WITH_PAST[:1])]
    return cases


@pytest.mark.parametrize(("arch", "precision", "runtime"), _step_cases())
def test_merged_model_step_by_step(files, request, runtime, precision, arch):
    path = files.merged(arch, precision)
    version = rt.read_merged(path).format_version
    cell = _expect(request, runtime, f"model.onnx {precision}", arch, version)
    if cell != rt.RUNS:
        # Witnessed on any of the inputs: LongT5 runs in tract on one input, not on the batch.
        with pytest.raises(Exception):  # noqa: B017 - each runtime raises its own class
            runner, merged = rt.open_runner(runtime, path), rt.read_merged(path)
            for inputs in files.inputs(arch):
                rt.greedy_steps(runner, merged, inputs, 2)
        return
    _check_steps(files, runtime, arch, precision)


def _generator_cases() -> list[tuple[str, str, str, str]]:
    """(arch, precision, search, runtime), a failure witnessed on the first file only."""
    files = [(arch, "fp32") for arch in GENERATOR_ARCHITECTURES]
    files.append((GENERATOR_ARCHITECTURES[0], "int8"))
    cases = []
    for runtime in OTHER_RUNTIMES:
        for search in ("greedy", "beam"):
            for arch, precision in files:
                cell = rt.SUPPORT[runtime][f"{search} generator {precision}"]
                if cell == rt.RUNS or arch == files[0][0]:
                    cases.append((arch, precision, search, runtime))
    return cases


@pytest.mark.parametrize(("arch", "precision", "search", "runtime"), _generator_cases())
def test_generator(files, request, runtime, search, precision, arch):
    path = files.generator(arch, search, precision)
    cell = _expect(request, runtime, f"{search} generator {precision}", arch, None)
    if cell != rt.RUNS:
        with pytest.raises(Exception):  # noqa: B017
            rt.run_generator(rt.open_runner(runtime, path), files.inputs(arch)[0], 1)
        return
    runner = _runner(runtime, path)
    for case in files.generated(arch, search, precision):
        got = rt.run_generator(runner, case["inputs"], case["budget"])
        where = f"max_new_tokens={case['budget']}, {case['inputs']}"
        np.testing.assert_array_equal(got["sequences"], case["tokens"], err_msg=where)
        if search == "beam":
            np.testing.assert_allclose(
                got["sequences_scores"],
                case["onnxruntime"]["sequences_scores"],
                atol=SCORES_TOLERANCE,
                rtol=0,
                err_msg=where,
            )


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    if not (JS_DIR / "node_modules" / "onnxruntime-node").is_dir():
        pytest.skip("onnxruntime-node is not installed: npm ci --ignore-scripts in tests/js")
    return node


def _run_node(node: str, script: str, env: dict[str, str]) -> None:
    done = subprocess.run(
        [node, "--test", script],
        cwd=JS_DIR,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "# pass 1" in done.stdout, done.stdout


@pytest.mark.parametrize("precision", ["fp32", *QUANTIZED])
def test_merged_model_in_node(files, tmp_path, precision):
    """The merged file step by step in onnxruntime-node (tests/js) gives onnxruntime's tokens."""
    node = _node()
    assert rt.SUPPORT["node"][f"model.onnx {precision}"] == rt.RUNS
    path = files.merged("marian", precision)
    merged = rt.read_merged(path)
    steps = {
        "start": rt.decoder_start_token(merged),
        "steps": STEPS,
        "past_shapes": {
            name: [dims[1], dims[3]]
            for name, (_, dims) in merged.inputs.items()
            if name.startswith("past_key_values.")
        },
        "cases": [
            {"inputs": {k: v.tolist() for k, v in x.items()}, "expected": e.tokens.tolist()}
            for x, e in zip(files.inputs("marian"), files.steps("marian", precision), strict=True)
        ],
    }
    cases_file = tmp_path / "steps.json"
    cases_file.write_text(json.dumps(steps))
    _run_node(
        node,
        "steps.test.mjs",
        {"ONNXMERGE_MERGED_MODEL": str(path), "ONNXMERGE_STEPS_CASES": str(cases_file)},
    )


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_generator_in_node(files, tmp_path, search, precision):
    """The node client (tests/js) gives Seq2SeqModel.generate's tokens."""
    node = _node()
    assert rt.SUPPORT["node"][f"{search} generator {precision}"] == rt.RUNS
    cases = [
        {
            "inputs": {k: v.tolist() for k, v in case["inputs"].items()},
            "max_new_tokens": case["budget"],
            "expected": case["tokens"].tolist(),
        }
        for case in files.generated("marian", search, precision)
    ]
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps(cases))
    model = str(files.generator("marian", search, precision))
    _run_node(
        node,
        "generate.test.mjs",
        {"ONNXMERGE_GENERATOR_MODEL": model, "ONNXMERGE_GENERATOR_CASES": str(cases_file)},
    )


def test_openvino_steps_under_the_python_search(files):
    """The benchmarks' OpenVINO steps under the runtime's search give onnxruntime's tokens."""
    pytest.importorskip("openvino", reason="openvino is not installed: pip install openvino")
    import onnxmerge
    from benchmarks._openvino_backend import openvino_model

    path = files.merged("marian")
    ours = onnxmerge.Seq2SeqModel(path)
    theirs = openvino_model(path)
    inputs = files.inputs("marian")[1]
    for beams in (1, 3):
        np.testing.assert_array_equal(
            theirs.generate(inputs, max_new_tokens=6, num_beams=beams),
            ours.generate(inputs, max_new_tokens=6, num_beams=beams),
        )


def test_the_runtime_offers_no_other_backend(files):
    """OpenVINO, measured slower, lives with the benchmarks: the session takes no backend."""
    from onnxmerge.runtime._session import MergedSession

    with pytest.raises(TypeError, match="backend"):
        MergedSession(files.merged("marian"), backend="openvino")  # type: ignore[call-arg]


@pytest.mark.docs
def test_docs_table_is_what_the_tests_check():
    """docs/runtimes.md shows SUPPORT, its reasons and the versions installed here."""
    text = (REPO / "docs" / "runtimes.md").read_text(encoding="utf-8")
    assert rt.support_table() in text, "docs/runtimes.md: paste rt.support_table()"
    assert rt.support_notes() in text, "docs/runtimes.md: paste rt.support_notes()"
    node = json.loads((JS_DIR / "package.json").read_text())["devDependencies"]["onnxruntime-node"]
    for runtime in rt.RUNTIMES:
        try:
            version = rt.version(runtime)
        except rt.RuntimeUnavailable:
            continue
        row = f"| {rt.TITLES[runtime]} | {rt.PACKAGES[runtime]} | {version} |"
        assert row in text, f"docs/runtimes.md should list {row}"
    assert f"| {rt.TITLES['node']} | onnxruntime-node (npm, tests/js) | {node} |" in text
