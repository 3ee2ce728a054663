"""The export cache: entries published atomically, keyed by the versions that shape the files.

Used by the tiny test zoo (``zoo.py``) and the benchmarks' reference models. Nothing here imports
torch, transformers or optimum at module level.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any


def package_versions(names: Sequence[str]) -> dict[str, str]:
    """Installed version of each package, ``"absent"`` where it is not installed."""
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


@contextlib.contextmanager
def staging(final: Path) -> Iterator[Path]:
    """A temporary folder beside ``final`` that becomes ``final`` only if the block succeeds.

    Concurrent builders of one entry never delete each other's result: the first rename wins and
    a later one finds the entry complete.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield folder
        try:
            os.replace(folder, final)
        except OSError:
            # Another process finished the same entry first; its copy is as good as ours.
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def tied_weight_pass(
    enabled: bool, weights_to_tie: Callable[..., Any] | None = None
) -> Iterator[None]:
    """Force optimum's post-export tied-weight deduplication on or off.

    optimum runs it from ``OnnxConfig.post_process_exported_models`` only when
    ``is_accelerate_available()`` (as imported into ``optimum.exporters.onnx.base``) is true; it
    uses ``accelerate.utils.find_tied_parameters``, so "on" needs accelerate installed, while "off"
    is what a user without accelerate gets. ``weights_to_tie`` replaces optimum's grouping of the
    tied parameters while the pass runs.
    """
    import optimum.exporters.onnx.base as optimum_base
    import optimum.onnx.graph_transformations as optimum_graph

    if enabled and not optimum_base.is_accelerate_available():
        raise RuntimeError(
            "optimum's tied-weight pass needs accelerate; install accelerate "
            "(pip install 'onnxmerge[export]')"
        )
    originals = (optimum_base.is_accelerate_available, optimum_graph._get_weights_to_tie)
    optimum_base.is_accelerate_available = lambda: enabled
    if enabled and weights_to_tie is not None:
        optimum_graph._get_weights_to_tie = weights_to_tie
    try:
        yield
    finally:
        optimum_base.is_accelerate_available, optimum_graph._get_weights_to_tie = originals


def export_onnx(
    pytorch_dir: Path,
    out_dir: Path,
    task: str,
    *,
    tied: bool | None = None,
    weights_to_tie: Callable[..., Any] | None = None,
    **kwargs: Any,
) -> None:
    """optimum's ``main_export`` without validation or warnings.

    ``tied`` forces the tied-weight pass on or off (None: as installed); ``kwargs`` go to
    ``main_export``.
    """
    from optimum.exporters.onnx import main_export

    tied_pass = contextlib.nullcontext() if tied is None else tied_weight_pass(tied, weights_to_tie)
    with tied_pass, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main_export(str(pytorch_dir), output=out_dir, task=task, do_validation=False, **kwargs)
