"""Logits processors as graph nodes, with the semantics and order of transformers' processors.

Each step hands the processors the next-token ``scores`` (``[rows, vocab]`` float32), the
``sequences`` so far (``[rows, cur_len]`` int64, decoder start included) and ``cur_len``. Settings
are fixed when the graph is built; ``max_length`` (forced eos) is a graph value because it comes
from the ``max_new_tokens`` input.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxmerge.errors import GenerationError
from onnxmerge.generator._ops import Ops
from onnxmerge.settings import GenerationSettings

_NEG_INF = float("-inf")
_END = np.iinfo(np.int64).max


@dataclass
class StepValues:
    scores: ir.Value
    sequences: ir.Value
    cur_len: ir.Value
    max_length: ir.Value
    encoder_ids: ir.Value | None


def check_supported(settings: GenerationSettings, given: Collection[str] = ()) -> None:
    """Refuse settings whose processors the graph does not implement.

    ``given`` names the settings passed as ``generation_config=``, so the message blames them
    rather than the model's own generation config.
    """
    if settings.encoder_repetition_penalty != 1.0:
        key = "encoder_repetition_penalty"
        where, fix = (
            ("given in generation_config=", "leave it out")
            if key in given
            else ("set in the model's generation config", "override it with generation_config=")
        )
        raise GenerationError(
            f"{key}={settings.encoder_repetition_penalty} is {where}; the generator graph does "
            f"not implement it. Generate with onnxmerge.Seq2SeqModel instead, or {fix}"
        )


def apply(ops: Ops, s: GenerationSettings, vocab: int, step: StepValues) -> ir.Value:
    """The processed scores; processors that are off add no nodes."""
    scores = step.scores
    eos = list(s.eos_token_id or [])
    valid_eos = [t for t in eos if 0 <= t < vocab]
    if s.repetition_penalty != 1.0:
        scores = _repetition_penalty(ops, scores, step.sequences, s.repetition_penalty)
    if s.no_repeat_ngram_size > 0:
        scores = _no_repeat_ngram(ops, scores, step, s.no_repeat_ngram_size)
    if s.encoder_no_repeat_ngram_size > 0 and step.encoder_ids is not None:
        scores = _encoder_no_repeat_ngram(
            ops, scores, step, step.encoder_ids, s.encoder_no_repeat_ngram_size
        )
    if s.bad_words_ids is not None:
        scores = _bad_words(ops, scores, step, s.bad_words_ids, eos, vocab)
    if eos and s.min_length > 0:
        when = ops.op("Less", step.cur_len, ops.i64(s.min_length))
        scores = ban_tokens(ops, scores, valid_eos, when)
    if eos and s.min_new_tokens is not None and s.min_new_tokens > 0:
        new = ops.op("Sub", step.cur_len, ops.i64(s.prompt_length))
        scores = ban_tokens(ops, scores, valid_eos, ops.op("Less", new, ops.i64(s.min_new_tokens)))
    if s.forced_bos_token_id is not None:
        when = ops.op("Equal", step.cur_len, ops.i64(1))
        scores = _force(ops, scores, [int(s.forced_bos_token_id)], vocab, when)
    if s.forced_eos_token_id is not None:
        last = ops.op("Sub", step.max_length, ops.i64(1))
        when = ops.op("Equal", step.cur_len, last)
        scores = _force(ops, scores, s.forced_eos_token_id, vocab, when)
    if s.suppress_tokens is not None:
        scores = ban_tokens(ops, scores, [t for t in s.suppress_tokens if 0 <= t < vocab])
    if s.begin_suppress_tokens is not None:
        tokens = [t for t in s.begin_suppress_tokens if 0 <= t < vocab]
        begin = ops.i64(s.begin_suppress_index)
        scores = ban_tokens(ops, scores, tokens, ops.op("Equal", step.cur_len, begin))
    return scores


# -- building blocks --------------------------------------------------------------------------


def ban_tokens(
    ops: Ops, scores: ir.Value, tokens: list[int], when: ir.Value | None = None
) -> ir.Value:
    """-inf at fixed token ids in every row (only where the scalar ``when`` holds)."""
    if not tokens:
        return scores
    shape = ops.vector(ops.dim(scores, 0), ops.i64(len(tokens)))
    indices = ops.op("Expand", ops.i64([tokens]), shape)
    updates = ops.op("Expand", ops.f32([[_NEG_INF]]), shape)
    banned = ops.op("ScatterElements", scores, indices, updates, axis=1)
    return banned if when is None else ops.op("Where", when, banned, scores)


def ban_per_row(ops: Ops, scores: ir.Value, tokens: ir.Value, active: ir.Value) -> ir.Value:
    """-inf at ``tokens[r, j]`` of row r wherever ``active[r, j]`` (both ``[rows, n]``, n may be 0).

    Inactive entries point at an extra column that is cut off afterwards, so one scatter serves
    every row whatever the number of hits.
    """
    vocab = ops.dim(scores, 1)
    indices = ops.op("Where", active, tokens, vocab)
    spare = ops.op(
        "ConstantOfShape",
        ops.vector(ops.dim(scores, 0), ops.i64(1)),
        value=ir.tensor(np.zeros(1, np.float32)),
    )
    widened = ops.op("Concat", scores, spare, axis=1)
    updates = ops.op("Expand", ops.f32(_NEG_INF), ops.op("Shape", indices))
    scattered = ops.op("ScatterElements", widened, indices, updates, axis=1)
    return ops.slice(scattered, 0, vocab, axis=1)


def _vocab_mask(ops: Ops, scores: ir.Value, tokens: list[int]) -> ir.Value:
    """``[vocab]`` bool: which token ids are in ``tokens``."""
    ids = ops.op("Range", ops.i64(0), ops.dim(scores, 1), ops.i64(1))
    return ops.isin(ids, tokens)


def _force(ops: Ops, scores: ir.Value, tokens: list[int], vocab: int, when: ir.Value) -> ir.Value:
    """Every score -inf except ``tokens`` (0), on the step where the scalar ``when`` holds.

    The row is a fill plus a scatter of a few ids: it runs every step, so no vocabulary-wide
    comparisons (they cost the loop more than the Python runtime's whole search step).
    """
    shape = ops.vector(ops.i64(1), ops.dim(scores, 1))
    row = ops.op("ConstantOfShape", shape, value=ir.tensor(np.array([_NEG_INF], np.float32)))
    kept = sorted({t for t in tokens if 0 <= t < vocab})
    if kept:
        zeros = ops.f32([[0.0] * len(kept)])
        row = ops.op("ScatterElements", row, ops.i64([kept]), zeros, axis=1)
    return ops.op("Where", when, row, scores)


def _repetition_penalty(
    ops: Ops, scores: ir.Value, sequences: ir.Value, penalty: float
) -> ir.Value:
    picked = ops.op("GatherElements", scores, sequences, axis=1)
    penalized = ops.op(
        "Where",
        ops.op("Less", picked, ops.f32(0.0)),
        ops.op("Mul", picked, ops.f32(penalty)),
        ops.op("Div", picked, ops.f32(penalty)),
    )
    # Repeated tokens write the same value twice, so the scatter's order does not matter.
    return ops.op("ScatterElements", scores, sequences, penalized, axis=1)


def _last_tokens(ops: Ops, step: StepValues, count: int) -> list[ir.Value]:
    """The last ``count`` tokens of each row, ``[rows, 1]`` each, oldest first.

    Positions before the start clamp to 0; callers ignore the result on such early steps.
    """
    columns = []
    for k in range(count):
        position = ops.op("Sub", step.cur_len, ops.i64(count - k))
        position = ops.op("Max", position, ops.i64(0))
        columns.append(ops.op("Gather", step.sequences, ops.unsqueeze(position, 0), axis=1))
    return columns


def _windows(ops: Ops, tokens: ir.Value, n: int) -> tuple[list[ir.Value], ir.Value]:
    """Every length-n window of ``tokens`` ``[rows, L]``: n-1 columns of heads and the last token.

    Each piece is ``[rows, L - n + 1]`` (empty when L < n).
    """
    heads = [ops.slice(tokens, k, -(n - 1 - k), axis=1) for k in range(n - 1)]
    return heads, ops.slice(tokens, n - 1, _END, axis=1)


def _matching(ops: Ops, heads: list[ir.Value], prefix: list[ir.Value], like: ir.Value) -> ir.Value:
    if not heads:
        return ops.op("Equal", like, like)
    match = ops.op("Equal", heads[0], prefix[0])
    for head, token in zip(heads[1:], prefix[1:], strict=True):
        match = ops.op("And", match, ops.op("Equal", head, token))
    return match


def _no_repeat_ngram(ops: Ops, scores: ir.Value, step: StepValues, n: int) -> ir.Value:
    heads, last = _windows(ops, step.sequences, n)
    # Windows are empty until the row holds n tokens, so early steps ban nothing.
    match = _matching(ops, heads, _last_tokens(ops, step, n - 1), last)
    return ban_per_row(ops, scores, last, match)


def _encoder_no_repeat_ngram(
    ops: Ops, scores: ir.Value, step: StepValues, encoder_ids: ir.Value, n: int
) -> ir.Value:
    heads, last = _windows(ops, encoder_ids, n)
    match = _matching(ops, heads, _last_tokens(ops, step, n - 1), last)
    ready = ops.op("GreaterOrEqual", step.cur_len, ops.i64(n - 1))
    return ban_per_row(ops, scores, last, ops.op("And", match, ready))


def _bad_words(
    ops: Ops,
    scores: ir.Value,
    step: StepValues,
    words: list[list[int]],
    eos: list[int],
    vocab: int,
) -> ir.Value:
    words = [[int(t) for t in w] for w in words]
    # transformers drops a bad word equal to a single eos token.
    words = [w for w in words if not (len(w) == 1 and w[0] in eos)]
    single = [w[0] for w in words if len(w) == 1 and 0 <= w[0] < vocab]
    scores = ban_tokens(ops, scores, sorted(set(single)))
    for word in words:
        if len(word) == 1 or not 0 <= word[-1] < vocab:
            continue
        prefix, last = word[:-1], word[-1]
        m = len(prefix)
        # Left-pad with -1 so the last m columns exist on every step.
        pad = ops.op(
            "ConstantOfShape",
            ops.vector(ops.dim(step.sequences, 0), ops.i64(m)),
            value=ir.tensor(np.full(1, -1, np.int64)),
        )
        padded = ops.op("Concat", pad, step.sequences, axis=1)
        tail = ops.slice(padded, -m, _END, axis=1)
        match = ops.all(ops.op("Equal", tail, ops.i64([prefix])), axis=1)
        match = ops.op("And", match, ops.op("Greater", step.cur_len, ops.i64(m)))
        hit = ops.op(
            "And", ops.unsqueeze(match, 1), ops.unsqueeze(_vocab_mask(ops, scores, [last]), 0)
        )
        scores = ops.op("Where", hit, ops.f32(_NEG_INF), scores)
    return scores
