"""The models a server holds: each a merged file (an export folder is merged first), its
tokenizer when one is saved beside it, the language pair its name gives, and the checks a
request's inputs pass before they join a batch."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnxmerge.errors import GenerationError, InvalidArgumentError, MissingDependencyError
from onnxmerge.settings import GENERATE_KEYWORDS, encoder_positions

# generate()'s settings and the sampling seed: what a request may set.
OPTION_NAMES = frozenset(GENERATE_KEYWORDS) | {"seed"}
# A name of the form SRC-TGT (fr-en, pt_BR-en, zh-Hant-en is not one) is a language pair.
_PAIR = re.compile(r"^([A-Za-z]{2,3}(?:_[A-Za-z0-9]+)?)-([A-Za-z]{2,3}(?:_[A-Za-z0-9]+)?)$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class RequestError(Exception):
    """A request the server refuses: ``status`` is the HTTP status, the message the reason."""

    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def language_pair(name: str) -> tuple[str, str] | None:
    """``("fr", "en")`` for the name ``fr-en``; None for a name that is not a pair."""
    match = _PAIR.match(name)
    return (match.group(1), match.group(2)) if match else None


def check_models(models: Mapping[str, str | os.PathLike]) -> dict[str, Path]:
    """The served names and their paths, checked before anything is read.

    Raises:
        InvalidArgumentError: no models, a name a URL or JSON cannot carry plainly, a path that
            does not exist, or two names of one language pair.
    """
    if not models:
        raise InvalidArgumentError("give at least one model to serve", argument="models")
    checked: dict[str, Path] = {}
    pairs: dict[tuple[str, str], str] = {}
    for name, path in models.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgumentError(
                f"model name {name!r} must start with a letter or digit and hold only letters, "
                "digits, '.', '_' and '-' (e.g. fr-en)",
                argument="models",
            )
        if not Path(path).exists():
            raise InvalidArgumentError(
                f"model {name!r}: {path} does not exist; give a merged .onnx file or an "
                "export folder",
                argument="models",
            )
        pair = language_pair(name)
        if pair is not None and pair in pairs:
            raise InvalidArgumentError(
                f"models {pairs[pair]!r} and {name!r} both translate {pair[0]} to {pair[1]}; "
                "serve one of them",
                argument="models",
            )
        if pair is not None:
            pairs[pair] = name
        checked[name] = Path(path)
    return checked


def models_from_arguments(arguments: Sequence[str]) -> dict[str, Path]:
    """The models of ``onnxmerge serve [NAME=]MODEL ...``: ``fr-en=opus-mt-fr-en/model.onnx``
    is served as ``fr-en``; a bare path under the name of its folder (a merged file's folder, or
    the export folder itself).

    Raises:
        InvalidArgumentError: no models, or two under one name.
    """
    models: dict[str, Path] = {}
    for argument in arguments:
        name, equals, path = argument.partition("=")
        if not equals:
            path = argument
            name = (Path(path) if Path(path).is_dir() else Path(path).parent).resolve().name
        if name in models:
            raise InvalidArgumentError(
                f"two models are named {name!r}; give each its own name, NAME=MODEL",
                argument="models",
            )
        models[name] = Path(path)
    if not models:
        raise InvalidArgumentError("give at least one model to serve", argument="models")
    return models


class LockedTokenizer:
    """A tokenizer used under the served model's lock: a fast tokenizer refuses calls from two
    threads at once."""

    def __init__(self, tokenizer: Any, lock: threading.Lock):
        self._tokenizer, self._lock = tokenizer, lock

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer.decode(*args, **kwargs)

    def batch_decode(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer.batch_decode(*args, **kwargs)


@dataclass
class ServedModel:
    """One loaded model under its served name."""

    name: str
    model: Any  # Seq2SeqModel
    tokenizer: Any | None
    merged_into: Path | None = None  # the temporary folder of a merged export, removed on close
    pair: tuple[str, str] | None = field(init=False)
    # A fast tokenizer may refuse a call while another thread's call runs ("Already borrowed").
    tokenizer_lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.pair = language_pair(self.name)

    @property
    def speech(self) -> bool:
        """Whether it is a Whisper model, served on ``/v1/audio/transcriptions``."""
        return bool(self.model.model_type == "whisper")

    @classmethod
    def load(
        cls,
        name: str,
        path: Path,
        threads: int | None = None,
        session_cache: str | os.PathLike | None = None,
    ) -> ServedModel:
        """Open ``path`` (a merged file, or an export folder merged first into a temporary
        folder) with the tokenizer saved beside it, if any, on ``threads`` intra-op threads;
        a merged file through ``session_cache``. A merged export does without it: its
        temporary folder is new at each start, and each would leave an entry behind."""
        from onnxmerge.runtime import Seq2SeqModel

        merged_into = None
        file = path
        if path.is_dir():
            # Imported only here: the merge brings onnx and onnx-ir, about 50 MB a server that
            # serves merged files never needs.
            from onnxmerge.merge import merge_seq2seq

            merged_into = Path(tempfile.mkdtemp(prefix="onnxmerge-serve-"))
            try:
                file = merge_seq2seq(path, merged_into / "model.onnx")
            except BaseException:
                shutil.rmtree(merged_into, ignore_errors=True)
                raise
            session_cache = None
        try:
            model = Seq2SeqModel(file, threads=threads, session_cache=session_cache)
        except BaseException:
            if merged_into is not None:
                shutil.rmtree(merged_into, ignore_errors=True)
            raise
        tokenizer = _tokenizer_in(path if path.is_dir() else path.parent)
        return cls(name, model, tokenizer, merged_into)

    def close(self) -> None:
        if self.merged_into is not None:
            shutil.rmtree(self.merged_into, ignore_errors=True)

    def encode(self, texts: list[str]) -> list[dict[str, np.ndarray]]:
        """Each text as the encoder inputs the tokenizer gives it, checked against the model's
        positions."""
        if self.tokenizer is None:
            raise RequestError(
                f"model {self.name!r} has no tokenizer beside it: give input_ids instead of text"
            )
        self._check_takes_ids()
        with self.tokenizer_lock:
            encoded = self.tokenizer(texts)
        names = [n for n in self.model.encoder_input_names if n in encoded]
        inputs = [
            {n: np.asarray(encoded[n][i], dtype=np.int64) for n in names} for i in range(len(texts))
        ]
        for number, example in enumerate(inputs):
            self.check_length(len(example["input_ids"]), number if len(inputs) > 1 else None)
        return inputs

    def check_ids(self, ids: Any) -> np.ndarray:
        """``input_ids`` of a request as a 1-D int64 array, each id a token of the vocabulary."""
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        ):
            raise RequestError("input_ids must be a non-empty list of integers")
        vocab = self.model.config.get("vocab_size")
        if not isinstance(vocab, int):
            vocab = None
        if any(i < 0 or (vocab is not None and i >= vocab) for i in ids):
            largest = f" to {vocab - 1}" if vocab is not None else " up"
            raise RequestError(f"input_ids must be token ids from 0{largest}")
        self._check_takes_ids()
        self.check_length(len(ids), None)
        return np.asarray(ids, dtype=np.int64)

    def _check_takes_ids(self) -> None:
        if "input_ids" in self.model.encoder_input_names:
            return
        if self.speech:
            raise RequestError(
                f"model {self.name!r} is a Whisper model: send its audio to "
                "POST /v1/audio/transcriptions"
            )
        raise RequestError(f"model {self.name!r} takes no input_ids")

    def check_length(self, length: int, index: int | None) -> None:
        positions = encoder_positions(self.model.config)
        if positions is not None and length > positions:
            where = f"input {index} has" if index is not None else "the input has"
            raise RequestError(
                f"{where} {length} tokens, more than the model's {positions} positions; "
                "shorten or split it"
            )

    def check_options(self, options: dict[str, Any]) -> None:
        """Refuse unknown generation options and values generate_many refuses, before the
        request joins a batch (a bad request must not fail its batch mates)."""
        unknown = sorted(set(options) - OPTION_NAMES)
        if unknown:
            raise RequestError(
                f"unknown options {unknown}; generation options are generate()'s: "
                f"{', '.join(sorted(OPTION_NAMES))}"
            )
        try:
            self.model.generate_many([], max_batch_size=1, **options)
        except (GenerationError, ValueError, TypeError) as error:
            raise RequestError(f"invalid generation options: {error}") from error

    def decode(self, rows: np.ndarray) -> list[str]:
        assert self.tokenizer is not None  # only requests for text are decoded
        with self.tokenizer_lock:
            return list(self.tokenizer.batch_decode(rows, skip_special_tokens=True))


def _tokenizer_in(folder: Path) -> Any | None:
    """The tokenizer saved in ``folder``; None where there is none or it cannot be loaded
    (such a model is served for ``input_ids`` only)."""
    from onnxmerge.runtime import TextGenerator

    try:
        return TextGenerator.load_tokenizer(folder)
    except (GenerationError, MissingDependencyError):
        return None
