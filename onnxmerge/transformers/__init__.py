"""Merged models driven by transformers' ``generate()`` and ``pipeline()``.

``MergedModelForSeq2SeqLM.from_pretrained("model.onnx")`` is a transformers model: one step of
the merged file is a ``forward``, and the cache a transformers ``Cache`` over the runtime's
:class:`onnxmerge.runtime.Cache`. Needs the ``transformers`` extra (torch and transformers);
see ``docs/transformers.md``.

Inside this package ``import transformers`` is an absolute import: it names the library, never
this package.
"""

from __future__ import annotations

from onnxmerge.errors import MissingDependencyError

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise MissingDependencyError(
        f"onnxmerge.transformers needs torch and transformers ({error}); install them with "
        "pip install 'onnxmerge[transformers]'"
    ) from error

from onnxmerge.transformers._cache import MergedCache
from onnxmerge.transformers._model import (
    MergedEncoderOutput,
    MergedModelForSeq2SeqLM,
    MergedModelForSpeechSeq2Seq,
)

__all__ = [
    "MergedCache",
    "MergedEncoderOutput",
    "MergedModelForSeq2SeqLM",
    "MergedModelForSpeechSeq2Seq",
]
