"""Text in, text out: a tokenizer found beside the merged file, around ``Seq2SeqModel.generate``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnxmerge.errors import GenerationError

if TYPE_CHECKING:
    from onnxmerge.runtime.model import Seq2SeqModel


class TextGenerator:
    """Tokenize, generate, decode.

    ``TextGenerator(model)`` loads the tokenizer saved in the merged file's folder (an optimum
    export folder holds it); pass ``tokenizer`` to use another one. Needs ``transformers``.
    """

    def __init__(self, model: Seq2SeqModel, tokenizer: Any | None = None):
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else self.load_tokenizer(model.path.parent)

    @staticmethod
    def load_tokenizer(folder: str | os.PathLike) -> Any:
        try:
            from transformers import AutoTokenizer
        except ImportError as error:
            raise ImportError(
                "text in, text out needs transformers and tokenizers: "
                "pip install 'onnxmerge[text]', or tokenize yourself and call generate()"
            ) from error
        folder = Path(folder)
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as error:
            raise GenerationError(
                f"no tokenizer could be loaded from {folder}: {error}. Save one there "
                "(tokenizer.save_pretrained) or pass tokenizer="
            ) from error

    def __call__(self, texts: str | Sequence[str], **generate_kwargs: Any) -> list[str] | str:
        """Generate from ``texts``; a single string gives a string (per returned sequence: a list)."""
        single = isinstance(texts, str)
        batch = [texts] if single else list(texts)
        if not batch:
            return []
        encoded = self.tokenizer(batch, return_tensors="np", padding=True)
        names = set(self.model.encoder_input_names)
        inputs = {k: v for k, v in encoded.items() if k in names}
        ids = self.model.generate(inputs, **generate_kwargs)
        decoded = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        per_input = len(decoded) // len(batch)
        if per_input > 1:
            grouped = [decoded[i * per_input : (i + 1) * per_input] for i in range(len(batch))]
            return grouped[0] if single else grouped
        return decoded[0] if single else decoded
