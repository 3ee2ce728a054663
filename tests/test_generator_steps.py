"""The generator's steps, each alone: a graph whose inputs are written as ONNX text, the step's
nodes appended, run in onnxruntime and compared with numpy written here."""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir
import pytest

from onnxmerge.generator import (
    _build as build,
)
from onnxmerge.generator import (
    _processor_nodes as processors,
)
from onnxmerge.generator import (
    _search_nodes as search,
)
from onnxmerge.generator._ops import Names, Ops
from onnxmerge.settings import resolve_settings
from tests import textmodels as tm

pytest.importorskip("onnxruntime")

VOCAB, START, PAD, EOS = 7, 2, 1, 3
NEG = np.float32(-1.0e9)
BEAM_STATE = (
    "int64[B, K, L] running, float[B, K] running_scores, int64[B, K, L] sequences, "
    "float[B, K] scores, int64[B, K] lengths, bool[B, K] finished, bool[B, 1] unsatisfied"
)
CANDIDATES = (
    "float[B, C] log_probs, int64[B, C] ids, int64[B, C, M] candidates, int64[B, C] rows, "
    "bool[B, C] hits, int64 next_len"
)


class StepGraph:
    """Graph inputs written as ONNX text; the step under test appends its nodes to ``ops``."""

    def __init__(self, inputs: str, opset: int = 18):
        header = f'<ir_version: 8, opset_import: ["" : {opset}]>'
        self.model = tm.ir_from_text(f"{header}\nstep ({inputs}) => () {{}}")
        self.ops = Ops(Names(), opset)
        self.v = {value.name: value for value in self.model.graph.inputs}

    def run(self, outputs: list[ir.Value], **feeds) -> list[np.ndarray]:
        return self.session(outputs).run(None, feeds)

    def session(self, outputs: list[ir.Value]):
        graph = self.model.graph
        for node in self.ops.nodes:
            graph.append(node)
        graph.outputs.extend(outputs)
        return tm.session(ir.serde.serialize_model(self.model).SerializeToString())

    def beams(self) -> search.Beams:
        return search.Beams(*(self.v[n] for n in _names(BEAM_STATE)))

    def candidates(self) -> search._Candidates:
        return search._Candidates(*(self.v[n] for n in _names(CANDIDATES)))


def _names(signature: str) -> list[str]:
    """The input names of ``"int64[B, K] a, bool b"``: ``["a", "b"]``."""
    return [part.split()[-1] for part in re.sub(r"\[[^\]]*\]", "", signature).split(", ")]


def _settings(**overrides):
    given = {"eos_token_id": EOS, "pad_token_id": PAD, "decoder_start_token_id": START}
    return resolve_settings({}, {}, {**given, **overrides}, 1)


def _search(g: StepGraph, num_beams: int = 1, **overrides) -> search.Search:
    batch = g.v.get("batch")
    return search.Search(_settings(**overrides), VOCAB, g.v["max_length"], None, batch, num_beams)


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """TopK's order: largest first, the lower index first on ties."""
    return np.argsort(-values, axis=1, kind="stable")[:, :k]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _beam_state(rng, batch: int = 2, beams: int = 2, length: int = 3) -> dict[str, np.ndarray]:
    """Two inputs: the first has one finished hypothesis, the second none yet."""
    return {
        "running": rng.integers(4, VOCAB, (batch, beams, length)),
        "running_scores": -rng.random((batch, beams)).astype(np.float32),
        "sequences": rng.integers(4, VOCAB, (batch, beams, length)),
        "scores": np.array([[-0.4, NEG], [NEG, NEG]], np.float32),
        "lengths": np.array([[2, 0], [0, 0]]),
        "finished": np.array([[True, False], [False, False]]),
        "unsatisfied": np.ones((batch, 1), bool),
    }


def _candidate_feeds(rng, hits: list[list[bool]], next_len: int = 4) -> dict[str, np.ndarray]:
    batch, keep = len(hits), len(hits[0])
    log_probs = -np.sort(rng.random((batch, keep)).astype(np.float32) * 4, axis=1)
    return {
        "log_probs": log_probs,
        "ids": rng.integers(0, VOCAB, (batch, keep)),
        "candidates": rng.integers(0, VOCAB, (batch, keep, next_len)),
        "rows": rng.integers(0, 4, (batch, keep)),
        "hits": np.array(hits),
        "next_len": np.array(next_len),
    }


