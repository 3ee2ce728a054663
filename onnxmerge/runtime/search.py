"""Greedy search, sampling and beam search over a step runner, matching transformers' loops.

A runner hides the model: ``start()`` runs the prompt and returns the next-token logits of each
row, ``advance(tokens)`` appends one token per row and returns the next logits, ``expand(n)``
repeats every row ``n`` times and ``reorder(rows)`` picks rows (beams) for the next step.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from onnxmerge.runtime.processors import ProcessorList, log_softmax, softmax
from onnxmerge.settings import GenerationSettings

_NEG = np.float32(-1.0e9)


class StepRunner(Protocol):
    def start(self) -> np.ndarray: ...

    def advance(self, tokens: np.ndarray) -> np.ndarray: ...

    def expand(self, n: int) -> None: ...

    def reorder(self, rows: np.ndarray, *, within_batch: bool = False) -> None: ...


def _finished_by_eos(tokens: np.ndarray, eos: np.ndarray | None) -> np.ndarray:
    if eos is None:
        return np.zeros(tokens.shape, dtype=bool)
    return np.isin(tokens, eos)


def sample_tokens(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row from ``probs`` (rows need not sum to 1); zero probability never wins."""
    cumulative = np.cumsum(probs.astype(np.float64), axis=1)
    draws = rng.random(probs.shape[0]) * cumulative[:, -1]
    chosen = (cumulative <= draws[:, None]).sum(axis=1)
    last_positive = probs.shape[1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=1)
    return np.minimum(chosen, last_positive).astype(np.int64)


