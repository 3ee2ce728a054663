"""The greedy head of session-cache entries: its bounds hold for onnxruntime's int8 kernels, and
greedy search through it picks the tokens the float head picks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from tests import textmodels as tm
from tests.smaps import SMAPS, resident_bytes

ort = pytest.importorskip("onnxruntime")

from onnxmerge import Seq2SeqModel, merge_seq2seq, quantize  # noqa: E402
from onnxmerge.errors import GenerationError  # noqa: E402
from onnxmerge.model_io import load_model  # noqa: E402
from onnxmerge.passes import NoMatch  # noqa: E402
from onnxmerge.runtime import processors as p  # noqa: E402
from onnxmerge.runtime._accelerations import Accelerations, FloatHeadBackoff  # noqa: E402
from onnxmerge.runtime._greedy_head import TABLES, GreedyHead, LogitBounds  # noqa: E402
from onnxmerge.runtime._greedy_source import (  # noqa: E402
    ROWS,
    GreedySource,
    find_head,
    row_tables,
)
from onnxmerge.runtime.processors import (  # noqa: E402
    ForcedBOS,
    MinLength,
    NoBadWords,
    ProcessorList,
    RepetitionPenalty,
    SuppressTokens,
)

# The int8 head as the rewrite adds it, alone: what onnxruntime computes for the bounds to hold.
# The codes and scales become initializers, so that onnxruntime pre-packs them as in an entry.
INT8_HEAD = """
<ir_version: 8, opset_import: ["" : 17]>
int8_head (float[R, D] hidden, int8[D, V] codes, float[V] scales) => (float[R, V] logits) {
  q, step, zero = DynamicQuantizeLinear(hidden)
  product = MatMulInteger(q, codes, zero)
  as_float = Cast<to = 1>(product)
  column_scales = Mul(step, scales)
  logits = Mul(as_float, column_scales)
}
"""


def _int8_head(weight: np.ndarray, optimize: bool = True):
    """A function of the hidden rows: the int8 logits onnxruntime computes for ``weight``."""
    tables = row_tables(weight)
    model = onnx.parser.parse_model(INT8_HEAD)
    for name, array in (("codes", np.ascontiguousarray(tables.codes.T)), ("scales", tables.scales)):
        model.graph.initializer.append(onnx.numpy_helper.from_array(array, name))
        model.graph.input.remove(next(i for i in model.graph.input if i.name == name))
    options = ort.SessionOptions()
    if not optimize:  # with optimizations on, onnxruntime fuses the head into one kernel
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return lambda hidden: session.run(None, {"hidden": hidden})[0]


def _head(weight: np.ndarray, bias: np.ndarray | None = None) -> GreedyHead:
    tables = row_tables(weight)
    return GreedyHead(weight, bias, tables.error, tables.l1, tables.amax)


def _hidden_cases(rng: np.random.Generator, size: int) -> list[np.ndarray]:
    normal = rng.standard_normal((3, size)).astype(np.float32)
    outlier = normal.copy()
    outlier[0, 5] = 40.0  # one large value: a coarse quantization step for every row
    return [
        normal,
        np.abs(normal) + 0.3,  # all positive: the zero point sits at the end of the range
        -np.abs(normal[:1]),
        outlier,
        (normal * 1e-3).astype(np.float32),
        np.zeros((2, size), np.float32),
    ]


@pytest.mark.parametrize("optimize", [True, False], ids=["fused", "as-written"])
def test_each_float_logit_lies_within_its_bounds_of_the_int8_logit(optimize):
    rng = np.random.default_rng(0)
    weights = {
        "normal": rng.standard_normal((300, 64)).astype(np.float32) * 0.05,
        "heavy tails": (rng.standard_t(2, (300, 64)) * 0.05).astype(np.float32),
    }
    weights["normal"][7] = 0  # a row of zeros: scale 1, no error
    for name, weight in weights.items():
        head, int8_head = _head(weight), _int8_head(weight, optimize)
        for hidden in _hidden_cases(rng, weight.shape[1]):
            approximate = int8_head(hidden)
            slack = head.bounds(approximate, hidden).slack()
            exact = hidden.astype(np.float64) @ weight.T.astype(np.float64)
            assert (np.abs(exact - approximate) <= slack).all(), name
    # The bounds are not vacuous: for plain inputs, few tokens can still be the largest.
    weight, hidden = weights["normal"], _hidden_cases(rng, 64)[0]
    approximate = _int8_head(weight, optimize)(hidden)
    slack = _head(weight).bounds(approximate, hidden).slack()
    remaining = (approximate + slack >= (approximate - slack).max(axis=1)[:, None]).sum(axis=1)
    assert (remaining < 30).all(), remaining


def _greedy_case(rng, weight, bias, hidden, processors, ids):
    approximate = _int8_head(weight)(hidden) + bias
    picked = _head(weight, bias).bounds(approximate, hidden).argmax(processors, ids)
    full = processors(ids, (hidden @ weight.T + bias).astype(np.float32))
    return picked, np.argmax(full, axis=1)


def test_the_tokens_are_the_float_heads_under_every_processor():
    rng = np.random.default_rng(1)
    vocab, size = 500, 32
    weight = (rng.standard_normal((vocab, size)) * 0.1).astype(np.float32)
    bias = (rng.standard_normal(vocab) * 0.01).astype(np.float32)
    hidden = rng.standard_normal((4, size)).astype(np.float32)
    ids = rng.integers(0, vocab, (4, 3))
    full = hidden @ weight.T + bias
    best = np.argmax(full, axis=1)
    lists = {
        "none": ProcessorList(),
        "the best tokens banned": ProcessorList([NoBadWords([[int(t)] for t in best], ())]),
        "eos too early, where eos is the best": ProcessorList([MinLength(10, [int(best[0])])]),
        "repetition penalty": ProcessorList([RepetitionPenalty(3.0)]),
        "forced first token": ProcessorList([ForcedBOS(11)]),
        # no finite bound: every token's float logit, as argmax over -inf gives token 0
        "every token suppressed": ProcessorList([SuppressTokens(range(vocab))]),
    }
    ids_by_case = {
        "repetition penalty": np.stack([best, best, best], axis=1),
        "forced first token": ids[:, :1],  # forced where the sequence holds one token
    }
    for name, processors in lists.items():
        case_ids = ids_by_case.get(name, ids)
        picked, expected = _greedy_case(rng, weight, bias, hidden, processors, case_ids)
        np.testing.assert_array_equal(picked, expected, err_msg=name)


def test_a_tie_goes_to_the_lower_token_as_argmax_gives_it():
    rng = np.random.default_rng(2)
    weight = (rng.standard_normal((200, 16)) * 0.1).astype(np.float32)
    hidden = rng.standard_normal((2, 16)).astype(np.float32)
    best = np.argmax(hidden @ weight.T, axis=1)
    for row, token in enumerate(best):
        weight[3 + row] = weight[token]  # the same logit at a lower token
    bias = np.zeros(200, np.float32)
    picked, expected = _greedy_case(rng, weight, bias, hidden, ProcessorList(), np.zeros((2, 1)))
    np.testing.assert_array_equal(picked, expected)
    np.testing.assert_array_equal(picked, [3, 4])


def _every_processor(vocab: int) -> list:
    encoder_ids = np.arange(12).reshape(2, 6) % 5
    return [
        p.RepetitionPenalty(1.5),
        p.EncoderRepetitionPenalty(1.5, encoder_ids),
        p.NoRepeatNGram(2),
        p.EncoderNoRepeatNGram(2, encoder_ids),
        p.NoBadWords([[3], [1, 4], [vocab - 1]]),
        p.MinLength(5, [0]),
        p.MinNewTokens(1, 3, [0]),
        p.ForcedBOS(7),
        p.ForcedEOS(5, [0]),
        p.SuppressTokens([2, 9]),
        p.SuppressTokensAtBegin([5], 2),
        p.Temperature(0.5),
        p.TopK(4),
        p.TopP(0.5),
    ]


@pytest.mark.parametrize("length", [1, 2, 3, 4, 6])
def test_a_processor_that_says_it_only_masks_changes_scores_only_to_minus_inf(length):
    rng = np.random.default_rng(length)
    vocab = 40
    ids = rng.integers(0, 5, (4, length))
    said = 0
    for processor in _every_processor(vocab):
        scores = rng.standard_normal((4, vocab)).astype(np.float32)
        processed = processor(ids, scores.copy())
        if getattr(processor, "masks_only", lambda ids: False)(ids):
            said += 1
            changed = processed != scores
            assert (processed[changed] == -np.inf).all(), type(processor).__name__
    assert said >= 7  # the masks, and the forced tokens away from their step
    forced_at_their_step = ProcessorList([p.ForcedBOS(7), p.ForcedEOS(2, [0])])
    assert not forced_at_their_step.masks_only(ids[:, :1])
    assert ProcessorList([p.MinLength(5, [0])]).masks_only(ids)
    assert not ProcessorList([p.MinLength(5, [0]), p.RepetitionPenalty(1.5)]).masks_only(ids)


def test_masks_take_the_short_way_to_the_float_heads_tokens(monkeypatch):
    """Where the processors only mask, one pass finds each row's candidates (no bound arrays):
    the tokens are still the float head's, over bans that hit the best tokens, whole rows
    masked but a few, every token masked, and a row of NaN."""
    short = []
    original = LogitBounds._argmax_of_unmasked
    monkeypatch.setattr(
        LogitBounds,
        "_argmax_of_unmasked",
        lambda self, *args: short.append(1) or original(self, *args),
    )
    rng = np.random.default_rng(4)
    vocab, size, rows = 300, 24, 6
    for case in range(12):
        weight = (rng.standard_normal((vocab, size)) * 0.1).astype(np.float32)
        bias = (rng.standard_normal(vocab) * 0.01).astype(np.float32)
        hidden = rng.standard_normal((rows, size)).astype(np.float32)
        best = np.argmax(hidden @ weight.T + bias, axis=1)
        ids = np.stack([best, rng.integers(0, vocab, rows), best], axis=1)
        processors = ProcessorList(
            [
                p.NoRepeatNGram(2),  # bans the best token of rows whose last two repeat
                p.NoBadWords([[int(best[case % rows])], [int(best[0]), int(best[1])]]),
                p.SuppressTokens(range(case * 20, case * 20 + 200) if case % 3 == 0 else ()),
                p.SuppressTokens(range(vocab) if case == 5 else ()),
            ]
        )
        if case == 7:
            hidden[2] = np.nan
        picked, expected = _greedy_case(rng, weight, bias, hidden, processors, ids)
        np.testing.assert_array_equal(picked, expected, err_msg=f"case {case}")
    assert len(short) == 12


# -- the rewrite ---------------------------------------------------------------------------------


def _merged(tmp_path_factory, head: str, format: int | None = None) -> Path:
    folder = tm.write_export(tmp_path_factory.mktemp("greedy") / "export", head=head)
    config = json.loads((folder / "config.json").read_text())
    ids = {"eos_token_id": 0, "pad_token_id": 1, "decoder_start_token_id": 2}
    config.update(ids, is_encoder_decoder=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps(ids))
    return merge_seq2seq(folder, tmp_path_factory.mktemp(head) / "model.onnx", format=format)


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    return _merged(tmp_path_factory, "tied")


@pytest.fixture(scope="module")
def int8(tied, tmp_path_factory) -> Path:
    return quantize(tied, tmp_path_factory.mktemp("int8") / "model.onnx", weights="int8")


def test_the_head_is_found_where_it_reads_the_embeddings_rows(tied, int8):
    head = find_head(load_model(tied)[0])
    assert not isinstance(head, NoMatch), head
    assert head.weight.shape == (tm.VOCAB, tm.D_MODEL) and head.bias is not None
    # An int8 file's head is already int8, an integer product that writes the logits itself:
    # nothing to add, and the reason says why.
    reason = NoMatch("the logits come from a Mul, not a float head (a MatMul, or a Gemm reshaped)")
    assert find_head(load_model(int8)[0]) == reason


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    return _merged(tmp_path_factory, "untied")


@pytest.fixture(scope="module")
def untied_format_2(tmp_path_factory) -> Path:
    """Both decoders under the If: each branch ends with its own MatMul by the weight."""
    return _merged(tmp_path_factory, "untied", format=2)


def test_an_untied_head_is_found_as_exported_and_its_rows_are_stored_once(untied, tmp_path):
    head = find_head(load_model(untied)[0])
    assert not isinstance(head, NoMatch), head
    assert head.columns and head.weight.shape == (tm.D_MODEL, tm.VOCAB)
    np.testing.assert_array_equal(head.rows(), tm.make_weights(1)[tm.LM_HEAD].T)
    Seq2SeqModel(untied, session_cache=tmp_path / "cache")
    (entry,) = (tmp_path / "cache").iterdir()
    graph = onnx.load(entry / "model.onnx", load_external_data=False).graph
    stored = {tensor.name for tensor in graph.initializer}
    # The float head reads the weight's rows, which replace the weight: one float copy.
    assert ROWS in stored and tm.LM_HEAD not in stored


@pytest.mark.parametrize("merged", ["untied", "untied_format_2"])
def test_greedy_search_with_an_untied_head_gives_the_float_heads_tokens(
    merged, request, tmp_path, monkeypatch, screen_every_step
):
    untied = request.getfixturevalue(merged)
    head = find_head(load_model(untied)[0])
    assert not isinstance(head, NoMatch) and head.columns, head
    assert len(head.products) == (2 if merged == "untied_format_2" else 1)
    plain = Seq2SeqModel(untied)
    cached = Seq2SeqModel(untied, session_cache=tmp_path / "cache", accelerations=screen_every_step)
    assert cached._session.greedy_head is not None
    steps = []
    bounds = GreedyHead.bounds
    monkeypatch.setattr(GreedyHead, "bounds", lambda self, *a: steps.append(1) or bounds(self, *a))
    for settings in SETTINGS:
        np.testing.assert_array_equal(_generate(cached, **settings), _generate(plain, **settings))
    assert len(steps) >= 4 * 7
    # Not every token repeats: the outputs test the head, not one row of it.
    assert len(np.unique(_generate(plain))) > 3


def test_costly_steps_send_the_next_steps_to_the_float_head_4_then_8_steps():
    # Two screened steps that cost more than the float head, then cheap ones: the float head
    # runs 4, then 8 steps, and every step after a cheap one is screened.
    backoff = FloatHeadBackoff(Accelerations())
    shares = iter([1.0, 1.0] + [0.0] * 40)
    screened, last = [], None
    for step in range(19):
        last = next(shares) if backoff.next_is_screened(last) else None
        if last is not None:
            screened.append(step)
    assert screened == [0, 5, 14, 15, 16, 17, 18]


# The tiny model's logits are flat: a screened step takes some tokens in float, which with no
# share or count cheap enough is costly; the float head then runs 2 steps, then 4 at most.
BACKING_OFF = Accelerations(
    greedy_cheaper_below=0.0,
    greedy_gather_below=1,
    greedy_first_float_steps=2,
    greedy_most_float_steps=4,
)
BACKED_OFF_STEPS = [0, 3, 8, 13, 18]  # of 19 cached steps: screened, 2 float, 4 float, ...


def _screened_steps(model: Seq2SeqModel, monkeypatch) -> list[tuple[int, bool]]:
    """(thread, whether screened) of each cached step the model runs from now on."""
    import threading

    seen: list[tuple[int, bool]] = []
    session = model._session
    next_step = session.next_step

    def noted(*args, greedy=False, **kwargs):
        seen.append((threading.get_ident(), greedy))
        return next_step(*args, greedy=greedy, **kwargs)

    monkeypatch.setattr(session, "next_step", noted)
    return seen


def test_the_float_head_runs_as_the_settings_say_and_the_tokens_stay(tied, tmp_path, monkeypatch):
    cached = Seq2SeqModel(tied, session_cache=tmp_path / "cache", accelerations=BACKING_OFF)
    seen = _screened_steps(cached, monkeypatch)
    plain = Seq2SeqModel(tied, accelerations=Accelerations.off())
    twenty = {"min_new_tokens": 20, "max_new_tokens": 20}
    expected = _generate(plain, **twenty)
    np.testing.assert_array_equal(_generate(cached, **twenty), expected)
    assert [i for i, (_, greedy) in enumerate(seen) if greedy] == BACKED_OFF_STEPS
    # A later search starts afresh: what the first found was its own.
    seen.clear()
    np.testing.assert_array_equal(_generate(cached, **twenty), expected)
    assert [i for i, (_, greedy) in enumerate(seen) if greedy] == BACKED_OFF_STEPS
    screening = Seq2SeqModel(
        tied, session_cache=tmp_path / "cache", accelerations=Accelerations(greedy_cheaper_below=1)
    )
    seen = _screened_steps(screening, monkeypatch)
    np.testing.assert_array_equal(_generate(screening, **twenty), expected)
    assert all(greedy for _, greedy in seen) and len(seen) == 19


def test_batches_at_once_each_keep_their_own_back_off(tied, tmp_path, monkeypatch):
    cached = Seq2SeqModel(
        tied, session_cache=tmp_path / "cache", threads=1, accelerations=BACKING_OFF
    )
    sample = tm.sample_inputs(seed=6, batch=8)
    pairs = zip(sample["input_ids"], sample["attention_mask"], strict=True)
    inputs = [ids[mask == 1] for ids, mask in pairs]
    twenty = {"min_new_tokens": 20, "max_new_tokens": 20, "max_batch_size": 2}
    one_at_a_time = list(cached.generate_many(inputs, **twenty))
    seen = _screened_steps(cached, monkeypatch)
    at_once = list(cached.generate_many(inputs, parallel_batches=2, **twenty))
    for one, other in zip(at_once, one_at_a_time, strict=True):
        np.testing.assert_array_equal(one, other)
    # Each thread ran whole searches one after another: 19 cached steps each, every one backing
    # off from its own first step, whatever the other thread's search did meanwhile.
    threads = {thread for thread, _ in seen}
    assert len(seen) == 4 * 19 and len(threads) == 2
    for thread in threads:
        flags = [greedy for t, greedy in seen if t == thread]
        for search in range(0, len(flags), 19):
            steps = flags[search : search + 19]
            assert [i for i, greedy in enumerate(steps) if greedy] == BACKED_OFF_STEPS


def test_a_step_with_many_tokens_left_takes_one_product_over_all_rows():
    # Flat logits leave many tokens within the bounds: gathering each one's row would cost more
    # (and hold more memory) than the product over every row.
    rng = np.random.default_rng(3)
    weight = (rng.standard_normal((4000, 32)) * 0.01).astype(np.float32)
    head = _head(weight)
    hidden = rng.standard_normal((6, 32)).astype(np.float32)
    hidden[0, 5] = 40.0  # a coarse quantization step for every row: wide bounds
    expected = np.argmax(hidden @ weight.T, axis=1)
    counted = Accelerations(greedy_gather_below=1)
    bounds = head.bounds(_int8_head(weight)(hidden), hidden, accelerations=counted)
    tokens = bounds.argmax(ProcessorList(), np.zeros((6, 1), np.int64))
    np.testing.assert_array_equal(tokens, expected)
    assert bounds.float_share > 0.99  # every row whole
    # By default fewer than greedy_gather_below tokens are gathered, whatever their share.
    bounds = head.bounds(_int8_head(weight)(hidden), hidden)
    tokens = bounds.argmax(ProcessorList(), np.zeros((6, 1), np.int64))
    np.testing.assert_array_equal(tokens, expected)
    assert 0 < bounds.float_tokens < Accelerations().greedy_gather_below
    assert bounds.float_share < 0.25
    assert not FloatHeadBackoff(Accelerations()).costly(bounds.float_share, bounds.float_tokens)


@pytest.mark.skipif(not SMAPS.exists(), reason="reads Linux's smaps")
def test_the_heads_rows_read_by_a_costly_step_are_dropped_and_read_back(tied, tmp_path):
    head = Seq2SeqModel(tied, session_cache=tmp_path / "cache")._session.greedy_head
    address = head.weight.ctypes.data
    expected = np.array(head.weight)  # every row read: all resident
    assert resident_bytes(address) >= head.weight.nbytes
    head.drop_pages(slice(0, tm.VOCAB // 2))
    head.drop_pages(slice(tm.VOCAB // 2, None))
    assert resident_bytes(address) == 0
    np.testing.assert_array_equal(head.weight, expected)  # read back from the file


def test_a_head_outside_a_file_mapping_keeps_its_rows():
    # Dropping the pages of anonymous memory would read back zeros.
    weight = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    head = _head(weight.copy())
    head.drop_pages()
    np.testing.assert_array_equal(head.weight, weight)


def test_an_untied_head_whose_weight_is_read_elsewhere_is_left_alone(untied):
    model = load_model(untied)[0]
    head = find_head(model)
    assert not isinstance(head, NoMatch)
    # A second copy of the rows would cost what the int8 head saves.
    seen = ir.node("Identity", [head.weight], name="also_reads_the_head")
    model.graph.append(seen)
    model.graph.outputs.append(seen.outputs[0])
    assert find_head(model) == NoMatch("the head's weight is read by other nodes too")


def _generate(model: Seq2SeqModel, **settings) -> np.ndarray:
    inputs = tm.sample_inputs(seed=5, batch=3)
    return model.generate(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        **{"max_new_tokens": 8, **settings},
    )


SETTINGS = [
    {},
    {"repetition_penalty": 1.5},
    {"no_repeat_ngram_size": 2, "min_length": 6},
    {"forced_bos_token_id": 7, "bad_words_ids": [[5], [9]]},
    {"num_beams": 3},
]


@pytest.fixture
def screen_every_step():
    """The tiny models' logits are flat: the runner would soon turn to the float head, unless
    no share of float logits counts as costly."""
    return Accelerations(greedy_cheaper_below=1.0)


def test_greedy_search_through_the_cache_entry_gives_the_float_heads_tokens(
    tied, tmp_path, monkeypatch, screen_every_step
):
    plain = Seq2SeqModel(tied)
    cached = Seq2SeqModel(tied, session_cache=tmp_path / "cache", accelerations=screen_every_step)
    assert cached._session.greedy_head is not None
    (entry,) = (tmp_path / "cache").iterdir()
    assert (entry / TABLES).is_file() and not (entry / "source").exists()
    steps = []
    bounds = GreedyHead.bounds
    monkeypatch.setattr(GreedyHead, "bounds", lambda self, *a: steps.append(1) or bounds(self, *a))
    for settings in SETTINGS:
        np.testing.assert_array_equal(_generate(cached, **settings), _generate(plain, **settings))
    assert len(steps) >= 4 * 7  # greedy steps after the first went through the int8 head
    steps.clear()
    _generate(cached, do_sample=True, seed=3)
    assert not steps  # sampling needs every probability


def test_a_head_without_a_bias_gives_the_float_heads_tokens(tmp_path_factory, tmp_path):
    unbiased = _merged(tmp_path_factory, "tied-no-bias")
    head = find_head(load_model(unbiased)[0])
    assert not isinstance(head, NoMatch), head
    assert head.bias is None
    cached = Seq2SeqModel(unbiased, session_cache=tmp_path / "cache")
    assert cached._session.greedy_head is not None and cached._session.greedy_head.bias is None
    plain = Seq2SeqModel(unbiased)
    for settings in SETTINGS[:3]:
        np.testing.assert_array_equal(_generate(cached, **settings), _generate(plain, **settings))


def test_a_bias_stored_as_one_by_one_by_vocab_gives_the_float_heads_tokens(tied, tmp_path):
    # Marian's final_logits_bias is [1, vocab]; a Gemm's third operand takes no more axes.
    proto = onnx.load(tied)
    (bias,) = [t for t in proto.graph.initializer if t.name == tm.FINAL_BIAS]
    bias.dims[:] = [1, 1, tm.VOCAB]
    reshaped = tmp_path / "model.onnx"
    onnx.save(proto, reshaped)
    cached = Seq2SeqModel(reshaped, session_cache=tmp_path / "cache")
    assert cached._session.greedy_head is not None
    plain = Seq2SeqModel(tied)
    for settings in (SETTINGS[0], SETTINGS[-1]):
        np.testing.assert_array_equal(_generate(cached, **settings), _generate(plain, **settings))


@pytest.mark.parametrize("damage", ["not an archive", "cut short", "another vocabulary"])
def test_an_entry_whose_tables_do_not_read_runs_the_float_head(tied, tmp_path, damage):
    cache = tmp_path / "cache"
    expected = _generate(Seq2SeqModel(tied))
    Seq2SeqModel(tied, session_cache=cache)
    (entry,) = cache.iterdir()
    tables = entry / TABLES
    if damage == "not an archive":
        tables.write_bytes(b"not an archive")
    elif damage == "cut short":  # e.g. a disk that filled up while it was written
        tables.write_bytes(tables.read_bytes()[: tables.stat().st_size // 2])
    else:
        with np.load(tables) as saved:
            arrays = dict(saved)
        np.savez(tables, **{**arrays, "error": arrays["error"][:-1]})
    model = Seq2SeqModel(tied, session_cache=cache)
    assert model._session.greedy_head is None
    assert model._session.opened == entry / "model.onnx"
    np.testing.assert_array_equal(_generate(model), expected)
    with pytest.raises(GenerationError, match="no greedy head"):
        model._session.next_step(np.zeros((1, 1), np.int64), None, greedy=True)


def test_a_greedy_head_that_fails_leaves_a_plain_entry(tied, tmp_path, monkeypatch):
    def refuse(self, saved):
        raise ValueError("the optimized graph changed the weight")

    monkeypatch.setattr(GreedySource, "write_tables", refuse)
    cache = tmp_path / "cache"
    model = Seq2SeqModel(tied, session_cache=cache)
    assert model._session.wrote_cache_entry and model._session.greedy_head is None
    (entry,) = cache.iterdir()
    assert sorted(p.name for p in entry.iterdir()) == ["model.onnx", "model.onnx_data"]
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]
    np.testing.assert_array_equal(_generate(model), _generate(Seq2SeqModel(tied)))


def test_models_without_a_tied_float_head_get_a_plain_entry(int8, tmp_path):
    model = Seq2SeqModel(int8, session_cache=tmp_path / "cache")
    (entry,) = (tmp_path / "cache").iterdir()
    assert not (entry / TABLES).exists()
    assert model._session.greedy_head is None
    np.testing.assert_array_equal(_generate(model), _generate(Seq2SeqModel(int8)))


def test_the_codes_keep_onnxruntimes_int16_sums_exact():
    # Without VNNI, onnxruntime's x86 kernels add two uint8 x int8 products in int16 at a time.
    rng = np.random.default_rng(4)
    weight = (rng.standard_t(2, (50, 8)) * 3).astype(np.float32)
    tables = row_tables(weight)
    assert np.abs(tables.codes).max() == 63  # 255 * 63 * 2 fits in int16; 255 * 127 * 2 does not
    assert (tables.error <= tables.scales / 2 * (1 + 1e-6)).all()


def test_the_rewrite_runs_in_a_process_that_imported_nothing_else(tied, tmp_path):
    # The cache imports the rewrite on its own: every module it needs must be imported by it.
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from onnxmerge.runtime._greedy_source import write_greedy_source\n"
        "print(write_greedy_source(Path(sys.argv[1]), Path(sys.argv[2])) is not None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tied), str(tmp_path / "source")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_the_entrys_logits_leave_the_head_without_a_copy(tied, tmp_path):
    # onnxruntime copies a graph output that a Reshape or an Add inside a branch makes: the
    # logits of every step, [rows, vocab], once more.
    model = Seq2SeqModel(tied, session_cache=tmp_path / "cache")
    (entry,) = (tmp_path / "cache").iterdir()
    graph = onnx.load(entry / "model.onnx", load_external_data=False).graph
    (producer,) = [n for n in graph.node if "logits" in n.output]
    assert producer.op_type == "If"
    (float_head,) = [a.g for a in producer.attribute if a.name == "else_branch"]
    assert [(n.op_type, len(n.input)) for n in float_head.node] == [("Gemm", 3)]
    (logits,) = [o for o in graph.output if o.name == "logits"]
    assert len(logits.type.tensor_type.shape.dim) == 2
    # The runtime gives them the shape of every other model's: [rows, new tokens, vocab].
    inputs = tm.sample_inputs(seed=5, batch=3)
    step = model._session.first_step(
        {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]},
        np.full((3, 1), 2, np.int64),
    )
    plain = Seq2SeqModel(tied)._session.first_step(
        {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]},
        np.full((3, 1), 2, np.int64),
    )
    assert step.logits.shape == plain.logits.shape == (3, 1, tm.VOCAB)
    np.testing.assert_allclose(step.logits, plain.logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("processors", "array"),
    [(ProcessorList(), "mask"), (ProcessorList([RepetitionPenalty(1.5)]), "lower")],
    ids=["masks only", "bounds"],
)
def test_a_searchs_steps_work_in_the_same_arrays(processors, array):
    """Each greedy step's bounds reuse the search's arrays: fresh [rows, vocab] arrays every step
    cost their page faults again (a third of a float32 greedy corpus on the opus-mt shape)."""
    from onnxmerge.runtime._memory import Workspace

    rng = np.random.default_rng(3)
    weight = (rng.standard_normal((400, 32)) * 0.1).astype(np.float32)
    head, int8_head, space = _head(weight), _int8_head(weight), Workspace()
    addresses = set()
    for rows in (4, 4, 3):  # a search whose rows shrink keeps its arrays
        hidden = rng.standard_normal((rows, 32)).astype(np.float32)
        ids = np.full((rows, 1), 399)
        picked = head.bounds(int8_head(hidden), hidden, space).argmax(processors, ids)
        expected = np.argmax(processors(ids, hidden @ weight.T), axis=1)
        np.testing.assert_array_equal(picked, expected)
        kept = space.array(array, (rows, 400), np.float32 if array == "lower" else bool)
        assert kept.any(axis=1).all()  # the step's own values: a new mapping reads as zeros
        addresses.add(kept.ctypes.data)
    assert len(addresses) == 1


def test_switched_off_the_head_and_the_cache_leave_the_tokens(tied, tmp_path):
    cache = tmp_path / "cache"
    expected = _generate(Seq2SeqModel(tied, session_cache=cache))
    float_head = Seq2SeqModel(
        tied, session_cache=cache, accelerations=Accelerations(greedy_head=False)
    )
    assert float_head._session.greedy_head is None
    assert float_head._session.opened.parent.parent == cache  # the entry, run without its head
    np.testing.assert_array_equal(_generate(float_head), expected)
    plain = Seq2SeqModel(tied, session_cache=cache, accelerations=Accelerations.off())
    assert plain._session.opened == tied  # the cache is not used at all
    for settings in SETTINGS:
        np.testing.assert_array_equal(
            _generate(plain, **settings), _generate(float_head, **settings)
        )


class _WeighedTogether:
    """Masks nothing; sets every token below ``begin`` to -inf where the tokens from ``begin`` on
    weigh more together (their logsumexp) than the largest below: Whisper's timestamp rule,
    which reads its columns as a whole and so needs their float logits."""

    keeps_bounds = True

    def __init__(self, begin: int, exact: bool):
        self.begin, self.exact = begin, exact

    def exact_columns(self, input_ids: np.ndarray) -> slice | None:
        return slice(self.begin, None) if self.exact else None

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        for row in scores:
            together = np.logaddexp.reduce(row[self.begin :].astype(np.float64))
            if together > row[: self.begin].max():
                row[: self.begin] = -np.inf
        return scores


def test_columns_read_as_a_whole_get_float_logits_and_the_tokens_stay():
    # Near the rule's edge, bounds on the columns' logits decide it one way on the lower bounds
    # and the other on the upper ones: only their float logits give the float head's token.
    rng = np.random.default_rng(4)
    vocab, size, begin = 400, 32, 380
    agree = {True: 0, False: 0}
    for _ in range(60):
        weight = (rng.standard_normal((vocab, size)) * 0.05).astype(np.float32)
        head, int8 = _head(weight), _int8_head(weight)
        hidden = rng.standard_normal((4, size)).astype(np.float32)
        hidden[0, 5] = 30.0  # coarse quantization: wide bounds
        logits = hidden @ weight.T
        # Lift the columns so that their logsumexp sits at the largest token below them.
        lift = logits[:, :begin].max(axis=1) - np.logaddexp.reduce(logits[:, begin:], axis=1)
        weight_rows = np.linalg.lstsq(hidden, lift + rng.normal(0, 0.01, 4), rcond=None)[0]
        weight[begin:] += weight_rows.astype(np.float32)
        head, int8 = _head(weight), _int8_head(weight)
        ids = np.zeros((4, 1), np.int64)
        expected = np.argmax(_WeighedTogether(begin, True)(ids, hidden @ weight.T), axis=1)
        for exact in (True, False):
            bounds = head.bounds(int8(hidden), hidden)
            tokens = bounds.argmax(_WeighedTogether(begin, exact), ids)
            agree[exact] += int((tokens == expected).all())
    assert agree[True] == 60, agree
    assert agree[False] < 60, agree  # without them the bounds pick other tokens: the test can fail


@pytest.mark.skipif(not SMAPS.exists(), reason="reads Linux's smaps")
def test_a_row_read_from_the_heads_mapping_maps_its_own_pages_only(tmp_path):
    # Without MADV_RANDOM a read fault reads ahead and maps the pages around it too (64 KB and
    # more): a screened step's few hundred candidate rows mapped 16 pages each, for the page
    # release to drop again. The session's page release leaves the rows out of the page cache
    # (GatheredPages), as the fadvise below does.
    import os

    from onnxmerge.runtime._greedy_head import write_tables

    vocab, width = 4096, 256  # 4 MB of rows, 1 KB each
    weight = np.random.default_rng(0).standard_normal((vocab, width)).astype(np.float32)
    with open(tmp_path / "rows.bin", "wb") as file:
        file.write(weight.tobytes())
        file.flush()
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    tables = row_tables(weight)
    write_tables(
        tmp_path,
        weight_file="rows.bin",
        weight_offset=0,
        weight_shape=(vocab, width),
        bias=None,
        error=tables.error,
        l1=tables.l1,
        amax=tables.amax,
    )
    head = GreedyHead.load(tmp_path)
    assert head is not None
    head.drop_pages()
    assert resident_bytes(head.weight.ctypes.data) == 0
    np.testing.assert_array_equal(head.weight[1000], weight[1000])
    assert resident_bytes(head.weight.ctypes.data) <= 8192