@pytest.mark.parametrize("opset", [17, 18])
def test_any_and_all_reduce_bool_flags_in_the_models_opset(opset):
    # Before opset 18 the axes of Reduce* are an attribute, from 18 on an input.
    g = StepGraph("bool[R, N] flags", opset)
    flags = g.v["flags"]
    ops = g.ops
    outputs = [ops.any(flags), ops.all(flags), ops.any(flags, 1, True), ops.all(flags, 1)]
    value = np.array([[True, False], [True, True]])
    got = g.run(outputs, flags=value)
    assert bool(got[0]) and not bool(got[1])
    np.testing.assert_array_equal(got[2], value.any(1, keepdims=True))
    np.testing.assert_array_equal(got[3], value.all(1))


# ---------------------------------------------------------------- greedy search


@pytest.mark.parametrize("ending", [[1], [0, 1]])
def test_greedy_step_takes_the_best_token_and_pads_finished_rows(ending):
    g = StepGraph("float[R, V] logits, int64[R, L] sequences, bool[R] unfinished, int64 max_length")
    step = search.greedy_step(g.ops, _search(g), g.v["logits"], g.v["sequences"], g.v["unfinished"])
    logits = np.random.default_rng(0).standard_normal((3, VOCAB)).astype(np.float32)
    logits[ending, EOS] = 10.0
    sequences = np.array([[START, 5], [START, 6], [START, 4]])
    unfinished = np.array([True, True, False])
    got = g.run(
        [step.tokens, step.sequences, step.unfinished, step.keep_going],
        logits=logits,
        sequences=sequences,
        unfinished=unfinished,
        max_length=np.array(9),
    )
    tokens = np.where(unfinished, logits.argmax(1), PAD)
    still = unfinished & (tokens != EOS)
    np.testing.assert_array_equal(got[0], tokens[:, None])
    np.testing.assert_array_equal(got[1], np.concatenate([sequences, tokens[:, None]], 1))
    np.testing.assert_array_equal(got[2], still)
    assert bool(got[3]) == still.any() == (ending == [1])


# ---------------------------------------------------------------- beam search


def test_initial_beams_start_one_live_beam_per_input():
    g = StepGraph("int64 batch")
    prompt = g.ops.op(
        "ConstantOfShape",
        g.ops.vector(g.v["batch"], g.ops.i64(1)),
        value=ir.tensor(np.array([START], np.int64)),
    )
    state = search.initial_beams(g.ops, _settings(), g.v["batch"], 3, prompt)
    # running and sequences start as one value: the loop wraps repeats the same way.
    got = g.run(build._own_outputs(g.ops, state.carried()), batch=np.array(2))
    running, running_scores, sequences, scores, lengths, finished, unsatisfied = got
    np.testing.assert_array_equal(running, np.full((2, 3, 1), START))
    np.testing.assert_array_equal(sequences, running)
    np.testing.assert_array_equal(running_scores, [[0.0, NEG, NEG]] * 2)
    np.testing.assert_array_equal(scores, np.full((2, 3), NEG))
    np.testing.assert_array_equal(lengths, np.zeros((2, 3)))
    assert not finished.any() and unsatisfied.all() and unsatisfied.shape == (2, 1)


def test_gather_beams_picks_each_inputs_own_rows():
    g = StepGraph("int64[B, N, L] tensor, int64[B, K] indices, int64 batch")
    offsets = search._offsets(g.ops, g.v["batch"], 3)
    picked = search._gather_beams(g.ops, g.v["tensor"], g.v["indices"], offsets)
    tensor = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    indices = np.array([[2, 0, 2], [1, 1, 0]])
    got = g.run([picked, offsets], tensor=tensor, indices=indices, batch=np.array(2))
    np.testing.assert_array_equal(
        got[0].reshape(2, 3, 4), np.take_along_axis(tensor, indices[:, :, None], axis=1)
    )
    np.testing.assert_array_equal(got[1], [[0], [3]])


def test_beam_log_probs_add_each_beams_score():
    g = StepGraph(f"float[R, V] logits, {BEAM_STATE}, int64 batch, int64 max_length")
    state = g.beams()
    cur_len = g.ops.dim(state.running, 2)
    log_probs, vocab = search._beam_log_probs(g.ops, _search(g, 2), g.v["logits"], state, cur_len)
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, VOCAB)).astype(np.float32)
    feeds = _beam_state(rng)
    got = g.run(
        [log_probs, vocab], logits=logits, batch=np.array(2), max_length=np.array(9), **feeds
    )
    per_beam = _log_softmax(logits).reshape(2, 2, VOCAB) + feeds["running_scores"][:, :, None]
    np.testing.assert_allclose(got[0], per_beam.reshape(2, 2 * VOCAB), rtol=1e-6, atol=1e-6)
    assert int(got[1]) == VOCAB


