"""One step of greedy search and of beam search as graph nodes.

Each function turns a step's logits and the search state into the next state. It is emitted twice:
once in the main graph after the first decoder step, once in the Loop body after each cached step.
The semantics are those of transformers' ``_sample`` (greedy) and its vectorised ``_beam_search``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxmerge.generator import processors
from onnxmerge.generator.ops import Ops
from onnxmerge.settings import GenerationSettings

# transformers' stand-in for -inf in beam bookkeeping (finite, so sums stay ordered).
_NEG = -1.0e9


@dataclass
class Greedy:
    """Loop state of greedy search; ``tokens`` are the ones the next decoder step reads."""

    tokens: ir.Value  # [rows, 1]
    sequences: ir.Value  # [rows, cur_len]
    unfinished: ir.Value  # [rows] bool
    keep_going: ir.Value  # bool scalar


def greedy_step(
    ops: Ops,
    s: GenerationSettings,
    vocab: int,
    logits: ir.Value,
    sequences: ir.Value,
    unfinished: ir.Value,
    max_length: ir.Value,
    encoder_ids: ir.Value | None,
) -> Greedy:
    """Pick each row's next token from ``logits`` ``[rows, vocab]``; pad rows already finished."""
    scores = ops.op("Cast", logits, to=ir.DataType.FLOAT)
    cur_len = ops.dim(sequences, 1)
    step = processors.StepValues(scores, sequences, cur_len, max_length, encoder_ids)
    scores = processors.apply(ops, s, vocab, step)
    tokens = ops.op("ArgMax", scores, axis=1, keepdims=0)
    eos = s.eos_token_id
    if eos:
        tokens = ops.op("Where", unfinished, tokens, ops.i64(s.pad_token_id))
        unfinished = ops.op("And", unfinished, ops.op("Not", ops.isin(tokens, eos)))
    column = ops.unsqueeze(tokens, 1)
    sequences = ops.op("Concat", sequences, column, axis=1)
    return Greedy(column, sequences, unfinished, ops.any(unfinished))


@dataclass
class Beams:
    """Loop state of beam search, as transformers' ``_beam_search`` keeps it.

    ``running_*`` are the beams still extended; ``sequences``/``scores``/``lengths``/``finished``
    the best finished hypotheses so far (``lengths``: generated tokens of each). ``rows`` says
    which row of the previous cache each running beam continues.
    """

    running: ir.Value  # [batch, beams, cur_len]
    running_scores: ir.Value  # [batch, beams]
    sequences: ir.Value  # [batch, beams, cur_len]
    scores: ir.Value  # [batch, beams]
    lengths: ir.Value  # [batch, beams] int64
    finished: ir.Value  # [batch, beams] bool
    unsatisfied: ir.Value  # [batch, 1] bool
    rows: ir.Value | None = None  # [batch * beams]
    keep_going: ir.Value | None = None  # bool scalar

    def carried(self) -> list[ir.Value]:
        return [
            self.running,
            self.running_scores,
            self.sequences,
            self.scores,
            self.lengths,
            self.finished,
            self.unsatisfied,
        ]


CARRIED_BEAM_TYPES = [
    (ir.DataType.INT64, 3),
    (ir.DataType.FLOAT, 2),
    (ir.DataType.INT64, 3),
    (ir.DataType.FLOAT, 2),
    (ir.DataType.INT64, 2),
    (ir.DataType.BOOL, 2),
    (ir.DataType.BOOL, 2),
]


def pad_value(s: GenerationSettings) -> int:
    """What beam search writes after a hypothesis ends: transformers' ``pad or eos[0]``."""
    if s.eos_token_id is None:
        return -1
    return s.pad_token_id if s.pad_token_id else int(s.eos_token_id[0])


def initial_beams(ops: Ops, s: GenerationSettings, batch: ir.Value, num_beams: int) -> Beams:
    shape = ops.vector(batch, ops.i64(num_beams))
    start = ops.op(
        "ConstantOfShape",
        ops.vector(batch, ops.i64(num_beams), ops.i64(1)),
        value=ir.tensor(np.array([s.decoder_start_token_id], np.int64)),
    )
    first = np.full((1, num_beams), _NEG, np.float32)
    first[0, 0] = 0.0
    running_scores = ops.op("Expand", ops.f32(first), shape)
    scores = ops.op("Expand", ops.f32([[_NEG]]), shape)
    lengths = ops.op("Expand", ops.i64([[0]]), shape)
    finished = ops.op("Expand", ops.const([[False]], np.bool_), shape)
    unsatisfied = ops.op("Expand", ops.const([[True]], np.bool_), ops.vector(batch, ops.i64(1)))
    return Beams(start, running_scores, start, scores, lengths, finished, unsatisfied)


