"""Translate a text, line by line: one result per input line, in order.

``translate_lines(model, lines)`` runs every line of a file (or any iterable of lines) through
``Seq2SeqModel.generate_many``: lines are batched as that batches them, and each comes back in its
place. A line that cannot be translated (not UTF-8, too long, ids outside the vocabulary) gets a
result with its error and an empty text, so the lines after it keep their numbers; a blank line
translates to an empty line (documents separate paragraphs with them).

Example:
    >>> from onnxmerge.translate import translate_lines  # doctest: +SKIP
    >>> with open("fr.txt", "rb") as source, open("en.txt", "w") as out:  # doctest: +SKIP
    ...     for result in translate_lines(model, source):
    ...         out.write(result.text + "\\n")
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onnxmerge.errors import GenerationError

if TYPE_CHECKING:
    import numpy as np

    from onnxmerge.runtime import Seq2SeqModel

__all__ = ["LineResult", "open_model", "translate_lines"]


@dataclass(frozen=True)
class LineResult:
    """What became of one input line.

    Attributes:
        number: the line's number, from 1.
        text: the translation, on one line (token ids separated by spaces with ``ids=True``);
            empty for a blank line and for a line that failed.
        error: why the line was not translated, or None.
        tokens: the tokens generated for it.
    """

    number: int
    text: str = ""
    error: str | None = None
    tokens: int = 0

    @property
    def ok(self) -> bool:
        """Whether the line was translated (a blank line is: into a blank line)."""
        return self.error is None


def open_model(
    path: str | os.PathLike,
    *,
    parallel_batches: int = 1,
    threads: int | None = None,
    session_cache: str | os.PathLike | None = None,
) -> Seq2SeqModel:
    """A model opened to translate ``parallel_batches`` batches at once.

    Args:
        path: the merged model.
        parallel_batches: the batches ``translate_lines`` will run at once; they share one pool
            of onnxruntime threads, sized so that together they use ``threads``.
        threads: onnxruntime's threads in all (default: every core with several batches at
            once, else onnxruntime's choice).
        session_cache: a folder keeping onnxruntime's optimized graph for later runs.

    Returns:
        The model.
    """
    from onnxmerge.runtime import Seq2SeqModel

    if parallel_batches > 1:
        from onnxmerge._ort import shared_pool_threads

        threads = shared_pool_threads(parallel_batches, threads)
    return Seq2SeqModel(path, session_cache=session_cache, threads=threads)


def translate_lines(
    model: Seq2SeqModel,
    lines: Iterable[bytes | str],
    *,
    tokenizer: Any = None,
    ids: bool = False,
    max_batch_size: int = 32,
    batch_type: str = "examples",
    parallel_batches: int = 1,
    **generate_kwargs: Any,
) -> Generator[LineResult, None, None]:
    """Translate each line of ``lines``; one result per line, in order, as they are done.

    Lines may be bytes (UTF-8, as read from a file opened in binary mode) or text; their line
    ends, and a byte order mark before the first, are not part of them. A blank line gives an
    empty translation; a line that cannot be translated gives a result with its error, and the
    lines after it go on.

    Args:
        model: the model, from ``open_model`` with the same ``parallel_batches``.
        lines: the lines, e.g. a file opened with ``open(path, "rb")``; read as batches need
            them.
        tokenizer: a transformers tokenizer (default: the one beside the model); not used with
            ``ids``.
        ids: the lines are token ids separated by spaces, and so are the results.
        max_batch_size: inputs per batch (source tokens with ``batch_type="tokens"``).
        batch_type: ``"examples"`` or ``"tokens"``: what ``max_batch_size`` counts.
        parallel_batches: batches translated at once.
        **generate_kwargs: the settings of ``Seq2SeqModel.generate`` (``max_new_tokens``,
            ``num_beams``, ...).

    Returns:
        A generator of ``LineResult``; closing it stops the batches running.

    Raises:
        GenerationError: the model reads something other than token ids, or a setting is
            invalid; raised here, before any line is read.
        OnnxMergeError: no tokenizer beside the model (without ``ids``).
    """
    main = model.main_input
    if main != "input_ids":
        raise GenerationError(
            f"{model.path} reads {main}, not token ids: translate takes text or ids; "
            "call Seq2SeqModel.generate_many() on its inputs from Python",
            argument="model",
        )
    if not ids and tokenizer is None:
        from onnxmerge.runtime import TextGenerator

        tokenizer = TextGenerator.load_tokenizer(model.path.parent)
    pending: deque[int | LineResult] = deque()
    inputs = _inputs(model, None if ids else tokenizer, lines, pending)
    results = model.generate_many(
        inputs,
        max_batch_size=max_batch_size,
        batch_type=batch_type,
        parallel_batches=parallel_batches,
        **generate_kwargs,
    )
    return _in_order(results, pending, None if ids else tokenizer)


def _in_order(
    results: Generator[np.ndarray, None, None], pending: deque[int | LineResult], tokenizer: Any
) -> Generator[LineResult, None, None]:
    """Each line's result: the lines that needed no model (blank or failed) between those that
    came back from it. ``pending`` holds, in order, the number of each line sent to the model
    and the result of each line that was not."""

    def settled() -> Iterator[LineResult]:
        while pending and isinstance(pending[0], LineResult):
            yield pending.popleft()  # type: ignore[misc]  # the test above says it is one

    try:
        for sequences in results:
            yield from settled()
            number = pending.popleft()
            assert isinstance(number, int)
            generated = sequences[0, 1:]
            if tokenizer is None:
                text = " ".join(map(str, generated.tolist()))
            else:
                text = _one_line(tokenizer.decode(generated, skip_special_tokens=True))
            yield LineResult(number, text, tokens=int(generated.size))
        yield from settled()
    finally:  # stops the batches running now (an error, an interruption, a closed iterator)
        results.close()


def _inputs(
    model: Seq2SeqModel, tokenizer: Any, lines: Iterable[bytes | str], pending: deque
) -> Iterator[np.ndarray]:
    """The token ids of each line for the model; every line's place goes to ``pending`` as the
    line is read: its number when it goes to the model, else its result."""
    from onnxmerge.settings import encoder_positions

    positions = encoder_positions(model.config)
    vocab = model.config.get("vocab_size")
    for number, line in enumerate(lines, 1):
        found = _line_ids(number, line, tokenizer, vocab if isinstance(vocab, int) else None)
        if not isinstance(found, LineResult) and positions is not None and len(found) > positions:
            message = f"{len(found)} tokens, more than the model's {positions} positions"
            found = LineResult(number, error=message)
        if isinstance(found, LineResult):
            pending.append(found)
            continue
        pending.append(number)
        yield _as_array(found)


def _as_array(ids: list[int]) -> np.ndarray:
    import numpy as np

    return np.asarray(ids, dtype=np.int64)


def _line_ids(
    number: int, line: bytes | str, tokenizer: Any, vocab: int | None
) -> list[int] | LineResult:
    """The token ids of one line, or its result where it needs no model: blank, or refused."""
    # A byte order mark starts the files some Windows editors write.
    if isinstance(line, bytes):
        try:
            line = line.removeprefix(b"\xef\xbb\xbf" if number == 1 else b"").decode("utf-8")
        except UnicodeDecodeError as error:
            message = f"not UTF-8 (byte {error.start + 1}); nothing translated"
            return LineResult(number, error=message)
    elif number == 1:
        line = line.removeprefix("\ufeff")
    text = line.rstrip("\r\n")
    if not text.strip():
        return LineResult(number)
    if tokenizer is not None:
        return list(tokenizer(text)["input_ids"])
    words = text.split()
    if not all(word.isascii() and word.isdigit() for word in words):
        return LineResult(number, error="--ids takes non-negative integers separated by spaces")
    ids = [int(word) for word in words]
    outside = next((i for i in ids if vocab is not None and i >= vocab), None)
    if outside is not None and vocab is not None:
        return LineResult(number, error=f"id {outside} is outside the vocabulary 0..{vocab - 1}")
    return ids


def _one_line(text: str) -> str:
    """A translation on one output line: a line break inside it would shift every later line."""
    return " ".join(text.splitlines()) if "\n" in text or "\r" in text else text