@pytest.mark.parametrize("max_length", [9, 4])
def test_top_candidates_extend_the_best_beams_and_flag_ends(max_length):
    g = StepGraph(
        f"float[B, W] log_probs, {BEAM_STATE}, int64 batch, int64 max_length, int64 vocab"
    )
    state = g.beams()
    cur_len = g.ops.dim(state.running, 2)
    found = search._top_candidates(
        g.ops, _search(g, 2), state, g.v["log_probs"], g.v["vocab"], cur_len
    )
    rng = np.random.default_rng(2)
    log_probs = -rng.random((2, 2 * VOCAB)).astype(np.float32)
    log_probs[0, VOCAB + EOS] = 0.0  # the best continuation of input 0 ends in eos
    feeds = _beam_state(rng)
    outputs = [found.log_probs, found.ids, found.sequences, found.rows, found.hits, found.next_len]
    got = g.run(
        outputs,
        log_probs=log_probs,
        batch=np.array(2),
        vocab=np.array(VOCAB),
        max_length=np.array(max_length),
        **feeds,
    )
    best = _top(log_probs, 4)  # 2 beams, one eos: 4 candidates
    beams, ids = best // VOCAB, best % VOCAB
    np.testing.assert_array_equal(got[0], np.take_along_axis(log_probs, best, 1))
    np.testing.assert_array_equal(got[1], ids)
    extended = np.take_along_axis(feeds["running"], beams[:, :, None], 1)
    np.testing.assert_array_equal(got[2], np.concatenate([extended, ids[:, :, None]], 2))
    np.testing.assert_array_equal(got[3], beams + [[0], [2]])
    at_limit = 3 + 1 >= max_length
    np.testing.assert_array_equal(got[4], (ids == EOS) | at_limit)
    assert got[4][0, 0] and int(got[5]) == 4


def test_keep_running_drops_candidates_that_end():
    g = StepGraph(f"{CANDIDATES}, {BEAM_STATE}, int64 batch, int64 max_length")
    kept = search._keep_running(g.ops, _search(g, 2), g.beams(), g.candidates())
    rng = np.random.default_rng(3)
    hits = [[True, False, False, True], [False, True, False, False]]
    candidates = _candidate_feeds(rng, hits)
    got = g.run(
        [kept.running, kept.running_scores, kept.rows],
        batch=np.array(2),
        max_length=np.array(9),
        **candidates,
        **_beam_state(rng),
    )
    pushed = candidates["log_probs"] + np.array(hits, np.float32) * NEG
    best = _top(pushed, 2)
    np.testing.assert_array_equal(best, [[1, 2], [0, 2]])
    np.testing.assert_array_equal(
        got[0], np.take_along_axis(candidates["candidates"], best[:, :, None], 1)
    )
    np.testing.assert_array_equal(got[1], np.take_along_axis(pushed, best, 1))
    np.testing.assert_array_equal(got[2], np.take_along_axis(candidates["rows"], best, 1))


