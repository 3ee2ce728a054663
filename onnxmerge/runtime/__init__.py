"""Generation on a merged model with onnxruntime.

``Seq2SeqModel(path).generate(input_ids=..., attention_mask=...)`` returns the token ids
transformers' ``generate()`` returns for the same settings.
"""

from __future__ import annotations

from onnxmerge.runtime._accelerations import Accelerations
from onnxmerge.runtime._model import Seq2SeqModel
from onnxmerge.runtime._session import Cache, StepOutput
from onnxmerge.runtime._text import TextGenerator, TextPieces
from onnxmerge.settings import GenerationSettings

__all__ = [
    "Seq2SeqModel",
    "Accelerations",
    "Cache",
    "StepOutput",
    "GenerationSettings",
    "TextGenerator",
    "TextPieces",
]
