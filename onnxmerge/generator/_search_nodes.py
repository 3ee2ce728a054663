"""One step of greedy search and of beam search as graph nodes.

Each function turns a step's logits and the search state into the next state. It is emitted twice:
once in the main graph after the first decoder step, once in the Loop body after each cached step.
The semantics are those of transformers' ``_sample`` (greedy) and its vectorised ``_beam_search``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx_ir as ir

from onnxmerge.generator import _processor_nodes as processors
from onnxmerge.generator._ops import Ops
from onnxmerge.settings import GenerationSettings

# transformers' stand-in for -inf in beam bookkeeping (finite, so sums stay ordered).
_NEG = -1.0e9


@dataclass(frozen=True)
class Search:
    """What every step of one search reads besides its logits and state."""

    settings: GenerationSettings
    vocab: int
    max_length: ir.Value  # int64 scalar: prompt plus max_new_tokens
    encoder_ids: ir.Value | None  # [rows, seq], for the encoder-side processors
    batch: ir.Value | None = None  # int64 scalar: inputs (beam search)
    num_beams: int = 1

    @property
    def beam_batch(self) -> ir.Value:
        """``batch``, which beam search reads and greedy search may leave out."""
        if self.batch is None:
            raise ValueError("beam search needs the batch size: Search.batch is None")
        return self.batch

    @property
    def candidates(self) -> int:
        """Continuations kept per input each beam step: enough to survive every eos hit."""
        eos = self.settings.eos_token_id
        return max(2, 1 + (len(eos) if eos else 0)) * self.num_beams


@dataclass
class Greedy:
    """Loop state of greedy search; ``tokens`` are the ones the next decoder step reads."""

    tokens: ir.Value  # [rows, 1]
    sequences: ir.Value  # [rows, cur_len]
    unfinished: ir.Value  # [rows] bool
    keep_going: ir.Value  # bool scalar


def greedy_step(
    ops: Ops, search: Search, logits: ir.Value, sequences: ir.Value, unfinished: ir.Value
) -> Greedy:
    """Pick each row's next token from ``logits`` ``[rows, vocab]``; pad rows already finished."""
    s = search.settings
    scores = ops.op("Cast", logits, to=ir.DataType.FLOAT)
    cur_len = ops.dim(sequences, 1)
    step = processors.StepValues(scores, sequences, cur_len, search.max_length, search.encoder_ids)
    scores = processors.apply(ops, s, search.vocab, step)
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