@pytest.mark.parametrize("early_stopping", [False, True])
@pytest.mark.parametrize("settled", [False, True])
def test_finished_beams_keep_the_best_of_old_and_new(early_stopping, settled):
    g = StepGraph(f"{CANDIDATES}, {BEAM_STATE}, int64 batch, int64 max_length")
    state = g.beams()
    settings = {"length_penalty": 0.5, "early_stopping": early_stopping}
    steps = _search(g, 2, **settings)
    new = search._newly_finished(g.ops, steps, state, g.candidates())
    merged = search._keep_finished(g.ops, steps, state, g.candidates(), new)
    rng = np.random.default_rng(4)
    # Only the top num_beams candidates finish: input 0's last hit is not among them.
    hits = [[True, False, False, True], [False, True, False, False]]
    candidates = _candidate_feeds(rng, hits)
    candidates["log_probs"][0, 0] = -0.3  # beats the finished -0.4 once length-penalised
    feeds = _beam_state(rng)
    feeds["finished"][0, 1] = True  # input 0 is full
    feeds["scores"][0, 1] = -0.7
    feeds["finished"][1, 0], feeds["scores"][1, 0] = True, -2.0  # input 1 has room for one
    feeds["unsatisfied"][1] = not settled  # a settled input takes no new hypothesis
    outputs = [
        new.flags,
        new.scores,
        new.generated,
        merged.sequences,
        merged.scores,
        merged.lengths,
        merged.finished,
    ]
    got = g.run(outputs, batch=np.array(2), max_length=np.array(9), **candidates, **feeds)

    just = np.array(hits) & (np.arange(4) < 2)
    generated = 4 - 1
    scores = candidates["log_probs"] / np.float32(generated**0.5)
    if early_stopping:
        scores = scores + feeds["finished"].all(1, keepdims=True).astype(np.float32) * NEG
    scores = scores + (~feeds["unsatisfied"]).astype(np.float32) * NEG
    scores = scores + (~just).astype(np.float32) * NEG
    np.testing.assert_array_equal(got[0], just)
    np.testing.assert_allclose(got[1], scores, rtol=1e-6)
    assert int(got[2]) == generated
    all_scores = np.concatenate([feeds["scores"], scores], 1)
    chosen = _top(all_scores, 2)
    padded = np.pad(feeds["sequences"], [(0, 0), (0, 0), (0, 1)], constant_values=PAD)
    every = np.concatenate([padded, candidates["candidates"]], 1)
    np.testing.assert_array_equal(got[3], np.take_along_axis(every, chosen[:, :, None], 1))
    np.testing.assert_allclose(got[4], np.take_along_axis(all_scores, chosen, 1), rtol=1e-6)
    lengths = np.concatenate([feeds["lengths"], np.full((2, 4), generated)], 1)
    np.testing.assert_array_equal(got[5], np.take_along_axis(lengths, chosen, 1))
    flags = np.concatenate([feeds["finished"], just], 1)
    np.testing.assert_array_equal(got[6], np.take_along_axis(flags, chosen, 1))
    # Early stopping: a full input takes no new hypothesis.
    assert (got[0][0, 0] and not early_stopping) == (got[4][0, 0] > -0.4)
    assert (got[4][1] > NEG / 2).sum() == (1 if settled else 2)


@pytest.mark.parametrize(
    ("case", "keep_going"),
    [
        ("improvable", True),
        ("all-hit", False),
        ("worse", False),
        ("never", True),
        ("never-worse", False),
        ("early-all-finished", False),
    ],
)
def test_stop_test_goes_on_while_a_running_beam_can_win(case, keep_going):
    g = StepGraph(f"{CANDIDATES}, {BEAM_STATE}, int64 batch, int64 max_length, int64 generated")
    never = case.startswith("never")
    early = "never" if never else case.startswith("early")
    steps = _search(g, 2, length_penalty=2.0, early_stopping=early)
    done = search._stop_test(g.ops, steps, g.beams(), g.candidates(), g.v["generated"])
    rng = np.random.default_rng(5)
    feeds = _beam_state(rng)
    # Input 0: finished at -0.4 (all beams); input 1: nothing finished, so always improvable.
    feeds["finished"][:] = [[True, True], [False, False]]
    feeds["scores"][0] = [-0.4, -0.5]
    best = {"worse": -3.0, "never": -3.0, "never-worse": -40.0}.get(case, -1.0)
    feeds["running_scores"][0, 0] = best
    feeds["unsatisfied"][1] = not (never or case == "worse")  # input 1 settled earlier
    # Early stopping ends the search once every beam of every input has finished.
    feeds["finished"][1] = early is True
    hits = [[case == "all-hit"] * 4] * 2
    got = g.run(
        [done.unsatisfied, done.keep_going],
        batch=np.array(2),
        max_length=np.array(9),
        generated=np.array(2),
        **_candidate_feeds(rng, hits),
        **feeds,
    )
    # best / generated ** 2 against the worst finished, -0.5; "never": best / (9 - 1) ** 2.
    denominator = 8.0**2 if never else 2.0**2
    assert bool(got[0][0, 0]) == (best / denominator > -0.5)
    assert bool(got[1]) == keep_going


