"""Greedy search, sampling and beam search over a step runner, matching transformers' loops.

A runner hides the model: ``start()`` runs the prompt and returns the next-token logits of each
row, ``advance(tokens)`` appends one token per row and returns the next logits (in greedy search
it may return bounds on them, whose ``argmax(processors, input_ids)`` gives the tokens),
``expand(n)`` repeats every row ``n`` times, ``reorder(rows)`` picks rows (beams) for the next
step and ``keep(rows)`` drops the rest (rows whose search ended). The logits a runner returns
are the search's to write over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from onnxmerge.runtime._accelerations import Accelerations
from onnxmerge.runtime.processors import LogitsProcessor, ProcessorList, log_softmax, softmax
from onnxmerge.settings import GenerationSettings

_NEG = np.float32(-1.0e9)

_Result = TypeVar("_Result")

# What the step generators yield: output rows and each one's new ids ([rows, n]).
NewIds = tuple[np.ndarray, np.ndarray]


def run_to_end(steps: Generator[object, None, _Result]) -> _Result:
    """The value a step generator returns, its yields ignored."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


# Which rows (greedy) or inputs (beam search) of a search nobody waits for any more.
Departed = Callable[[], np.ndarray]


class TokenPicker(Protocol):
    """What a greedy step may return in place of its logits: it picks each row's token."""

    def argmax(self, processors: LogitsProcessor, input_ids: np.ndarray) -> np.ndarray: ...


class StepRunner(Protocol):
    """The model as beam search sees it: every step returns the next-token logits."""

    def start(self) -> np.ndarray: ...

    def advance(self, tokens: np.ndarray) -> np.ndarray: ...

    def expand(self, n: int) -> None: ...

    def reorder(self, rows: np.ndarray, *, within_batch: bool = False) -> None: ...

    def keep(self, rows: np.ndarray) -> None: ...


class GreedyRunner(Protocol):
    """The model as greedy search and sampling see it: a step after the first may return a
    ``TokenPicker`` (bounds from a greedy head) in place of its logits."""

    def start(self, *, every_position: bool = False) -> np.ndarray: ...

    def advance(self, tokens: np.ndarray) -> np.ndarray | TokenPicker: ...

    def keep(self, rows: np.ndarray) -> None: ...


def _finished_by_eos(tokens: np.ndarray, eos: np.ndarray | None) -> np.ndarray:
    if eos is None:
        return np.zeros(tokens.shape, dtype=bool)
    return (tokens[..., None] == eos).any(axis=-1)


