"""Logits processors in numpy, with the semantics of transformers' classes of the same role.

Each processor is called as ``processor(input_ids, scores) -> scores`` where ``input_ids`` is the
``[rows, cur_len]`` int64 array of tokens so far (decoder start included) and ``scores`` the
``[rows, vocab]`` float32 array for the next token. Processors may modify ``scores`` in place and
return it. They are applied in the order :func:`build_processors` lists them, which is the order
transformers applies its own.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from onnxmerge._ort import bind_output_into, open_session, session_options
from onnxmerge._wire import field
from onnxmerge.errors import GenerationError

if TYPE_CHECKING:
    from onnxmerge.settings import GenerationSettings

NEG_INF = np.float32(-np.inf)
# Encoder ids per input: ``[batch, seq]``, or one sequence per input, each of its own length.
TokenRows = np.ndarray | Sequence[np.ndarray] | Sequence[Sequence[int]]


class LogitsProcessor(Protocol):
    """``keeps_bounds = True`` on a processor says it maps each score through a non-decreasing
    function of that score alone (given the tokens so far): bounds on scores stay bounds.
    ``exact_columns(input_ids)``, where a processor has it, names the scores it reads as a whole
    at this step (a slice, or None): long-form Whisper's timestamp rule reads the timestamps no
    mask removes; with those exact, it keeps bounds on the others.
    ``masks_only(input_ids)``, where a processor has it, says whether, called with these
    ``input_ids``, it only sets some scores to -inf and leaves the others as they are."""

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray: ...


class _Mask:
    """A processor that only ever sets scores to -inf."""

    keeps_bounds = True

    def masks_only(self, input_ids: np.ndarray) -> bool:
        """Whether, called with ``input_ids``, this processor only sets scores to -inf."""
        return True


def _token_array(tokens: Iterable[int]) -> np.ndarray:
    return np.asarray(list(tokens), dtype=np.int64).reshape(-1)


def _valid_tokens(tokens: np.ndarray, vocab: int) -> np.ndarray:
    # transformers builds a vocabulary mask with isin, so ids outside the vocabulary are ignored.
    return tokens[(tokens >= 0) & (tokens < vocab)]


def _positive(name: str, value: float, context: str = "") -> float:
    """``value``, or a GenerationError naming the setting when it is not above 0."""
    if not value > 0:
        raise GenerationError(f"{name} must be > 0{context}, got {value}")
    return value


def _penalize(scores: np.ndarray, rows: np.ndarray, ids: np.ndarray, penalty: float) -> np.ndarray:
    """Divide positive (multiply negative) scores at (``rows``, ``ids``), each token once
    however often it is listed: every score is read before any is written."""
    picked = scores[rows, ids]
    penalized = np.where(picked < 0, picked * penalty, picked / penalty)
    scores[rows, ids] = penalized.astype(scores.dtype, copy=False)
    return scores


def _token_rows(encoder_input_ids: TokenRows) -> list[np.ndarray]:
    """Each input's encoder ids as a 1-D array of its own length: a ``[batch, seq]`` array's
    rows, or rows of different lengths (``generate_many``'s inputs, without their padding)."""
    return [np.asarray(row, dtype=np.int64).reshape(-1) for row in encoder_input_ids]


class RepetitionPenalty:
    """Divide positive (multiply negative) scores of tokens already in the row by ``penalty``."""

    keeps_bounds = True

    def __init__(self, penalty: float):
        self.penalty = float(_positive("repetition_penalty", penalty))

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        return _penalize(scores, np.arange(input_ids.shape[0])[:, None], input_ids, self.penalty)


class NoRepeatNGram(_Mask):
    """Ban every token that would repeat an n-gram already present in the row."""

    def __init__(self, ngram_size: int):
        self.ngram_size = int(_positive("no_repeat_ngram_size", ngram_size))

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        n = self.ngram_size
        cur_len = input_ids.shape[1]
        if cur_len + 1 < n:
            return scores
        for row, tokens in enumerate(input_ids.tolist()):
            prefix = tuple(tokens[cur_len + 1 - n :])
            banned = [
                tokens[start + n - 1]
                for start in range(cur_len - n + 1)
                if tuple(tokens[start : start + n - 1]) == prefix
            ]
            if banned:
                scores[row, banned] = NEG_INF
        return scores


class EncoderRepetitionPenalty:
    """Raise the scores of tokens present in the encoder's ``input_ids`` (penalty < 1 lowers them).

    As in transformers, the encoder rows pair with the first score rows only.
    ``encoder_input_ids``: ``[batch, seq]``, or one sequence per input, each of its own length.
    """

    keeps_bounds = True
    by_row = True

    def __init__(self, penalty: float, encoder_input_ids: TokenRows):
        self.penalty = 1 / float(_positive("encoder_repetition_penalty", penalty))
        tokens = _token_rows(encoder_input_ids)
        self.rows = np.repeat(np.arange(len(tokens)), [t.size for t in tokens])
        self.ids = np.concatenate(tokens) if tokens else np.empty(0, np.int64)

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        paired = self.rows < scores.shape[0]
        return _penalize(scores, self.rows[paired], self.ids[paired], self.penalty)


class EncoderNoRepeatNGram(_Mask):
    """Ban tokens that would repeat an n-gram of the row's encoder ``input_ids``
    (``[batch, seq]``, or one sequence per input, each of its own length)."""

    by_row = True

    def __init__(self, ngram_size: int, encoder_input_ids: TokenRows):
        self.ngram_size = int(_positive("encoder_no_repeat_ngram_size", ngram_size))
        rows = _token_rows(encoder_input_ids)
        self.batch_size = len(rows)
        self.ngrams: list[dict[tuple[int, ...], list[int]]] = []
        for tokens in (row.tolist() for row in rows):
            table: dict[tuple[int, ...], list[int]] = {}
            for start in range(len(tokens) - ngram_size + 1):
                gram = tokens[start : start + ngram_size]
                table.setdefault(tuple(gram[:-1]), []).append(gram[-1])
            self.ngrams.append(table)

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        per_input = scores.shape[0] // self.batch_size
        cur_len = input_ids.shape[1]
        start = cur_len + 1 - self.ngram_size
        for row, tokens in enumerate(input_ids.tolist()):
            # A negative start slices from the end, as transformers' tensor slicing does.
            banned = self.ngrams[row // per_input].get(tuple(tokens[start:cur_len]), [])
            if banned:
                scores[row, banned] = NEG_INF
        return scores


class NoBadWords(_Mask):
    """Ban single tokens always, and the last token of a multi-token sequence after its prefix.

    A bad word equal to a single eos token is dropped, as transformers does.
    """

    def __init__(self, bad_words_ids: Sequence[Sequence[int]], eos_token_ids: Sequence[int] = ()):
        eos = [[int(t)] for t in eos_token_ids]
        words = [list(map(int, w)) for w in bad_words_ids]
        words = [w for w in words if w not in eos]
        self.single = _token_array(w[0] for w in words if len(w) == 1)
        self.multi = [(np.asarray(w[:-1], dtype=np.int64), w[-1]) for w in words if len(w) > 1]

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if self.single.size:
            scores[:, self.single] = NEG_INF
        cur_len = input_ids.shape[1]
        for prefix, last in self.multi:
            if len(prefix) + 1 > cur_len:
                continue
            matching = np.all(input_ids[:, cur_len - len(prefix) :] == prefix, axis=1)
            scores[matching, last] = NEG_INF
        return scores


class MinLength(_Mask):
    """Forbid eos while the sequence (decoder start included) is shorter than ``min_length``."""

    def __init__(self, min_length: int, eos_token_ids: Sequence[int]):
        self.min_length = int(min_length)
        self.eos = _token_array(eos_token_ids)

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if input_ids.shape[1] < self.min_length:
            scores[:, _valid_tokens(self.eos, scores.shape[1])] = NEG_INF
        return scores


class MinNewTokens(_Mask):
    """Forbid eos until ``min_new_tokens`` tokens follow the prompt of ``prompt_length`` tokens."""

    def __init__(self, prompt_length: int, min_new_tokens: int, eos_token_ids: Sequence[int]):
        self.prompt_length = int(prompt_length)
        self.min_new_tokens = int(min_new_tokens)
        self.eos = _token_array(eos_token_ids)

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if input_ids.shape[1] - self.prompt_length < self.min_new_tokens:
            scores[:, _valid_tokens(self.eos, scores.shape[1])] = NEG_INF
        return scores


class ForcedBOS:
    """Force ``token_id`` as the first generated token (when the sequence holds one token)."""

    keeps_bounds = True

    def __init__(self, token_id: int):
        self.token_id = int(token_id)

    def masks_only(self, input_ids: np.ndarray) -> bool:
        """Whether, called with ``input_ids``, this processor only sets scores to -inf."""
        return input_ids.shape[1] != 1  # a step that leaves the scores alone

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if input_ids.shape[1] == 1:
            scores.fill(NEG_INF)
            scores[:, self.token_id] = 0
        return scores


class ForcedEOS:
    """Force eos as the last token when the sequence reaches ``max_length - 1``."""

    keeps_bounds = True

    def __init__(self, max_length: int, eos_token_ids: Sequence[int]):
        self.max_length = int(max_length)
        self.eos = _token_array(eos_token_ids)
        if (self.eos < 0).any():
            raise GenerationError(
                f"forced_eos_token_id must be non-negative, got {self.eos.tolist()}"
            )

    def masks_only(self, input_ids: np.ndarray) -> bool:
        """Whether, called with ``input_ids``, this processor only sets scores to -inf."""
        return input_ids.shape[1] != self.max_length - 1  # a step that leaves the scores alone

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if input_ids.shape[1] == self.max_length - 1:
            scores.fill(NEG_INF)
            scores[:, self.eos] = 0
        return scores


class SuppressTokens(_Mask):
    """Set the scores of ``tokens`` to -inf at every step."""

    def __init__(self, tokens: Iterable[int]):
        self.tokens = _token_array(tokens)

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        scores[:, _valid_tokens(self.tokens, scores.shape[1])] = NEG_INF
        return scores


class SuppressTokensAtBegin(_Mask):
    """Set the scores of ``tokens`` to -inf when the sequence is ``begin_index`` long."""

    def __init__(self, tokens: Iterable[int], begin_index: int):
        self.tokens = _token_array(tokens)
        self.begin_index = int(begin_index)

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if input_ids.shape[1] == self.begin_index:
            scores[:, _valid_tokens(self.tokens, scores.shape[1])] = NEG_INF
        return scores


class Temperature:
    """Divides the scores by ``temperature`` before sampling, as transformers'
    ``TemperatureLogitsWarper``."""

    def __init__(self, temperature: float):
        self.temperature = float(_positive("temperature", temperature, " when sampling"))

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        scores /= np.float32(self.temperature)
        return scores


class TopK:
    """Keep the ``top_k`` highest scores (ties with the k-th included), -inf elsewhere."""

    def __init__(self, top_k: int, min_tokens_to_keep: int = 1):
        self.top_k = max(int(_positive("top_k", top_k)), int(min_tokens_to_keep))

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        k = min(self.top_k, scores.shape[1])
        kth = np.partition(scores, -k, axis=1)[:, -k, None]
        scores[scores < kth] = NEG_INF
        return scores


class TopP:
    """Nucleus filtering: drop the least likely tokens whose total probability is <= 1 - top_p."""

    def __init__(self, top_p: float, min_tokens_to_keep: int = 1):
        if not 0 <= top_p <= 1:
            raise GenerationError(f"top_p must be in [0, 1], got {top_p}")
        self.top_p = float(top_p)
        self.min_tokens_to_keep = int(min_tokens_to_keep)

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        order = np.argsort(scores, axis=1, kind="stable")
        sorted_scores = np.take_along_axis(scores, order, axis=1)
        cumulative = np.cumsum(softmax(sorted_scores), axis=1, dtype=np.float32)
        remove_sorted = cumulative <= np.float32(1 - self.top_p)
        remove_sorted[:, -self.min_tokens_to_keep :] = False
        remove = np.zeros_like(remove_sorted)
        np.put_along_axis(remove, order, remove_sorted, axis=1)
        scores[remove] = NEG_INF
        return scores


def softmax(scores: np.ndarray) -> np.ndarray:
    """Probabilities along the last axis, computed from the shifted scores so none overflows."""
    exp = scores - scores.max(axis=-1, keepdims=True)
    np.exp(exp, out=exp)
    exp /= exp.sum(axis=-1, keepdims=True)
    return exp


def log_softmax(scores: np.ndarray, *, in_place: bool = False) -> np.ndarray:
    """Log-probabilities over the last axis.

    float32 scores go through onnxruntime's ``LogSoftmax`` where onnxruntime is installed: on a
    beam step's ``[32, 59514]`` it takes a third of numpy's time, and it gives torch's values
    bit for bit far more often (97% of them against 21%). Elsewhere, :func:`numpy_log_softmax`.
    ``in_place=True`` lets onnxruntime write them over ``scores`` where those are a contiguous
    array it may write into (the same values: the kernel reads each row before writing it), and
    a beam step holds one ``[rows, vocab]`` array less.
    """
    kernel = _log_softmax_kernel() if scores.dtype == np.float32 and scores.size else None
    if kernel is None:
        return numpy_log_softmax(scores)
    rows = np.ascontiguousarray(scores.reshape(-1, scores.shape[-1]))
    if not (in_place and rows.flags.writeable and np.shares_memory(rows, scores)):
        return kernel.run(None, {"scores": rows})[0].reshape(scores.shape)
    binding = kernel.io_binding()
    binding.bind_cpu_input("scores", rows)
    bind_output_into(binding, "log_probs", rows)
    kernel.run_with_iobinding(binding)
    return scores


def numpy_log_softmax(scores: np.ndarray) -> np.ndarray:
    """``shifted - log(sum(exp(shifted)))`` with ``shifted = scores - max``, over the last axis."""
    rows = scores.reshape(-1, scores.shape[-1])
    out = np.empty(rows.shape, dtype=rows.dtype)
    scratch = np.empty(rows.shape[1], dtype=rows.dtype)
    # A row at a time, its passes stay in cache. Each value goes through the same operations as
    # over the whole array.
    for row, shifted in zip(rows, out, strict=True):
        np.subtract(row, row.max(), out=shifted)
        shifted -= np.log(np.exp(shifted, out=scratch).sum())
    return out.reshape(scores.shape)


def _log_softmax_model() -> bytes:
    """``LogSoftmax(axis=-1)`` over ``[rows, vocab]`` float32 (opset 13, IR version 8), written
    field by field (``onnx.proto``'s numbers): the runtime imports no protobuf."""
    f = field

    def value(name: str) -> bytes:
        dims = b"".join(f(1, f(2, dim)) for dim in ("rows", "vocab"))  # shape.dim.dim_param
        return f(1, name) + f(2, f(1, f(1, 1) + f(2, dims)))  # type.tensor_type: FLOAT

    axis = f(1, "axis") + f(3, -1) + f(20, 2)  # an INT attribute
    node = f(1, "scores") + f(2, "log_probs") + f(4, "LogSoftmax") + f(5, axis)
    graph = f(1, node) + f(2, "log_softmax") + f(11, value("scores")) + f(12, value("log_probs"))
    return f(1, 8) + f(7, graph) + f(8, f(1, "") + f(2, 13))


@functools.cache
def _log_softmax_kernel() -> Any:
    """A session of one ``LogSoftmax`` over ``[rows, vocab]`` float32, or None without
    onnxruntime. Two threads that do not spin, since it runs between the model's own runs: on 2
    cores, 1.4 ms against 2.2 ms with one thread for 64 rows of 59514."""
    if importlib.util.find_spec("onnxruntime") is None:
        return None
    return open_session(_log_softmax_model(), session_options(threads=2, spinning=False))


class ProcessorList(list):
    """Apply processors in order."""

    @property
    def keeps_bounds(self) -> bool:
        """Whether every processor keeps each row's largest score the largest (the greedy head's
        screening stays exact)."""
        return all(getattr(processor, "keeps_bounds", False) for processor in self)

    @property
    def rows_may_drop(self) -> bool:
        """Whether a search may drop rows from its batch: no processor pairs its own state
        with the batch's rows by position."""
        return not any(getattr(processor, "by_row", False) for processor in self)

    def masks_only(self, input_ids: np.ndarray) -> bool:
        """Whether, called with ``input_ids``, these processors only set scores to -inf."""
        return all(
            getattr(processor, "masks_only", lambda ids: False)(input_ids) for processor in self
        )

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


def build_processors(
    settings: GenerationSettings,
    encoder_input_ids: TokenRows | None = None,
) -> ProcessorList:
    """The processors transformers would build for ``settings``, in transformers' order.

    ``encoder_input_ids`` (``[batch, seq]``, or one sequence per input of its own length) feed
    the encoder-side processors; without them those settings are ignored, as transformers
    ignores them.
    """
    s = settings
    eos = s.eos_token_id
    processors = ProcessorList()
    if s.encoder_repetition_penalty != 1.0 and encoder_input_ids is not None:
        processors.append(EncoderRepetitionPenalty(s.encoder_repetition_penalty, encoder_input_ids))
    if s.repetition_penalty != 1.0:
        processors.append(RepetitionPenalty(s.repetition_penalty))
    if s.no_repeat_ngram_size > 0:
        processors.append(NoRepeatNGram(s.no_repeat_ngram_size))
    if s.encoder_no_repeat_ngram_size > 0 and encoder_input_ids is not None:
        processors.append(EncoderNoRepeatNGram(s.encoder_no_repeat_ngram_size, encoder_input_ids))
    if s.bad_words_ids is not None:
        processors.append(NoBadWords(s.bad_words_ids, eos or ()))
    if eos is not None and s.min_length > 0:
        processors.append(MinLength(s.min_length, eos))
    if eos is not None and s.min_new_tokens is not None and s.min_new_tokens > 0:
        processors.append(MinNewTokens(s.prompt_length, s.min_new_tokens, eos))
    if s.forced_bos_token_id is not None:
        processors.append(ForcedBOS(s.forced_bos_token_id))
    if s.forced_eos_token_id is not None:
        processors.append(ForcedEOS(s.max_length, s.forced_eos_token_id))
    if s.suppress_tokens is not None:
        processors.append(SuppressTokens(s.suppress_tokens))
    if s.begin_suppress_tokens is not None:
        processors.append(SuppressTokensAtBegin(s.begin_suppress_tokens, s.begin_suppress_index))
    if s.do_sample:
        # Beam sampling keeps one more token than there are eos tokens, so a beam can continue.
        keep = (len(eos) + 1 if eos is not None else 2) if s.num_beams > 1 else 1
        if s.temperature != 1.0:
            processors.append(Temperature(s.temperature))
        if s.top_k is not None and s.top_k != 0:
            processors.append(TopK(s.top_k, keep))
        if s.top_p < 1.0:
            processors.append(TopP(s.top_p, keep))
    return processors


__all__ = [
    "NEG_INF",
    "LogitsProcessor",
    "RepetitionPenalty",
    "NoRepeatNGram",
    "EncoderRepetitionPenalty",
    "EncoderNoRepeatNGram",
    "NoBadWords",
    "MinLength",
    "MinNewTokens",
    "ForcedBOS",
    "ForcedEOS",
    "SuppressTokens",
    "SuppressTokensAtBegin",
    "Temperature",
    "TopK",
    "TopP",
    "softmax",
    "log_softmax",
    "numpy_log_softmax",
    "ProcessorList",
    "build_processors",
]