class _FixedLogits:
    """A runtime step runner whose logits depend on the step only: both searches see the same."""

    def __init__(self, steps: list[np.ndarray]):
        self.steps = iter(steps)

    def start(self) -> np.ndarray:
        return next(self.steps)

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        return next(self.steps)

    def expand(self, n: int) -> None:
        pass

    def reorder(self, rows: np.ndarray, *, within_batch: bool = False) -> None:
        pass


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"early_stopping": True, "length_penalty": 0.6},
        {"early_stopping": "never", "length_penalty": 1.5},
        {"eos_token_id": [EOS, 5]},
    ],
)
def test_beam_steps_in_a_loop_match_the_python_runtime(settings):
    """The graph's step, run until it stops, and the runtime's beam search: same sequences."""
    from onnxmerge.runtime import _search as runtime_search
    from onnxmerge.runtime.processors import ProcessorList

    batch, beams, max_new = 2, 3, 6
    resolved = _settings(num_beams=beams, max_new_tokens=max_new, **settings)
    g = StepGraph(f"float[R, V] logits, {BEAM_STATE}, int64 batch, int64 max_length")
    steps = search.Search(resolved, VOCAB, g.v["max_length"], None, g.v["batch"], beams)
    out = search.beam_step(g.ops, steps, g.v["logits"], g.beams())
    best, _ = search.best_sequences(g.ops, out, 1)
    session = g.session(build._own_outputs(g.ops, [*out.carried(), out.keep_going, best]))
    rng = np.random.default_rng(9)
    prompt = rng.standard_normal((batch, VOCAB)).astype(np.float32) * 3
    later = [rng.standard_normal((batch * beams, VOCAB)).astype(np.float32) for _ in range(6)]
    logits = [np.repeat(prompt, beams, 0), *later]  # every beam of an input starts alike
    first = np.full((batch, beams), NEG)
    first[:, 0] = 0.0
    state = [np.full((batch, beams, 1), START), first, np.full((batch, beams, 1), START),
             np.full((batch, beams), NEG), np.zeros((batch, beams), np.int64),
             np.zeros((batch, beams), bool), np.ones((batch, 1), bool)]  # fmt: skip
    for step in logits:
        feeds = dict(zip(_names(BEAM_STATE), state, strict=True))
        *state, keep_going, sequences = session.run(
            None, {**feeds, "logits": step, "batch": np.array(batch), "max_length": np.array(7)}
        )
        if not keep_going:
            break
    # The runtime runs the prompt once per input.
    expected = runtime_search.beam_search(
        _FixedLogits([prompt, *later]), np.full((batch, 1), START), resolved, ProcessorList()
    )
    np.testing.assert_array_equal(sequences, expected)


def test_length_penalty_is_computed_in_double():
    g = StepGraph("int64 length")
    powered = [search._length_penalty(g.ops, g.v["length"], p) for p in (0.6, 1.5)]
    got = g.run(powered, length=np.array(7))
    assert [float(v) for v in got] == [float(np.float32(7**0.6)), float(np.float32(7**1.5))]


def test_best_sequences_cut_to_the_longest_best_hypothesis():
    g = StepGraph(BEAM_STATE)
    sequences, score = search.best_sequences(g.ops, g.beams(), 1)
    feeds = _beam_state(np.random.default_rng(6), length=5)
    feeds["lengths"][:] = [[2, 4], [3, 1]]
    feeds["scores"][:] = [[-0.2, -0.3], [-0.5, -0.6]]
    got = g.run([sequences, score], **feeds)
    np.testing.assert_array_equal(got[0], feeds["sequences"][:, 0, : 1 + 3])
    np.testing.assert_array_equal(got[1], feeds["scores"][:, 0])


# ---------------------------------------------------------------- processors


def _scores(rows: int = 3, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, VOCAB)).astype(np.float32)


@pytest.mark.parametrize("when", [None, True, False])
def test_ban_tokens_sets_fixed_ids_to_minus_infinity(when):
    g = StepGraph("float[R, V] scores, bool flag")
    flag = None if when is None else g.v["flag"]
    banned = processors.ban_tokens(g.ops, g.v["scores"], [1, 5], flag)
    scores = _scores()
    (got,) = g.run([banned], scores=scores, flag=np.array(bool(when)))
    expected = scores.copy()
    if when is not False:
        expected[:, [1, 5]] = -np.inf
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("width", [0, 3])
def test_ban_per_row_bans_active_entries_only(width):
    g = StepGraph("float[R, V] scores, int64[R, N] tokens, bool[R, N] active")
    banned = processors.ban_per_row(g.ops, g.v["scores"], g.v["tokens"], g.v["active"])
    rng = np.random.default_rng(8)
    scores = _scores()
    tokens = rng.integers(0, VOCAB, (3, width))
    active = rng.random((3, width)) < 0.5
    (got,) = g.run([banned], scores=scores, tokens=tokens, active=active)
    expected = scores.copy()
    for row, column in zip(*np.nonzero(active), strict=True):
        expected[row, tokens[row, column]] = -np.inf
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("when", [True, False])
def test_force_keeps_only_the_forced_tokens(when):
    g = StepGraph("float[R, V] scores, bool flag")
    forced = processors._force(g.ops, g.v["scores"], [EOS, 5, VOCAB + 2], VOCAB, g.v["flag"])
    scores = _scores()
    (got,) = g.run([forced], scores=scores, flag=np.array(when))
    expected = np.full_like(scores, -np.inf)
    expected[:, [EOS, 5]] = 0.0
    np.testing.assert_array_equal(got, expected if when else scores)


