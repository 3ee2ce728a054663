"""Text in, text out: a tokenizer found beside the merged file, around ``Seq2SeqModel.generate``."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
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

    def generate_many(self, inputs: Iterable[Any], **kwargs: Any) -> Iterator[np.ndarray]: ...


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

    def __call__(
        self,
        texts: str | Sequence[str],
        *,
        max_batch_size: int = 32,
        batch_type: str = "examples",
        **generate_kwargs: Any,
    ) -> list[str] | str:
        """Generate from ``texts``: a string per text, or a list per text with several sequences.

        Texts go through ``generate_many`` in length-sorted batches (``max_batch_size``,
        ``batch_type`` as there), so each text's result is the one it gets alone."""
        single = isinstance(texts, str)
        batch = [texts] if single else list(texts)
        # No texts still go through generate_many, which checks the options at the call.
        encoded = self.tokenizer(batch) if batch else {}
        names = [n for n in self.model.encoder_input_names if n in encoded]
        inputs = (
            {name: np.asarray(encoded[name][i], dtype=np.int64) for name in names}
            for i in range(len(batch))
        )
        grouped = [
            self.tokenizer.batch_decode(ids, skip_special_tokens=True)
            for ids in self.model.generate_many(
                inputs, max_batch_size=max_batch_size, batch_type=batch_type, **generate_kwargs
            )
        ]
        if all(len(g) == 1 for g in grouped):
            decoded = [g[0] for g in grouped]
            return decoded[0] if single else decoded
        return grouped[0] if single else grouped
