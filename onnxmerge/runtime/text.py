"""Text in, text out: a tokenizer found beside the merged file, around ``Seq2SeqModel.generate``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from onnxmerge.errors import GenerationError, MissingDependencyError


class Generates(Protocol):
    """What text generation needs of a model (``Seq2SeqModel`` has it)."""

    @property
    def path(self) -> Path: ...

    @property
    def encoder_input_names(self) -> Sequence[str]: ...

    def generate(self, inputs: dict[str, np.ndarray], /, **kwargs: Any) -> np.ndarray: ...


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class TextGenerator:
    """Tokenize, generate, decode.

    ``TextGenerator(model)`` loads the tokenizer saved in the merged file's folder (an optimum
    export folder holds it); pass ``tokenizer`` to use another one. Needs ``transformers``.
    """

    def __init__(self, model: Generates, tokenizer: Any | None = None):
        if tokenizer is not None and not (
            callable(tokenizer) and hasattr(tokenizer, "batch_decode")
        ):
            raise GenerationError(
                f"tokenizer= must be a transformers tokenizer (AutoTokenizer.from_pretrained), "
                f"got {type(tokenizer).__name__}; wrap a tokenizers.Tokenizer with "
                "transformers.PreTrainedTokenizerFast(tokenizer_object=...)"
            )
        self.model = model
        self.tokenizer = (
            tokenizer if tokenizer is not None else self.load_tokenizer(model.path.parent)
        )

    @staticmethod
    def load_tokenizer(folder: str | os.PathLike) -> Any:
        folder = Path(folder)
        # Checked before importing transformers (seconds) and before its own, less clear errors.
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise GenerationError(
                f"no tokenizer beside the model in {folder} "
                f"(none of {', '.join(TOKENIZER_FILES)}); "
                "save one there (tokenizer.save_pretrained), or give token ids (--ids)"
            )
        try:
            from transformers import AutoTokenizer
        except ImportError as error:
            raise MissingDependencyError(
                f"text in, text out needs transformers and tokenizers ({error}): "
                "pip install 'onnxmerge[text]', or tokenize yourself and call generate()"
            ) from error
        folder = Path(folder)
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError, TypeError, AssertionError) as error:
            raise GenerationError(
                f"no tokenizer could be loaded from {folder}: {error}. Save one there "
                "(tokenizer.save_pretrained) or pass tokenizer="
            ) from error

    def __call__(self, texts: str | Sequence[str], **generate_kwargs: Any) -> list[str] | str:
        """Generate from ``texts``: a string per text, or a list per text with several sequences."""
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