def test_repetition_penalty_divides_positive_and_multiplies_negative_scores():
    g = StepGraph("float[R, V] scores, int64[R, L] sequences")
    penalised = processors._repetition_penalty(g.ops, g.v["scores"], g.v["sequences"], 1.5)
    scores = _scores()
    sequences = np.array([[START, 4, 4], [START, 5, 0], [START, 6, 2]])
    (got,) = g.run([penalised], scores=scores, sequences=sequences)
    expected = scores.copy()
    for row, seen in enumerate(sequences):
        for token in set(seen.tolist()):
            value = scores[row, token]
            expected[row, token] = value * np.float32(1.5) if value < 0 else value / np.float32(1.5)
    np.testing.assert_array_equal(got, expected)


def _ngram_bans(tokens: list[int], source: list[int], n: int) -> set[int]:
    """Tokens that would end an n-gram of ``source`` which ``tokens`` ends with the start of."""
    prefix = tokens[len(tokens) - (n - 1) :] if n > 1 else []
    if len(tokens) < n - 1:
        return set()
    return {
        source[start + n - 1]
        for start in range(len(source) - n + 1)
        if source[start : start + n - 1] == prefix
    }


def _step_graph_for_processor(encoder: bool) -> StepGraph:
    extra = ", int64[R, S] encoder_ids" if encoder else ""
    return StepGraph(f"float[R, V] scores, int64[R, L] sequences, int64 max_length{extra}")


def _step_values(g: StepGraph) -> processors.StepValues:
    cur_len = g.ops.dim(g.v["sequences"], 1)
    return processors.StepValues(
        g.v["scores"], g.v["sequences"], cur_len, g.v["max_length"], g.v.get("encoder_ids")
    )


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("length", [1, 2, 6])
def test_no_repeat_ngram_bans_what_would_repeat_an_ngram(n, length):
    g = _step_graph_for_processor(encoder=False)
    banned = processors._no_repeat_ngram(g.ops, g.v["scores"], _step_values(g), n)
    sequences = np.array([[START, 4, 5, 4, 5, 4], [START, 6, 6, 6, 4, 6], [START, 4, 5, 6, 0, 1]])
    sequences = sequences[:, :length]
    scores = _scores()
    (got,) = g.run([banned], scores=scores, sequences=sequences, max_length=np.array(9))
    expected = scores.copy()
    for row, tokens in enumerate(sequences.tolist()):
        expected[row, sorted(_ngram_bans(tokens, tokens, n))] = -np.inf
    np.testing.assert_array_equal(got, expected)
    assert length < 3 or np.isinf(got).any()


@pytest.mark.parametrize("length", [1, 2, 4])
def test_encoder_no_repeat_ngram_bans_ngrams_of_the_rows_source(length):
    g = _step_graph_for_processor(encoder=True)
    step = _step_values(g)
    banned = processors._encoder_no_repeat_ngram(g.ops, g.v["scores"], step, step.encoder_ids, 3)
    encoder_ids = np.array([[2, 6, 4, 5, 6, 0], [6, 6, 1, 4, 5, 6], [1, 1, 1, 1, 1, 1]])
    sequences = np.array([[START, 6, 4, 5], [START, 4, 5, 6], [START, 1, 1, 1]])[:, :length]
    scores = _scores()
    (got,) = g.run(
        [banned],
        scores=scores,
        sequences=sequences,
        max_length=np.array(9),
        encoder_ids=encoder_ids,
    )
    expected = scores.copy()
    for row, tokens in enumerate(sequences.tolist()):
        expected[row, sorted(_ngram_bans(tokens, encoder_ids[row].tolist(), 3))] = -np.inf
    np.testing.assert_array_equal(got, expected)


