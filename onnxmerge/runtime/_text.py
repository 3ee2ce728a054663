"""Text in, text out: a tokenizer found beside the merged file, around ``Seq2SeqModel.generate``."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from onnxmerge.errors import GenerationError, MissingDependencyError
from onnxmerge.settings import GENERATE_KEYWORDS, GenerationSettings


class Generates(Protocol):
    """What text generation needs of a model (``Seq2SeqModel`` has it)."""

    @property
    def path(self) -> Path: ...

    @property
    def encoder_input_names(self) -> Sequence[str]: ...

    def generate(self, inputs: dict[str, np.ndarray], /, **kwargs: Any) -> np.ndarray: ...

    def generate_many(self, inputs: Iterable[Any], **kwargs: Any) -> Iterator[np.ndarray]: ...

    def stream(
        self, inputs: dict[str, np.ndarray], /, **kwargs: Any
    ) -> Generator[dict[int, np.ndarray], None, None]: ...

    def resolve_settings(self, prompt_length: int = 1, **overrides: Any) -> GenerationSettings: ...


_NO_IDS = np.empty(0, dtype=np.int64)

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

    def stream(self, text: str, **generate_kwargs: Any) -> Generator[str, None, None]:
        """Generate from one text, yielding its text in pieces as they come: a piece (maybe
        empty) per new id, as transformers' ``TextIteratorStreamer`` gives them (see
        :class:`TextPieces`). The pieces joined are what ``translate(text)`` returns. Leaving
        the loop runs no further step.

        Raises:
            GenerationError: ``text`` is not a string, ``num_return_sequences`` is not 1, or
                the settings are invalid (when the first piece is asked for).
        """
        for _, piece in self.stream_tokens(text, **generate_kwargs):
            yield piece

    def stream_tokens(
        self, text: str | Mapping[str, np.ndarray], **generate_kwargs: Any
    ) -> Generator[tuple[int | None, str], None, None]:
        """``stream()``, each piece with the id it comes with: greedy search and sampling give
        an id per step as the step ends; beam search gives the final hypothesis' ids at once
        (``Seq2SeqModel.stream``). A last ``(None, text)`` comes only where the search ended
        without eos or max_length (then the text held back comes with no id). ``text`` may
        also be the encoder inputs of one example, already tokenized (``[1, length]`` arrays).
        """
        if isinstance(text, Mapping):
            inputs = dict(text)
        elif isinstance(text, str):
            encoded = self.tokenizer([text])
            inputs = {
                name: np.asarray(encoded[name], dtype=np.int64)
                for name in self.model.encoder_input_names
                if name in encoded
            }
        else:
            raise GenerationError(
                f"stream() takes one text, got {type(text).__name__}", argument="text"
            )
        overrides = {k: v for k, v in generate_kwargs.items() if k in GENERATE_KEYWORDS}
        settings = self.model.resolve_settings(**overrides)
        if settings.num_return_sequences != 1:
            raise GenerationError(
                "stream() gives one sequence: leave num_return_sequences at 1",
                argument="num_return_sequences",
            )
        last = set(settings.eos_token_id or ())
        longest = settings.max_length - 1  # new ids: the prompt is the decoder start token
        pieces = TextPieces(self.tokenizer)
        count = 0
        steps = self.model.stream(inputs, **generate_kwargs)
        try:
            for step in steps:
                for token in step.get(0, _NO_IDS).tolist():
                    count += 1
                    piece = pieces.push([token])
                    if token in last or count >= longest:
                        piece += pieces.end()
                    yield token, piece
        finally:
            steps.close()
        rest = pieces.end()
        if rest:
            yield None, rest


class TextPieces:
    """The text of a growing sequence of ids, given out in pieces as transformers'
    ``TextStreamer`` gives them: the sequence is decoded whole (special tokens skipped) after
    every ``push``, and the new text is given out up to its last space, or whole where it ends
    in a newline or a CJK character; ``end()`` gives the rest.

    Unlike ``TextStreamer``, a newline does not start a new sequence to decode (decoding the
    ids after it alone may lose a leading space), and text ending in an incomplete character
    (U+FFFD, a byte-level piece of a character) is held back: the pieces joined are the text
    of the whole sequence.
    """

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._given = 0  # characters of the decoded text given out

    def push(self, ids: Iterable[int]) -> str:
        """Add ids; returns the text they complete (maybe empty)."""
        self._ids.extend(int(i) for i in ids)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        if text.endswith("\n") or (text and _is_cjk(ord(text[-1]))):
            cut = len(text)
        else:
            cut = text.rfind(" ") + 1
        piece = text[self._given : cut]
        self._given = max(self._given, cut)
        return piece

    def end(self) -> str:
        """The text not given out yet; the next ``push`` starts a new sequence."""
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True) if self._ids else ""
        piece = text[self._given :]
        self._ids, self._given = [], 0
        return piece


def _is_cjk(code: int) -> bool:
    """A CJK ideograph, a word of its own (the code point blocks ``TextStreamer`` checks)."""
    return any(
        low <= code <= high
        for low, high in (
            (0x4E00, 0x9FFF),
            (0x3400, 0x4DBF),
            (0x20000, 0x2A6DF),
            (0x2A700, 0x2B73F),
            (0x2B740, 0x2B81F),
            (0x2B820, 0x2CEAF),
            (0xF900, 0xFAFF),
            (0x2F800, 0x2FA1F),
        )
    )