def _gather_beams(ops: Ops, tensor: ir.Value, indices: ir.Value, flat_offset: ir.Value) -> ir.Value:
    """``tensor[b, indices[b, j], ...]`` for ``tensor`` ``[batch, n, ...]`` and ``indices``
    ``[batch, k]``: the rows are flattened and gathered at ``indices + b * n``."""
    flat = ops.op("Reshape", tensor, _flat_shape(ops, tensor))
    return ops.op("Gather", flat, ops.op("Add", indices, flat_offset), axis=0)


def _flat_shape(ops: Ops, tensor: ir.Value) -> ir.Value:
    """[-1, *tensor.shape[2:]] for a rank-2 or rank-3 tensor."""
    rest = ops.op("Shape", tensor, start=2)
    return ops.op("Concat", ops.i64([-1]), rest, axis=0)


def _offsets(ops: Ops, batch: ir.Value, width: int) -> ir.Value:
    """``[batch, 1]``: b * width."""
    starts = ops.op("Range", ops.i64(0), ops.op("Mul", batch, ops.i64(width)), ops.i64(width))
    return ops.unsqueeze(starts, 1)


def beam_step(
    ops: Ops,
    s: GenerationSettings,
    vocab: int,
    num_beams: int,
    logits: ir.Value,
    state: Beams,
    batch: ir.Value,
    max_length: ir.Value,
    encoder_ids: ir.Value | None,
) -> Beams:
    """One step of beam search on ``logits`` ``[batch * beams, vocab]``."""
    eos = s.eos_token_id
    n_eos = len(eos) if eos else 0
    keep = max(2, 1 + n_eos) * num_beams
    lp = float(s.length_penalty)
    prompt_len = s.prompt_length

    cur_len = ops.dim(state.running, 2)
    flat_running = ops.op("Reshape", state.running, ops.vector(ops.i64(-1), cur_len))
    log_probs = ops.op("LogSoftmax", ops.op("Cast", logits, to=ir.DataType.FLOAT), axis=-1)
    step = processors.StepValues(log_probs, flat_running, cur_len, max_length, encoder_ids)
    log_probs = processors.apply(ops, s, vocab, step)
    vocab_dim = ops.dim(log_probs, 1)
    log_probs = ops.op("Reshape", log_probs, ops.vector(batch, ops.i64(num_beams), vocab_dim))
    log_probs = ops.op("Add", log_probs, ops.unsqueeze(state.running_scores, 2))
    log_probs = ops.op("Reshape", log_probs, ops.vector(batch, ops.i64(-1)))

    # c. the best 2k (or more) continuations over all beams of each input
    topk_log_probs, topk_indices = ops.op_multi(
        "TopK", [log_probs, ops.i64([keep])], 2, axis=1, largest=1, sorted=1
    )
    topk_beams = ops.op("Div", topk_indices, vocab_dim)
    topk_ids = ops.op("Mod", topk_indices, vocab_dim)
    beam_offsets = _offsets(ops, batch, num_beams)
    candidates = _gather_beams(ops, state.running, topk_beams, beam_offsets)
    candidates = ops.op("Concat", candidates, ops.unsqueeze(topk_ids, 2), axis=2)
    candidate_rows = ops.op("Add", topk_beams, beam_offsets)

    # d. which candidates end here (eos, or the length limit)
    next_len = ops.op("Add", cur_len, ops.i64(1))
    at_limit = ops.op("GreaterOrEqual", next_len, max_length)
    hits = ops.isin(topk_ids, eos) if eos else ops.op("Equal", topk_ids, ops.i64(-1))
    hits = ops.op("Or", hits, at_limit)
    hits_neg = ops.op("Mul", ops.bool_to_float(hits), ops.f32(_NEG))

    # e. the running beams of the next step
    running_log_probs = ops.op("Add", topk_log_probs, hits_neg)
    running_scores, next_topk = ops.op_multi(
        "TopK", [running_log_probs, ops.i64([num_beams])], 2, axis=1, largest=1, sorted=1
    )
    keep_offsets = _offsets(ops, batch, keep)
    running = _gather_beams(ops, candidates, next_topk, keep_offsets)
    rows = ops.op("GatherElements", candidate_rows, next_topk, axis=1)

    # f. finished hypotheses: the best `num_beams` of the kept ones and the new ones
    top_mask = np.zeros((1, keep), np.bool_)
    top_mask[0, :num_beams] = True
    just_finished = ops.op("And", hits, ops.const(top_mask))
    generated = ops.op("Sub", next_len, ops.i64(prompt_len))
    denominator = _length_penalty(ops, generated, lp)
    finished_scores = ops.op("Div", topk_log_probs, denominator)
    if s.early_stopping is True:
        full = ops.all(state.finished, axis=1, keepdims=True)
        finished_scores = ops.op(
            "Add", finished_scores, ops.op("Mul", ops.bool_to_float(full), ops.f32(_NEG))
        )
    satisfied = ops.bool_to_float(ops.op("Not", state.unsatisfied))
    finished_scores = ops.op("Add", finished_scores, ops.op("Mul", satisfied, ops.f32(_NEG)))
    not_new = ops.bool_to_float(ops.op("Not", just_finished))
    finished_scores = ops.op("Add", finished_scores, ops.op("Mul", not_new, ops.f32(_NEG)))
    merged_scores = ops.op("Concat", state.scores, finished_scores, axis=1)
    scores, chosen = ops.op_multi(
        "TopK", [merged_scores, ops.i64([num_beams])], 2, axis=1, largest=1, sorted=1
    )
    merged_offsets = _offsets(ops, batch, num_beams + keep)
    padded = ops.op(
        "Pad", state.sequences, ops.i64([0, 0, 0, 0, 0, 1]), ops.i64(pad_value(s)), mode="constant"
    )
    sequences = _gather_beams(
        ops, ops.op("Concat", padded, candidates, axis=1), chosen, merged_offsets
    )
    candidate_lengths = ops.op("Expand", generated, ops.op("Shape", topk_ids))
    lengths = ops.op(
        "GatherElements",
        ops.op("Concat", state.lengths, candidate_lengths, axis=1),
        chosen,
        axis=1,
    )
    finished = ops.op(
        "GatherElements", ops.op("Concat", state.finished, just_finished, axis=1), chosen, axis=1
    )

    # g. go on while a running beam can still beat the worst finished one
    if s.early_stopping == "never" and lp > 0.0:
        best_length = ops.op("Sub", max_length, ops.i64(prompt_len))
    else:
        best_length = generated
    best_running = ops.op(
        "Div", ops.slice(running_scores, 0, 1, axis=1), _length_penalty(ops, best_length, lp)
    )
    worst = ops.reduce("ReduceMin", scores, axis=1, keepdims=True)
    worst_finished = ops.op("Where", finished, worst, ops.f32(_NEG))
    improvable = ops.any(ops.op("Greater", best_running, worst_finished), axis=1, keepdims=True)
    unsatisfied = ops.op("And", state.unsatisfied, improvable)
    keep_going = ops.op("And", ops.any(unsatisfied), ops.op("Not", ops.all(hits)))
    if s.early_stopping is True:
        keep_going = ops.op("And", keep_going, ops.op("Not", ops.all(finished)))
    return Beams(
        running,
        running_scores,
        sequences,
        scores,
        lengths,
        finished,
        unsatisfied,
        rows=ops.op("Reshape", rows, ops.i64([-1])),
        keep_going=keep_going,
    )


def _length_penalty(ops: Ops, length: ir.Value, penalty: float) -> ir.Value:
    """``length ** penalty`` as float32, computed in double as Python computes it."""
    as_double = ops.op("Cast", length, to=ir.DataType.DOUBLE)
    powered = ops.op("Pow", as_double, ops.const(penalty, np.float64))
    return ops.op("Cast", powered, to=ir.DataType.FLOAT)


def best_sequences(ops: Ops, state: Beams, prompt_len: int) -> tuple[ir.Value, ir.Value]:
    """The best finished hypothesis of each input, cut to the longest one, and its score."""
    best = ops.squeeze(ops.slice(state.sequences, 0, 1, axis=1), 1)
    longest = ops.reduce("ReduceMax", ops.slice(state.lengths, 0, 1, axis=1))
    end = ops.op("Add", longest, ops.i64(prompt_len))
    sequences = ops.slice(best, 0, end, axis=1)
    score = ops.squeeze(ops.slice(state.scores, 0, 1, axis=1), 1)
    return sequences, score