def test_bad_words_ban_single_tokens_and_word_ends_after_their_prefix():
    g = _step_graph_for_processor(encoder=False)
    words = [[5], [4, 6], [EOS], [0, 4, 1]]
    banned = processors._bad_words(g.ops, g.v["scores"], _step_values(g), words, [EOS], VOCAB)
    sequences = np.array([[START, 0, 4], [START, 4, 0], [START, 6, 4]])
    scores = _scores()
    (got,) = g.run([banned], scores=scores, sequences=sequences, max_length=np.array(9))
    expected = scores.copy()
    expected[:, 5] = -np.inf  # always; a bad word equal to eos is dropped
    expected[[0, 2], 6] = -np.inf  # rows ending in 4
    expected[0, 1] = -np.inf  # the row ending in 0, 4
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    ("forced_bos", "length", "banned"), [(None, 1, True), (None, 2, False), (6, 2, True)]
)
def test_begin_suppress_waits_for_a_forced_bos(forced_bos, length, banned):
    from onnxmerge.runtime.processors import build_processors

    g = _step_graph_for_processor(encoder=False)
    settings = _settings(begin_suppress_tokens=[5], forced_bos_token_id=forced_bos)
    processed = processors.apply(g.ops, settings, VOCAB, _step_values(g))
    sequences = np.array([[START, 6][:length]] * 3)
    scores = _scores()
    (got,) = g.run([processed], scores=scores, sequences=sequences, max_length=np.array(9))
    assert np.isneginf(got[:, 5]).all() == banned
    np.testing.assert_array_equal(got, build_processors(settings)(sequences, scores.copy()))


# ---------------------------------------------------------------- assembly


MERGED_TEXT = """<ir_version: 8, opset_import: ["" : 18]>
merged (float[N] x, bool[1] use_cache_branch) => (float[N] logits) {
  shifted = Add(x, x)
  logits = If(use_cache_branch) <
    then_branch = cached () => (float[N] a) { a = Neg(shifted) },
    else_branch = first () => (float[N] b) { b = Abs(shifted) }
  >
}"""


def test_take_branches_removes_the_if_and_keeps_both_decoders():
    model = tm.ir_from_text(MERGED_TEXT)
    branches = build._take_branches(model.graph)
    assert [n.op_type for n in model.graph] == ["Add"] and not model.graph.outputs
    assert [n.op_type for n in branches.first_nodes] == ["Abs"]
    assert [n.op_type for n in branches.cached_nodes] == ["Neg"]
    assert branches.first_all == set(branches.first_nodes)
    for node in branches.first_nodes:
        model.graph.append(node)
    model.graph.outputs.append(branches.first_out["logits"])
    x = np.array([-1.0, 2.0], np.float32)
    (got,) = tm.run_model(model, {"x": x, "use_cache_branch": np.array([False])})
    np.testing.assert_array_equal(got, np.abs(2 * x))


def test_take_branches_refuses_a_model_without_the_if():
    from onnxmerge.errors import InvalidMergedModelError

    model = tm.ir_from_text(
        MERGED_TEXT.replace("If(use_cache_branch)", "If(x_flag)").replace(
            "bool[1] use_cache_branch", "bool[1] x_flag"
        )
    )
    with pytest.raises(InvalidMergedModelError, match="no If node on use_cache_branch"):
        build._take_branches(model.graph)


def test_redirect_changes_only_the_given_nodes_uses():
    model = tm.ir_from_text("""<ir_version: 8, opset_import: ["" : 18]>
g (float[N] x, float[N] y) => (float[N] a, float[N] b) { a = Neg(x) b = Abs(x) }""")
    x, y = model.graph.inputs
    neg, _ = list(model.graph)
    build._redirect(x, {neg}, y)
    args = {"x": np.array([-1.0], np.float32), "y": np.array([5.0], np.float32)}
    assert [float(v[0]) for v in tm.run_model(model, args)] == [-5.0, 1.0]


def test_beam_repeater_repeats_each_input_row_per_beam():
    g = StepGraph("float[B, S] value")
    repeat = build._beam_repeater(g.ops, g.ops.dim(g.v["value"], 0), 3)
    value = np.arange(8, dtype=np.float32).reshape(2, 4)
    (got,) = g.run([repeat(g.v["value"])], value=value)
    np.testing.assert_array_equal(got, np.repeat(value, 3, axis=0))


def test_last_column_is_what_the_next_step_reads():
    g = StepGraph("int64[B, K, L] running")
    running = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    (got,) = g.run([build._last_column(g.ops, g.v["running"])], running=running)
    np.testing.assert_array_equal(got, running[:, :, -1].reshape(-1, 1))


def test_own_outputs_wrap_repeats_in_an_identity():
    g = StepGraph("float[N] x")
    x = g.ops.op("Neg", g.v["x"])
    outputs = build._own_outputs(g.ops, [x, x])
    assert outputs[0] is x and outputs[1] is not x
    got = g.run(outputs, x=np.array([1.0, -2.0], np.float32))
    np.testing.assert_array_equal(got[0], got[1])