def greedy_or_sample(
    runner: StepRunner,
    prompt: np.ndarray,
    settings: GenerationSettings,
    processors: ProcessorList,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """transformers' ``_sample``: one token per row per step until eos or max_length."""
    eos = None if settings.eos_token_id is None else np.asarray(settings.eos_token_id, np.int64)
    pad = settings.pad_token_id
    rows, cur_len = prompt.shape
    sequences = np.empty((rows, settings.max_length), dtype=np.int64)
    sequences[:, :cur_len] = prompt
    unfinished = np.ones(rows, dtype=bool)
    logits = runner.start()
    while True:
        scores = processors(sequences[:, :cur_len], np.array(logits, dtype=np.float32))
        if settings.do_sample:
            tokens = sample_tokens(softmax(scores), rng)
        else:
            tokens = np.argmax(scores, axis=1)
        if eos is not None:
            tokens = np.where(unfinished, tokens, pad)
        sequences[:, cur_len] = tokens
        cur_len += 1
        unfinished &= ~_finished_by_eos(tokens, eos)
        if cur_len >= settings.max_length:
            unfinished[:] = False
        if not unfinished.any():
            break
        logits = runner.advance(tokens)
    return sequences[:, :cur_len]


def _gather(tensor: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``take_along_dim`` on axis 1 with ``indices`` of shape [batch, k]."""
    while indices.ndim < tensor.ndim:
        indices = indices[..., None]
    return np.take_along_axis(tensor, indices, axis=1)


def _topk_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values per row, largest first, lower index first on ties."""
    if k < values.shape[1]:
        part = np.argpartition(-values, k - 1, axis=1)[:, :k]
        part.sort(axis=1)
        order = np.argsort(-np.take_along_axis(values, part, axis=1), axis=1, kind="stable")
        return np.take_along_axis(part, order, axis=1)
    return np.argsort(-values, axis=1, kind="stable")[:, :k]


def beam_search(
    runner: StepRunner,
    prompt: np.ndarray,
    settings: GenerationSettings,
    processors: ProcessorList,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """transformers' vectorised ``_beam_search`` (and beam sampling when ``do_sample``).

    ``prompt`` holds one row per input; the runner's rows are expanded to beams after the first
    step, so the encoder and the prompt run once per input.
    """
    num_beams = settings.num_beams
    batch, cur_len = prompt.shape
    max_length = settings.max_length
    length_penalty = settings.length_penalty
    early_stopping = settings.early_stopping
    eos = None if settings.eos_token_id is None else np.asarray(settings.eos_token_id, np.int64)
    pad = settings.pad_token_id
    # transformers pads with `pad or eos[0]`: a pad id of 0 falls back to eos.
    fill = (pad if pad else int(eos[0])) if eos is not None else -1

    prompt_len = cur_len
    n_eos = 0 if eos is None else len(eos)
    beams_to_keep = max(2, 1 + n_eos) * num_beams
    top_num_beam_mask = np.zeros(beams_to_keep, dtype=bool)
    top_num_beam_mask[:num_beams] = True

    running_sequences = np.full((batch, num_beams, max_length), fill, dtype=np.int64)
    running_sequences[:, :, :cur_len] = prompt[:, None, :]
    sequences = running_sequences.copy()
    running_beam_scores = np.zeros((batch, num_beams), dtype=np.float32)
    running_beam_scores[:, 1:] = _NEG
    beam_scores = np.full((batch, num_beams), _NEG, dtype=np.float32)
    is_sent_finished = np.zeros((batch, num_beams), dtype=bool)
    heuristic_unsatisfied = np.ones((batch, 1), dtype=bool)
    running_beam_indices = np.full((batch, num_beams, max_length - cur_len), -1, dtype=np.int32)
    beam_indices = running_beam_indices.copy()
    batch_offset = (np.arange(batch) * num_beams)[:, None]

    logits = runner.start()
    # All beams of an input share the prompt: run it once, then repeat the rows.
    logits = np.repeat(logits, num_beams, axis=0)
    runner.expand(num_beams)

    while True:
        flat_running = running_sequences[:, :, :cur_len].reshape(batch * num_beams, cur_len)
        log_probs = log_softmax(logits.astype(np.float32, copy=False))
        log_probs = processors(flat_running, log_probs)
        vocab = log_probs.shape[1]
        log_probs = log_probs.reshape(batch, num_beams, vocab) + running_beam_scores[:, :, None]
        log_probs = log_probs.reshape(batch, num_beams * vocab)

        # c. top-K continuations
        if settings.do_sample:
            # Sampling without replacement by the Gumbel-top-k trick.
            with np.errstate(divide="ignore"):
                gumbel = np.log(softmax(log_probs).astype(np.float64)) - np.log(
                    -np.log(rng.random(log_probs.shape))
                )
            topk_indices = _topk_indices(gumbel, beams_to_keep)
        else:
            topk_indices = _topk_indices(log_probs, beams_to_keep)
        topk_log_probs = np.take_along_axis(log_probs, topk_indices, axis=1)
        topk_beams = topk_indices // vocab
        topk_ids = topk_indices % vocab
        topk_running_beam_indices = _gather(running_beam_indices, topk_beams)
        topk_running_sequences = _gather(running_sequences, topk_beams)
        topk_running_sequences[:, :, cur_len] = topk_ids
        topk_running_beam_indices[:, :, cur_len - prompt_len] = topk_beams + batch_offset

        # d. which candidates are finished
        hits = _finished_by_eos(topk_ids, eos)
        if cur_len + 1 >= max_length:
            hits[:] = True

        # e. running beams for the next step
        topk_running_log_probs = topk_log_probs + hits.astype(np.float32) * _NEG
        next_topk = _topk_indices(topk_running_log_probs, num_beams)
        running_sequences = _gather(topk_running_sequences, next_topk)
        running_beam_scores = _gather(topk_running_log_probs, next_topk)
        running_beam_indices = _gather(topk_running_beam_indices, next_topk)

        # f. finished beams
        just_finished = hits & top_num_beam_mask[None, :]
        finished_scores = topk_log_probs / ((cur_len + 1 - prompt_len) ** length_penalty)
        beams_full = np.all(is_sent_finished, axis=-1, keepdims=True) & (early_stopping is True)
        finished_scores = finished_scores + beams_full.astype(np.float32) * _NEG
        finished_scores = finished_scores + (~heuristic_unsatisfied).astype(np.float32) * _NEG
        finished_scores = finished_scores + (~just_finished).astype(np.float32) * _NEG
        merged_scores = np.concatenate((beam_scores, finished_scores), axis=1)
        keep = _topk_indices(merged_scores, num_beams)
        sequences = _gather(np.concatenate((sequences, topk_running_sequences), axis=1), keep)
        beam_scores = _gather(merged_scores, keep)
        beam_indices = _gather(
            np.concatenate((beam_indices, topk_running_beam_indices), axis=1), keep
        )
        is_sent_finished = _gather(np.concatenate((is_sent_finished, just_finished), axis=1), keep)

        # g. stop, or reorder the cache and go on
        cur_len += 1
        if early_stopping == "never" and length_penalty > 0.0:
            best_length = max_length - prompt_len
        else:
            best_length = cur_len - prompt_len
        best_running = running_beam_scores[:, :1] / (best_length**length_penalty)
        worst_finished = np.where(
            is_sent_finished, np.min(beam_scores, axis=1, keepdims=True), np.float32(-1.0e9)
        )
        heuristic_unsatisfied = heuristic_unsatisfied & np.any(
            best_running > worst_finished, axis=-1, keepdims=True
        )
        improvement_possible = heuristic_unsatisfied.any()
        open_beam = not (is_sent_finished.all() and early_stopping is True)
        valid_continuations = not hits.all()
        if not (improvement_possible and open_beam and valid_continuations):
            break
        rows = running_beam_indices[:, :, cur_len - 1 - prompt_len].reshape(-1)
        runner.reorder(rows.astype(np.int64), within_batch=True)
        logits = runner.advance(running_sequences[:, :, cur_len - 1].reshape(-1))

    returned = settings.num_return_sequences
    sequences = sequences[:, :returned, :].reshape(batch * returned, max_length)
    beam_indices = beam_indices[:, :returned, :].reshape(batch * returned, -1)
    generated = int((beam_indices != -1).sum(axis=1).max())
    return sequences[:, : prompt_len + generated]