def sample_tokens(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row from ``probs`` (rows need not sum to 1); zero probability never wins."""
    cumulative = np.cumsum(probs.astype(np.float64), axis=1)
    draws = rng.random(probs.shape[0]) * cumulative[:, -1]
    chosen = (cumulative <= draws[:, None]).sum(axis=1)
    last_positive = probs.shape[1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=1)
    return np.minimum(chosen, last_positive).astype(np.int64)


def greedy_or_sample(
    runner: GreedyRunner,
    prompt: np.ndarray,
    settings: GenerationSettings,
    processors: ProcessorList,
    rng: np.random.Generator | None = None,
    *,
    accelerations: Accelerations | None = None,
    departed: Departed | None = None,
) -> np.ndarray:
    """transformers' ``_sample``: one token per row per step until eos or max_length.

    ``accelerations`` (default: off): with ``drop_finished``, rows that ended leave the runner
    (``runner.keep``), as CTranslate2 drops them, rather than run on to the batch's end on
    padding as in transformers; their tokens are the same. Only greedy search drops them
    (sampling draws for every row), and only where the processors keep no state by row.

    ``departed``: asked after every step which rows nobody waits for any more (a bool per
    prompt row); those end there, cut short, and leave the runner as ended rows do.
    """
    return run_to_end(
        greedy_or_sample_steps(
            runner,
            prompt,
            settings,
            processors,
            rng,
            accelerations=accelerations,
            departed=departed,
        )
    )


def greedy_or_sample_steps(
    runner: GreedyRunner,
    prompt: np.ndarray,
    settings: GenerationSettings,
    processors: ProcessorList,
    rng: np.random.Generator | None = None,
    *,
    accelerations: Accelerations | None = None,
    departed: Departed | None = None,
) -> Generator[NewIds, None, np.ndarray]:
    """``greedy_or_sample``, yielding after each step, before the next runs, the rows still
    running at that step and their new ids (``[rows, 1]``); returns the sequences."""
    eos = None if settings.eos_token_id is None else np.asarray(settings.eos_token_id, np.int64)
    # What finished rows take: pad (which resolve_settings sets where eos is set), else eos; no
    # row finishes without eos.
    pad = settings.pad_token_id
    fill = pad if pad is not None else (-1 if eos is None else int(eos[0]))
    rows, cur_len = prompt.shape
    sequences = np.empty((rows, settings.max_length), dtype=np.int64)
    sequences[:, :cur_len] = prompt
    drop = bool(accelerations and accelerations.drop_finished) and processors.rows_may_drop
    drop = drop and not settings.do_sample
    live = np.arange(rows)  # the rows the runner still holds, in its order
    unfinished = np.ones(rows, dtype=bool)
    logits: np.ndarray | TokenPicker = runner.start()
    while True:
        prefix = sequences[:, :cur_len] if live.size == rows else sequences[live, :cur_len]
        tokens = _next_tokens(logits, prefix, settings, processors, rng)
        if eos is not None:
            tokens = np.where(unfinished[live], tokens, fill)
        if live.size < rows:  # dropped rows are padded as transformers pads finished ones
            sequences[:, cur_len] = fill
        sequences[live, cur_len] = tokens
        running = np.flatnonzero(unfinished)
        cur_len += 1
        unfinished[live] &= ~_finished_by_eos(tokens, eos)
        if cur_len >= settings.max_length:
            unfinished[:] = False
        if departed is not None:
            unfinished &= ~departed()
        yield running, sequences[running, cur_len - 1 : cur_len]
        if not unfinished.any():
            break
        del logits  # [rows, vocab]: gone before the next step allocates its own
        if drop and not unfinished[live].all():
            kept = np.flatnonzero(unfinished[live])
            runner.keep(kept)
            live, tokens = live[kept], tokens[kept]
        logits = runner.advance(tokens)
    return sequences[:, :cur_len]


def _next_tokens(
    logits: np.ndarray | TokenPicker,
    prefix: np.ndarray,
    settings: GenerationSettings,
    processors: ProcessorList,
    rng: np.random.Generator | None,
) -> np.ndarray:
    """Each row's next token, from its logits or a greedy head's bounds (greedy search only)."""
    if not isinstance(logits, np.ndarray):
        return logits.argmax(processors, prefix)
    # In place where it may be: the runner's own array, which nothing reads after this.
    scores = logits.astype(np.float32, copy=not logits.flags.writeable)
    scores = processors(prefix, scores)
    if settings.do_sample:
        return sample_tokens(softmax(scores), rng or np.random.default_rng())
    return np.argmax(scores, axis=1)


def _gather(tensor: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``take_along_dim`` on axis 1 with ``indices`` of shape [batch, k]."""
    # Plain indexing: np.take_along_axis costs more in checks than these small arrays do.
    return tensor[np.arange(len(indices))[:, None], indices]


def _topk_indices(values: np.ndarray, k: int, slabs: int = 0) -> np.ndarray:
    """Indices of the k largest values per row, largest first, lower index first on ties, NaN
    last: ``np.argsort(-values, axis=1, kind="stable")[:, :k]``, which it is where ``slabs`` is
    0 (the plain top-k); otherwise without sorting whole rows.

    Beam search asks for 2 * beams of beams * vocab every step. The first ``width`` columns are
    viewed as ``slabs`` slabs; the maximum over slabs of each column group is a value of the
    row, so the k-th largest of these maxima bounds the row's k-th largest from below, and only
    the groups that reach it, and the columns past ``width``, hold candidates. Rows whose bound
    is -inf (a forced token masks all but a few) take their finite values and then the first
    -inf columns; rows with a NaN, or too many candidates at a finite bound, go to
    ``_topk_by_partition``, row by row.
    """
    if not slabs:
        return np.argsort(-values, axis=1, kind="stable")[:, :k]
    rows, n = values.shape
    group_count = n // slabs
    if group_count <= k:
        return _topk_by_partition(values, k)
    width = slabs * group_count
    groups = values[:, :width].reshape(rows, slabs, group_count)  # column: slab, then group
    group_max = groups.max(axis=1)
    bound = np.partition(group_max, -k, axis=1)[:, -k, None]
    reaching = group_max >= bound
    nan = np.isnan(group_max).any(axis=1) | np.isnan(values[:, width:]).any(axis=1)
    masked = ~nan & (bound[:, 0] == -np.inf)
    slow = nan | masked | (reaching.sum(axis=1) > 16 * k)
    reaching[slow] = False
    # np.nonzero on 2-D masks costs ten times a flat one here.
    row, group = np.divmod(np.flatnonzero(reaching), group_count)
    hit, slab = np.divmod(np.flatnonzero(groups[row, :, group] >= bound[row]), slabs)
    tail_row, tail_col = np.nonzero(values[:, width:] >= bound)
    tail = ~slow[tail_row]
    row = np.concatenate((row[hit], tail_row[tail]))
    col = np.concatenate((slab * group_count + group[hit], tail_col[tail] + width))
    order = np.lexsort((col, -values[row, col], row))  # by row, largest first, lower index first
    counts = np.bincount(row, minlength=rows)
    fast = np.flatnonzero(~slow)  # each has at least k candidates: k groups reach the bound
    result = np.empty((rows, k), dtype=np.int64)
    result[fast] = col[order[(np.cumsum(counts) - counts)[fast, None] + np.arange(k)]]
    for r in np.flatnonzero(masked):
        result[r] = _topk_of_few_finite(values[r], k)
    partitioned = slow & ~masked
    if partitioned.any():
        result[partitioned] = _topk_by_partition(values[partitioned], k)
    return result


def _topk_of_few_finite(row: np.ndarray, k: int) -> np.ndarray:
    """``_topk_indices`` of one row without NaN whose k-th largest may be -inf: its finite values
    by size, then the first -inf columns."""
    finite = np.flatnonzero(row > -np.inf)
    finite = finite[np.argsort(-row[finite], kind="stable")][:k]
    return np.concatenate((finite, np.flatnonzero(row == -np.inf)[: k - finite.size]))


def _topk_by_partition(values: np.ndarray, k: int) -> np.ndarray:
    """``_topk_indices`` by partitioning whole rows: where the k-th largest value ties with
    values the partition left out, the lower indices are taken instead."""
    if k >= values.shape[1]:
        return np.argsort(-values, axis=1, kind="stable")[:, :k]
    keys = -values  # ascending; NaN sorts last
    part = np.argpartition(keys, k - 1, axis=1)[:, :k]
    part.sort(axis=1)
    picked = _gather(keys, part)
    kth = np.sort(picked, axis=1)[:, -1:]  # the k-th smallest key, NaN where fewer numbers
    tied = (keys == kth).sum(axis=1) > (picked == kth).sum(axis=1)
    for r in np.flatnonzero(tied):  # the partition took other columns of the tie than the first
        ahead = np.flatnonzero(keys[r] < kth[r])
        part[r] = np.concatenate((ahead, np.flatnonzero(keys[r] == kth[r])[: k - ahead.size]))
    order = np.argsort(_gather(keys, part), axis=1, kind="stable")
    return _gather(part, order)


@dataclass(frozen=True)
class _BeamConfig:
    """The fixed quantities of one beam search."""

    num_beams: int
    batch: int
    prompt_len: int
    max_length: int
    length_penalty: float
    early_stopping: bool | str
    eos: np.ndarray | None
    beams_to_keep: int  # candidates per input each step: enough to survive every eos hit
    top_num_beam_mask: np.ndarray  # [beams_to_keep], True for the first num_beams
    batch_offset: np.ndarray  # [batch, 1], each input's first runner row
    topk_slabs: int = 0  # _topk_indices' slabs; 0: a stable sort

    def topk(self, values: np.ndarray, k: int) -> np.ndarray:
        return _topk_indices(values, k, self.topk_slabs)


@dataclass
class _Beams:
    """Running beams (still decoding) and finished hypotheses, per input."""

    running_sequences: np.ndarray  # [batch, beams, max_length]
    running_beam_scores: np.ndarray  # [batch, beams]
    # [batch, beams, max_length - prompt_len]: runner rows, numbered in the batch as it was at
    # each step (rows that left renumber the rest); only their count (!= -1) is read.
    running_beam_indices: np.ndarray
    sequences: np.ndarray
    beam_scores: np.ndarray
    beam_indices: np.ndarray
    is_sent_finished: np.ndarray  # [batch, beams]
    heuristic_unsatisfied: np.ndarray  # [batch, 1]: a running beam may still beat a finished one

    def of_inputs(self, kept: np.ndarray) -> _Beams:
        """These inputs' beams only."""
        return _Beams(**{f.name: getattr(self, f.name)[kept] for f in dataclasses.fields(self)})


@dataclass
class _Results:
    """Each input's finished hypotheses, stored as its search ends or it leaves the batch."""

    sequences: np.ndarray  # [batch, beams, max_length]
    beam_indices: np.ndarray  # [batch, beams, max_length - prompt_len]

    @classmethod
    def empty(cls, beams: _Beams) -> _Results:
        return cls(np.empty_like(beams.sequences), np.empty_like(beams.beam_indices))

    def store(self, inputs: np.ndarray, beams: _Beams, which: np.ndarray) -> None:
        self.sequences[inputs] = beams.sequences[which]
        self.beam_indices[inputs] = beams.beam_indices[which]


@dataclass(frozen=True)
class _Candidates:
    """The top continuations of one step, ``beams_to_keep`` per input."""

    log_probs: np.ndarray
    sequences: np.ndarray
    beam_indices: np.ndarray
    hits: np.ndarray  # the candidate ends here (eos or max_length)


def beam_search(
    runner: StepRunner,
    prompt: np.ndarray,
    settings: GenerationSettings,
    processors: ProcessorList,
    rng: np.random.Generator | None = None,
    *,
    accelerations: Accelerations | None = None,
    departed: Departed | None = None,
) -> np.ndarray:
    """transformers' vectorised ``_beam_search`` (and beam sampling when ``do_sample``).

    ``prompt`` holds one row per input; the runner's rows are expanded to beams after the first
    step, so the encoder and the prompt run once per input. ``accelerations`` (default: off):
    with ``drop_finished``, an input whose finished hypotheses can no longer change leaves the
    runner with its beams (``runner.keep``), as in ``greedy_or_sample``; with ``fast_topk``,
    the top-k searches only the column groups that can hold it. ``departed``: as for
    ``greedy_or_sample``, a bool per input; a departed input's beams leave the runner where
    rows may leave it, and the search ends once every input has departed.
    """
    return run_to_end(
        beam_search_steps(
            runner,
            prompt,
            settings,
            processors,
            rng,
            accelerations=accelerations,
            departed=departed,
        )
    )


def beam_search_steps(
    runner: StepRunner,
    prompt: np.ndarray,
    settings: GenerationSettings,
    processors: ProcessorList,
    rng: np.random.Generator | None = None,
    *,
    accelerations: Accelerations | None = None,
    departed: Departed | None = None,
) -> Generator[NewIds, None, np.ndarray]:
    """``beam_search``, yielding each input's returned hypotheses once final (an input that
    settles under ``drop_finished`` at that step, the others at the end): output row and
    generated ids, one row at a time (their lengths differ); returns the sequences."""
    accelerations = accelerations or Accelerations.off()
    cfg = _beam_config(settings, prompt.shape[0], prompt.shape[1])
    if accelerations.fast_topk:
        cfg = dataclasses.replace(cfg, topk_slabs=accelerations.topk_slabs)
    beams = _initial_beams(cfg, prompt, settings.pad_token_id)
    drop = accelerations.drop_finished and not settings.do_sample and processors.rows_may_drop
    results = _Results.empty(beams)
    inputs = np.arange(cfg.batch)  # the inputs the runner still holds, in its order
    cur_len = cfg.prompt_len
    logits = runner.start()
    # All beams of an input share the prompt: run it once, then repeat the rows.
    logits = np.repeat(logits, cfg.num_beams, axis=0)
    runner.expand(cfg.num_beams)
    while True:
        log_probs = _beam_log_probs(cfg, beams, cur_len, logits, processors)
        candidates = _top_candidates(cfg, beams, cur_len, log_probs, settings.do_sample, rng)
        # [rows, vocab] each: gone before the next step allocates its own (at 800 rows, 380 MB).
        del logits, log_probs
        _keep_running(cfg, beams, candidates)
        _keep_finished(cfg, beams, candidates, cur_len)
        cur_len += 1
        if _beams_done(cfg, beams, candidates, cur_len):
            break
        rows = beams.running_beam_indices[:, :, cur_len - 1 - cfg.prompt_len].astype(np.int64)
        settled = _settled(cfg, beams) if drop else None
        gone = departed()[inputs] if departed is not None else None
        if gone is not None and gone.all():
            break
        if gone is not None and drop and gone.any():
            settled = gone if settled is None else settled | gone
        if settled is not None and settled.all():
            # No later step can change any input's hypotheses (early_stopping=True can settle a
            # full input before _beams_done ends on it): a step of no rows would be next.
            break
        if settled is not None and settled.any():
            kept = np.flatnonzero(~settled)
            results.store(inputs[settled], beams, settled)
            yield from _final_rows(results, inputs[settled], settings.num_return_sequences)
            runner.keep(rows[kept].reshape(-1))
            beams, inputs = beams.of_inputs(kept), inputs[kept]
            cfg = dataclasses.replace(
                cfg, batch=kept.size, batch_offset=(np.arange(kept.size) * cfg.num_beams)[:, None]
            )
        else:
            runner.reorder(rows.reshape(-1), within_batch=True)
        logits = runner.advance(beams.running_sequences[:, :, cur_len - 1].reshape(-1))
    results.store(inputs, beams, np.ones(inputs.size, dtype=bool))
    yield from _final_rows(results, inputs, settings.num_return_sequences)
    return _returned_sequences(results, settings.num_return_sequences)


def _final_rows(
    results: _Results, inputs: np.ndarray, returned: int
) -> Generator[NewIds, None, None]:
    """Each returned hypothesis of ``inputs`` (stored): its output row and generated ids."""
    prompt_len = results.sequences.shape[2] - results.beam_indices.shape[2]
    for i in inputs:
        for k in range(returned):
            generated = int((results.beam_indices[i, k] != -1).sum())
            ids = results.sequences[i, k, prompt_len : prompt_len + generated]
            yield np.asarray([i * returned + k]), ids[None].copy()


def _settled(cfg: _BeamConfig, beams: _Beams) -> np.ndarray:
    """``[batch]``: the inputs whose finished hypotheses no step can change any more, which
    ``_keep_finished`` keeps as they are: none of their running beams can beat them, or they
    are full and ``early_stopping`` is True. Their running beams decide nothing else:
    ``_beams_done`` ends on the others alone, since only max_length makes every candidate hit.
    """
    full = beams.is_sent_finished.all(axis=1)
    return ~beams.heuristic_unsatisfied[:, 0] | (full & (cfg.early_stopping is True))


def _beam_config(settings: GenerationSettings, batch: int, prompt_len: int) -> _BeamConfig:
    num_beams = settings.num_beams
    eos = None if settings.eos_token_id is None else np.asarray(settings.eos_token_id, np.int64)
    n_eos = 0 if eos is None else len(eos)
    beams_to_keep = max(2, 1 + n_eos) * num_beams
    top_num_beam_mask = np.zeros(beams_to_keep, dtype=bool)
    top_num_beam_mask[:num_beams] = True
    return _BeamConfig(
        num_beams=num_beams,
        batch=batch,
        prompt_len=prompt_len,
        max_length=settings.max_length,
        length_penalty=settings.length_penalty,
        early_stopping=settings.early_stopping,
        eos=eos,
        beams_to_keep=beams_to_keep,
        top_num_beam_mask=top_num_beam_mask,
        batch_offset=(np.arange(batch) * num_beams)[:, None],
    )


def _initial_beams(cfg: _BeamConfig, prompt: np.ndarray, pad: int | None) -> _Beams:
    batch, num_beams, cur_len = cfg.batch, cfg.num_beams, cfg.prompt_len
    # transformers pads with `pad or eos[0]`: a pad id of 0 falls back to eos.
    fill = (pad if pad else int(cfg.eos[0])) if cfg.eos is not None else -1
    running_sequences = np.full((batch, num_beams, cfg.max_length), fill, dtype=np.int64)
    running_sequences[:, :, :cur_len] = prompt[:, None, :]
    running_beam_scores = np.zeros((batch, num_beams), dtype=np.float32)
    running_beam_scores[:, 1:] = _NEG
    running_beam_indices = np.full((batch, num_beams, cfg.max_length - cur_len), -1, dtype=np.int32)
    return _Beams(
        running_sequences=running_sequences,
        running_beam_scores=running_beam_scores,
        running_beam_indices=running_beam_indices,
        sequences=running_sequences.copy(),
        beam_scores=np.full((batch, num_beams), _NEG, dtype=np.float32),
        beam_indices=running_beam_indices.copy(),
        is_sent_finished=np.zeros((batch, num_beams), dtype=bool),
        heuristic_unsatisfied=np.ones((batch, 1), dtype=bool),
    )


def _beam_log_probs(
    cfg: _BeamConfig,
    beams: _Beams,
    cur_len: int,
    logits: np.ndarray,
    processors: ProcessorList,
) -> np.ndarray:
    """Processed log-probabilities plus each beam's score: ``[batch, beams * vocab]``."""
    batch, num_beams = cfg.batch, cfg.num_beams
    flat_running = beams.running_sequences[:, :, :cur_len].reshape(batch * num_beams, cur_len)
    # Over the logits themselves: the runner's own array, which nothing reads after this.
    log_probs = log_softmax(logits.astype(np.float32, copy=False), in_place=True)
    log_probs = processors(flat_running, log_probs)
    vocab = log_probs.shape[1]
    # In place: log_probs is this step's own array, and a copy would cost a pass over it.
    log_probs = log_probs.reshape(batch, num_beams, vocab)
    log_probs += beams.running_beam_scores[:, :, None]
    return log_probs.reshape(batch, num_beams * vocab)


def _top_candidates(
    cfg: _BeamConfig,
    beams: _Beams,
    cur_len: int,
    log_probs: np.ndarray,
    do_sample: bool,
    rng: np.random.Generator | None,
) -> _Candidates:
    """transformers' steps c (top-K continuations) and d (which of them finish)."""
    if do_sample:
        # Sampling without replacement by the Gumbel-top-k trick.
        with np.errstate(divide="ignore"):
            gumbel = np.log(softmax(log_probs).astype(np.float64)) - np.log(
                -np.log((rng or np.random.default_rng()).random(log_probs.shape))
            )
        topk_indices = cfg.topk(gumbel, cfg.beams_to_keep)
    else:
        topk_indices = _first_step_topk(cfg, cur_len, log_probs)
    vocab = log_probs.shape[1] // cfg.num_beams
    topk_log_probs = _gather(log_probs, topk_indices)
    topk_beams = topk_indices // vocab
    topk_ids = topk_indices % vocab
    topk_running_beam_indices = _gather(beams.running_beam_indices, topk_beams)
    topk_running_sequences = _gather(beams.running_sequences, topk_beams)
    topk_running_sequences[:, :, cur_len] = topk_ids
    topk_running_beam_indices[:, :, cur_len - cfg.prompt_len] = topk_beams + cfg.batch_offset
    hits = _finished_by_eos(topk_ids, cfg.eos)
    if cur_len + 1 >= cfg.max_length:
        hits[:] = True
    return _Candidates(topk_log_probs, topk_running_sequences, topk_running_beam_indices, hits)


def _first_step_topk(cfg: _BeamConfig, cur_len: int, log_probs: np.ndarray) -> np.ndarray:
    """``_topk_indices(log_probs, beams_to_keep)``; on the first step from beam 0's columns.

    There every beam but the first scores -1e9 plus log-probabilities (at most 0): a row of
    ties to float32 that sends the whole row to ``_topk_by_partition``. Where beam 0's own k-th
    best is above -1e9 it beats every other beam's candidate, so its columns (the first, which
    win ties too) hold the whole answer.
    """
    if cur_len == cfg.prompt_len and cfg.num_beams > 1:
        first = log_probs[:, : log_probs.shape[1] // cfg.num_beams]
        if first.shape[1] >= cfg.beams_to_keep:
            top = cfg.topk(first, cfg.beams_to_keep)
            if bool((_gather(first, top)[:, -1] > _NEG).all()):
                return top
    return cfg.topk(log_probs, cfg.beams_to_keep)


def _keep_running(cfg: _BeamConfig, beams: _Beams, candidates: _Candidates) -> None:
    """Step e: the best unfinished candidates run on."""
    running_log_probs = candidates.log_probs + candidates.hits.astype(np.float32) * _NEG
    next_topk = cfg.topk(running_log_probs, cfg.num_beams)
    beams.running_sequences = _gather(candidates.sequences, next_topk)
    beams.running_beam_scores = _gather(running_log_probs, next_topk)
    beams.running_beam_indices = _gather(candidates.beam_indices, next_topk)


def _keep_finished(cfg: _BeamConfig, beams: _Beams, candidates: _Candidates, cur_len: int) -> None:
    """Step f: merge the candidates that finished here into the best finished hypotheses."""
    just_finished = candidates.hits & cfg.top_num_beam_mask[None, :]
    finished_scores = candidates.log_probs / ((cur_len + 1 - cfg.prompt_len) ** cfg.length_penalty)
    beams_full = np.all(beams.is_sent_finished, axis=-1, keepdims=True) & (
        cfg.early_stopping is True
    )
    finished_scores = finished_scores + beams_full.astype(np.float32) * _NEG
    finished_scores = finished_scores + (~beams.heuristic_unsatisfied).astype(np.float32) * _NEG
    finished_scores = finished_scores + (~just_finished).astype(np.float32) * _NEG
    merged_scores = np.concatenate((beams.beam_scores, finished_scores), axis=1)
    keep = cfg.topk(merged_scores, cfg.num_beams)
    beams.sequences = _gather(np.concatenate((beams.sequences, candidates.sequences), axis=1), keep)
    beams.beam_scores = _gather(merged_scores, keep)
    beams.beam_indices = _gather(
        np.concatenate((beams.beam_indices, candidates.beam_indices), axis=1), keep
    )
    beams.is_sent_finished = _gather(
        np.concatenate((beams.is_sent_finished, just_finished), axis=1), keep
    )


def _beams_done(cfg: _BeamConfig, beams: _Beams, candidates: _Candidates, cur_len: int) -> bool:
    """Step g: no running beam can still beat a finished one, or nothing can run on."""
    if cfg.early_stopping == "never" and cfg.length_penalty > 0.0:
        best_length = cfg.max_length - cfg.prompt_len
    else:
        best_length = cur_len - cfg.prompt_len
    best_running = beams.running_beam_scores[:, :1] / (best_length**cfg.length_penalty)
    worst_finished = np.where(
        beams.is_sent_finished,
        np.min(beams.beam_scores, axis=1, keepdims=True),
        np.float32(-1.0e9),
    )
    beams.heuristic_unsatisfied = beams.heuristic_unsatisfied & np.any(
        best_running > worst_finished, axis=-1, keepdims=True
    )
    improvement_possible = beams.heuristic_unsatisfied.any()
    open_beam = not (beams.is_sent_finished.all() and cfg.early_stopping is True)
    valid_continuations = not candidates.hits.all()
    return not (improvement_possible and open_beam and valid_continuations)


def _returned_sequences(results: _Results, returned: int) -> np.ndarray:
    batch, _, max_length = results.sequences.shape
    sequences = results.sequences[:, :returned, :].reshape(batch * returned, max_length)
    beam_indices = results.beam_indices[:, :returned, :].reshape(batch * returned, -1)
    generated = int((beam_indices != -1).sum(axis=1).max())
    prompt_len = max_length - results.beam_indices.shape[2]
    return sequences[:, : prompt_len + generated]