def initial_beams(
    ops: Ops, s: GenerationSettings, batch: ir.Value, num_beams: int, prompt: ir.Value
) -> Beams:
    """Every beam of an input starts from its decoder prompt (``[batch, prompt length]``)."""
    shape = ops.vector(batch, ops.i64(num_beams))
    start = ops.op(
        "Expand", ops.unsqueeze(prompt, 1), ops.vector(batch, ops.i64(num_beams), ops.i64(1))
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


@dataclass(frozen=True)
class _Candidates:
    """The best continuations of one step over all beams of each input, ``[batch, keep]``."""

    log_probs: ir.Value
    ids: ir.Value  # the token each one appends
    sequences: ir.Value  # [batch, keep, cur_len + 1]
    rows: ir.Value  # the cache row each one continues
    hits: ir.Value  # bool: it ends here (eos, or the length limit)
    next_len: ir.Value  # int64 scalar: cur_len + 1


@dataclass(frozen=True)
class _NewlyFinished:
    """The candidates that finish here, as finished hypotheses."""

    flags: ir.Value  # [batch, keep] bool: an eos hit among the top num_beams
    scores: ir.Value  # [batch, keep]: length-penalised score; _NEG where not finished here
    generated: ir.Value  # int64 scalar: tokens generated after this step


def beam_step(ops: Ops, search: Search, logits: ir.Value, state: Beams) -> Beams:
    """One step of beam search on ``logits`` ``[batch * beams, vocab]``.

    Each named step (transformers' steps c-g) returns the state with its own fields replaced;
    later steps read the fields earlier ones replaced.
    """
    cur_len = ops.dim(state.running, 2)
    log_probs, vocab_dim = _beam_log_probs(ops, search, logits, state, cur_len)
    candidates = _top_candidates(ops, search, state, log_probs, vocab_dim, cur_len)
    updated = _keep_running(ops, search, state, candidates)
    new = _newly_finished(ops, search, state, candidates)
    updated = _keep_finished(ops, search, updated, candidates, new)
    updated = _stop_test(ops, search, updated, candidates, new.generated)
    return replace(updated, rows=ops.op("Reshape", updated.rows, ops.i64([-1])))


def _beam_log_probs(
    ops: Ops, search: Search, logits: ir.Value, state: Beams, cur_len: ir.Value
) -> tuple[ir.Value, ir.Value]:
    """Processed log-probabilities plus each beam's score, ``[batch, beams * vocab]``, and the
    vocabulary size as a graph value."""
    flat_running = ops.op("Reshape", state.running, ops.vector(ops.i64(-1), cur_len))
    log_probs = ops.op("LogSoftmax", ops.op("Cast", logits, to=ir.DataType.FLOAT), axis=-1)
    step = processors.StepValues(
        log_probs, flat_running, cur_len, search.max_length, search.encoder_ids
    )
    log_probs = processors.apply(ops, search.settings, search.vocab, step)
    vocab_dim = ops.dim(log_probs, 1)
    per_beam = ops.vector(search.beam_batch, ops.i64(search.num_beams), vocab_dim)
    log_probs = ops.op("Reshape", log_probs, per_beam)
    log_probs = ops.op("Add", log_probs, ops.unsqueeze(state.running_scores, 2))
    return ops.op("Reshape", log_probs, ops.vector(search.beam_batch, ops.i64(-1))), vocab_dim


def _top_candidates(
    ops: Ops,
    search: Search,
    state: Beams,
    log_probs: ir.Value,
    vocab_dim: ir.Value,
    cur_len: ir.Value,
) -> _Candidates:
    """Steps c (the best continuations) and d (which of them end here)."""
    topk_log_probs, topk_indices = ops.op_multi(
        "TopK", [log_probs, ops.i64([search.candidates])], 2, axis=1, largest=1, sorted=1
    )
    topk_beams = ops.op("Div", topk_indices, vocab_dim)
    topk_ids = ops.op("Mod", topk_indices, vocab_dim)
    beam_offsets = _offsets(ops, search.beam_batch, search.num_beams)
    sequences = _gather_beams(ops, state.running, topk_beams, beam_offsets)
    sequences = ops.op("Concat", sequences, ops.unsqueeze(topk_ids, 2), axis=2)
    rows = ops.op("Add", topk_beams, beam_offsets)
    next_len = ops.op("Add", cur_len, ops.i64(1))
    at_limit = ops.op("GreaterOrEqual", next_len, search.max_length)
    eos = search.settings.eos_token_id
    hits = ops.isin(topk_ids, eos) if eos else ops.op("Equal", topk_ids, ops.i64(-1))
    hits = ops.op("Or", hits, at_limit)
    return _Candidates(topk_log_probs, topk_ids, sequences, rows, hits, next_len)


def _keep_running(ops: Ops, search: Search, state: Beams, candidates: _Candidates) -> Beams:
    """Step e: the best candidates that do not end here run on."""
    hits_neg = ops.op("Mul", ops.bool_to_float(candidates.hits), ops.f32(_NEG))
    running_log_probs = ops.op("Add", candidates.log_probs, hits_neg)
    running_scores, next_topk = ops.op_multi(
        "TopK", [running_log_probs, ops.i64([search.num_beams])], 2, axis=1, largest=1, sorted=1
    )
    keep_offsets = _offsets(ops, search.beam_batch, search.candidates)
    running = _gather_beams(ops, candidates.sequences, next_topk, keep_offsets)
    rows = ops.op("GatherElements", candidates.rows, next_topk, axis=1)
    return replace(state, running=running, running_scores=running_scores, rows=rows)


def _newly_finished(
    ops: Ops, search: Search, state: Beams, candidates: _Candidates
) -> _NewlyFinished:
    """Step f, first half: score the candidates that end here as finished hypotheses."""
    s = search.settings
    top_mask = np.zeros((1, search.candidates), np.bool_)
    top_mask[0, : search.num_beams] = True
    just_finished = ops.op("And", candidates.hits, ops.const(top_mask))
    generated = ops.op("Sub", candidates.next_len, ops.i64(s.prompt_length))
    denominator = _length_penalty(ops, generated, float(s.length_penalty))
    scores = ops.op("Div", candidates.log_probs, denominator)
    if s.early_stopping is True:
        full = ops.all(state.finished, axis=1, keepdims=True)
        scores = _push_down(ops, scores, full)
    scores = _push_down(ops, scores, ops.op("Not", state.unsatisfied))
    scores = _push_down(ops, scores, ops.op("Not", just_finished))
    return _NewlyFinished(just_finished, scores, generated)


def _push_down(ops: Ops, scores: ir.Value, where: ir.Value) -> ir.Value:
    """``scores + where * _NEG``: out of the running wherever the bool ``where`` holds."""
    return ops.op("Add", scores, ops.op("Mul", ops.bool_to_float(where), ops.f32(_NEG)))


def _keep_finished(
    ops: Ops, search: Search, state: Beams, candidates: _Candidates, new: _NewlyFinished
) -> Beams:
    """Step f, second half: the best ``num_beams`` of the finished and the newly finished."""
    merged_scores = ops.op("Concat", state.scores, new.scores, axis=1)
    scores, chosen = ops.op_multi(
        "TopK", [merged_scores, ops.i64([search.num_beams])], 2, axis=1, largest=1, sorted=1
    )
    merged_offsets = _offsets(ops, search.beam_batch, search.num_beams + search.candidates)
    # One more column, so finished hypotheses line up with the candidates.
    widen = ops.i64([0, 0, 0, 0, 0, 1])
    padded = ops.op(
        "Pad", state.sequences, widen, ops.i64(pad_value(search.settings)), mode="constant"
    )
    merged = ops.op("Concat", padded, candidates.sequences, axis=1)
    sequences = _gather_beams(ops, merged, chosen, merged_offsets)
    candidate_lengths = ops.op("Expand", new.generated, ops.op("Shape", candidates.ids))
    lengths = ops.op(
        "GatherElements",
        ops.op("Concat", state.lengths, candidate_lengths, axis=1),
        chosen,
        axis=1,
    )
    merged_flags = ops.op("Concat", state.finished, new.flags, axis=1)
    finished = ops.op("GatherElements", merged_flags, chosen, axis=1)
    return replace(state, sequences=sequences, scores=scores, lengths=lengths, finished=finished)


def _stop_test(
    ops: Ops, search: Search, state: Beams, candidates: _Candidates, generated: ir.Value
) -> Beams:
    """Step g: go on while a running beam can still beat the worst finished one."""
    s = search.settings
    lp = float(s.length_penalty)
    if s.early_stopping == "never" and lp > 0.0:
        best_length = ops.op("Sub", search.max_length, ops.i64(s.prompt_length))
    else:
        best_length = generated
    best_running = ops.op(
        "Div", ops.slice(state.running_scores, 0, 1, axis=1), _length_penalty(ops, best_length, lp)
    )
    worst = ops.reduce("ReduceMin", state.scores, axis=1, keepdims=True)
    worst_finished = ops.op("Where", state.finished, worst, ops.f32(_NEG))
    improvable = ops.any(ops.op("Greater", best_running, worst_finished), axis=1, keepdims=True)
    unsatisfied = ops.op("And", state.unsatisfied, improvable)
    keep_going = ops.op("And", ops.any(unsatisfied), ops.op("Not", ops.all(candidates.hits)))
    if s.early_stopping is True:
        keep_going = ops.op("And", keep_going, ops.op("Not", ops.all(state.finished)))
    return replace(state, unsatisfied=unsatisfied, keep_going=keep_going)


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
