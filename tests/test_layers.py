"""The package's floors (docs/architecture.md): the import-linter contracts in pyproject.toml
hold, no module imports another top-level unit's private names, and the merge loads no later
stage."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "onnxmerge"
# Test tooling that is leaving the package for tests/: it reads the library's internals on purpose.
TOOLING = PACKAGE / "testing"
LATER_THAN_MERGE = ("runtime", "generator", "quantization", "web", "batch", "cli", "verify")


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    pytest.importorskip("importlinter")
    lint_imports = Path(sys.executable).parent / "lint-imports"
    if not lint_imports.exists():
        pytest.skip(f"no lint-imports beside {sys.executable}")
    result = _run([str(lint_imports), "--no-cache"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def _unit(module: str) -> str:
    """The top-level unit of ``onnxmerge.X...``: ``X``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _private_beyond_unit(name: str) -> bool:
    """Whether ``onnxmerge.X.a.b`` names something private inside unit ``X`` (``onnxmerge._ort``
    itself is a unit: private to the package, which every floor belongs to)."""
    return any(p.startswith("_") and not p.startswith("__") for p in name.split(".")[2:])


def _crossings(path: Path, root: Path = ROOT) -> list[str]:
    where = path.relative_to(root)
    module = ".".join(where.with_suffix("").parts).removesuffix(".__init__")
    own = _unit(module)
    found = []
    # Module aliases bound to another unit's modules: `alias._name` reads a private name too.
    aliases: dict[str, str] = {}
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        imported: list[str] = []
        if isinstance(node, ast.Import):
            imported = [a.name for a in node.names]
            aliases.update({a.asname: a.name for a in node.names if a.asname})
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported = [f"{node.module}.{a.name}" for a in node.names]
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        for name in imported:
            if name.startswith("onnxmerge.") and _unit(name) != own and _private_beyond_unit(name):
                found.append(f"{where}:{node.lineno} imports {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            target = aliases.get(node.value.id, "")
            name = f"{target}.{node.attr}"
            if target.startswith("onnxmerge.") and _unit(name) != own:
                if _private_beyond_unit(name):
                    found.append(f"{where}:{node.lineno} reads {name}")
    return found


def test_no_module_imports_another_units_private_names():
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if TOOLING not in p.parents]
    assert len(files) > 50
    crossings = [c for path in files for c in _crossings(path)]
    assert crossings == []


def test_the_private_names_check_sees_each_kind_of_crossing(tmp_path):
    planted = tmp_path / "onnxmerge" / "runtime" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(
        "from onnxmerge.merge._roles import Role\n"
        "from onnxmerge.passes import dedup\n"
        "from onnxmerge.runtime import _memory\n"  # its own unit: allowed
        "from onnxmerge import _ort\n"  # a private unit of the package: allowed
        "dedup._stored_chunks\n"
    )
    assert [c.split(" ", 1)[1] for c in _crossings(planted, tmp_path)] == [
        "imports onnxmerge.merge._roles.Role",
        "reads onnxmerge.passes.dedup._stored_chunks",
    ]


def test_the_merge_loads_no_later_stage_and_not_onnxruntime():
    code = (
        "import onnxmerge.merge, sys\n"
        "from onnxmerge.merge import merge_seq2seq\n"
        "print(sorted(m for m in sys.modules if m.startswith('onnxmerge')))\n"
        "print('onnxruntime' in sys.modules)\n"
    )
    result = _run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    modules_line, onnxruntime_line = result.stdout.splitlines()[-2:]
    modules = ast.literal_eval(modules_line)
    assert "onnxmerge.merge._orchestrate" in modules
    assert [m for m in modules if _unit(m) in LATER_THAN_MERGE] == []
    assert onnxruntime_line == "False"


def test_opening_a_model_loads_no_merge_or_writer():
    code = (
        "import sys\n"
        "from onnxmerge.runtime import Seq2SeqModel\n"
        "print(sorted(m for m in sys.modules if m.startswith('onnxmerge')))\n"
    )
    result = _run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    modules = ast.literal_eval(result.stdout.splitlines()[-1])
    assert "onnxmerge.runtime._model" in modules
    writers = ("merge", "passes", "quantization", "generator", "web", "batch", "cli", "check")
    assert [m for m in modules if _unit(m) in writers] == []


def test_opening_and_running_a_model_imports_neither_onnx_nor_onnx_ir(tmp_path):
    """Importing ``onnx`` (ml_dtypes' extension with it) took most of a load; importing protobuf
    and keeping the parsed graph cost the process megabytes: the runtime reads the file at the
    wire level (``onnxmerge/_wire.py``)."""
    from onnxmerge import merge_seq2seq
    from tests import textmodels as tm

    merged = merge_seq2seq(tm.write_export(tmp_path / "export"), tmp_path / "model.onnx")
    code = (
        "import sys\n"
        "import numpy as np\n"
        "from onnxmerge.runtime import Seq2SeqModel\n"
        f"model = Seq2SeqModel({str(merged)!r})\n"
        "ids = np.array([[5, 6, 7, 1]])\n"
        "start = np.array([[2]])\n"
        "model.generate(ids, decoder_input_ids=start, max_new_tokens=3)\n"
        "model.generate(ids, decoder_input_ids=start, max_new_tokens=3, num_beams=2)\n"
        "loaded = ('onnx', 'onnx_ir', 'ml_dtypes', 'google.protobuf', 'onnx.onnx_ml_pb2')\n"
        "print([m for m in loaded if m in sys.modules])\n"
    )
    result = _run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def test_serving_a_merged_file_imports_neither_onnx_nor_the_merge(tmp_path):
    """Regression: the server imported the merge for every model, merged or not: onnx and
    onnx-ir, 50 MB of the server's memory."""
    from onnxmerge import merge_seq2seq
    from tests import textmodels as tm

    merged = merge_seq2seq(tm.write_export(tmp_path / "export"), tmp_path / "model.onnx")
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from onnxmerge.serve._models import ServedModel\n"
        f"ServedModel.load('tiny', Path({str(merged)!r}))\n"
        "print([m for m in ('onnx', 'onnx_ir', 'onnxmerge.merge') if m in sys.modules])\n"
    )
    result = _run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def test_onnx_imported_after_the_runtime_shares_its_messages():
    code = (
        "from onnxmerge import _proto\n"
        "import onnx, onnx.checker, onnx.helper\n"
        "graph = onnx.helper.make_graph([], 'g', [], [])\n"
        "print(onnx.ModelProto is _proto.ModelProto, type(graph) is _proto.GraphProto)\n"
    )
    result = _run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "True True"