def test_vocab_size_comes_from_the_logits_or_the_config():
    from onnxmerge.errors import InvalidMergedModelError

    class Info:  # the contract fields the step reads
        config = {"vocab_size": 11}

    fixed = ir.Value(name="logits", shape=ir.Shape(["batch", 1, 9]))
    symbolic = ir.Value(name="logits", shape=ir.Shape(["batch", 1, "vocab"]))
    assert build._vocab_size(Info(), fixed) == 9
    assert build._vocab_size(Info(), symbolic) == 11
    Info.config = {}
    with pytest.raises(InvalidMergedModelError, match="vocabulary size"):
        build._vocab_size(Info(), symbolic)


@pytest.fixture(scope="module")
def merged_text_model(tmp_path_factory):
    from onnxmerge import merge_seq2seq

    folder = tm.write_export(tmp_path_factory.mktemp("steps") / "export")
    # The two-decoder form, whose branches these steps take apart.
    return merge_seq2seq(folder, folder.parent / "merged" / "model.onnx", format=2)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_first_step_and_cached_decoder_read_the_right_inputs(merged_text_model, num_beams):
    """Both decoders wired into one graph: the first step for every beam, and the cached
    decoder reading given tokens and past with the first step's encoder key/values."""
    from onnxmerge import contract

    model = ir.load(merged_text_model)
    graph = model.graph
    names = [[v.name for v in values] for values in (graph.inputs, graph.outputs)]
    info = contract.read_contract(dict(model.metadata_props), *names)
    branches = build._take_branches(graph)
    inputs = {v.name: v for v in graph.inputs}
    main, body = Ops(Names(), tm.OPSET), Ops(Names("body"), tm.OPSET)
    max_new = ir.Value(name="max_new", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    first = build._first_step(main, info, _settings(), num_beams, branches, inputs, max_new, None)
    cached = build._wire_cached_decoder(body, info, branches, inputs, first)
    for node in branches.first_nodes + main.nodes + branches.cached_nodes + body.nodes:
        graph.append(node)
    graph.inputs.clear()
    graph.inputs.extend([inputs["input_ids"], inputs["attention_mask"], max_new])
    graph.inputs.extend([cached.tokens_in, *cached.past_in])
    graph.outputs.extend([first.logits, first.max_length, first.trips, *first.decoder_presents])
    graph.outputs.extend([cached.logits, *cached.presents])
    graph.sort()

    sample = tm.sample_inputs(seed=2)
    rows = 2 * num_beams
    tokens = np.random.default_rng(3).integers(3, tm.VOCAB, (rows, 1))
    decoder_pasts = contract.past_names(tm.LAYERS, "decoder")
    pasts = [np.repeat(sample[n], num_beams, 0) for n in decoder_pasts]
    feeds = {n: sample[n] for n in ("input_ids", "attention_mask")}
    feeds.update({"max_new": np.array(5), cached.tokens_in.name: tokens})
    feeds.update({v.name: p for v, p in zip(cached.past_in, pasts, strict=True)})
    got = tm.run_model(model, feeds)

    start = {**sample, "decoder_input_ids": np.full((2, 1), START)}
    expected = tm.run_merged(merged_text_model, start, use_cache=False)
    assert int(got[1]) == 5 + 1 and int(got[2]) == 4  # max_length, further steps
    np.testing.assert_allclose(got[0], np.repeat(expected["logits"][:, -1], num_beams, 0))
    presents = contract.present_names(tm.LAYERS, "decoder")
    for value, name in zip(got[3 : 3 + len(presents)], presents, strict=True):
        np.testing.assert_allclose(value, np.repeat(expected[name], num_beams, 0))
    step = {"attention_mask": np.repeat(sample["attention_mask"], num_beams, 0)}
    step.update({"input_ids": np.repeat(sample["input_ids"], num_beams, 0), "next_token": tokens})
    step.update(dict(zip(decoder_pasts, pasts, strict=True)))
    for name in contract.past_names(tm.LAYERS, "encoder"):
        present = name.replace("past_key_values", "present")
        step[name] = np.repeat(expected[present], num_beams, 0)
    reference = tm.run_merged(merged_text_model, step, use_cache=True)
    np.testing.assert_allclose(got[3 + len(presents)], reference["logits"][:, -1], rtol=1e-5)
    for value, name in zip(got[4 + len(presents) :], presents, strict=True):
        np.testing.assert_allclose(value, reference[name], rtol=1e-5)
