"""Seq2SeqModel.generate() on merged tiny models: the same tokens as transformers' generate()."""

from __future__ import annotations

import numpy as np
import pytest

from onnxmerge.runtime.processors import build_processors
from tests.zoo import ARCHITECTURES

pytestmark = pytest.mark.export

pytest.importorskip("onnxruntime")
# torch is imported where used, not at collection (the zoo's fixture skips without it).

# GPT-2-style decoders of vision-encoder-decoder cannot be merged with past; tested without past.
WITH_PAST = tuple(a for a in ARCHITECTURES if a != "vision-encoder-decoder")

# Run on every architecture: what the runtime must reproduce everywhere (batch of 2 with padding).
CASES = {
    "greedy": {},
    "beam3": {"num_beams": 3},
    "beam3-ngram-penalty": {"num_beams": 3, "no_repeat_ngram_size": 2, "repetition_penalty": 1.3},
    "lengths-forced": {
        "min_new_tokens": 3,
        "max_new_tokens": 7,
        "forced_bos_token_id": 5,
        "forced_eos_token_id": 2,
    },
}
# Search options whose logic does not depend on the architecture: run on a few.
MORE_CASES = {
    "beam3-return2-early": {
        "num_beams": 3,
        "num_return_sequences": 2,
        "early_stopping": True,
        "length_penalty": 0.6,
    },
    "beam4-never": {"num_beams": 4, "early_stopping": "never", "length_penalty": 1.5},
    "beam-lengths-forced": {
        "num_beams": 3,
        "min_length": 5,
        "max_length": 9,
        "forced_bos_token_id": 6,
        "forced_eos_token_id": 2,
    },
    "suppress-bad-words": {
        "suppress_tokens": [7, 9, 11],
        "begin_suppress_tokens": [13, 2],
        "bad_words_ids": [[5], [8, 10]],
    },
}
MORE_CASES_ARCHS = ("marian", "t5", "whisper")

_models: dict = {}


def _quiet_options():
    """One thread, no spin-waiting: onnxruntime's idle threads would slow torch down in turn."""
    from onnxmerge._ort import session_options

    return session_options(threads=1, spinning=False)


@pytest.fixture(scope="session")
def merged(tiny_export, tmp_path_factory):
    """``merged(arch, variant)`` -> (Seq2SeqModel, transformers model, export), built once."""
    import onnxmerge
    from tests import zoo

    def get(arch: str, variant: str = "default"):
        key = (arch, variant)
        if key not in _models:
            export = tiny_export(arch, variant)
            out = tmp_path_factory.mktemp(f"{arch}-{variant}") / "model.onnx"
            onnxmerge.merge_seq2seq(export.onnx_dir, out)
            _models[key] = (
                onnxmerge.Seq2SeqModel(out, session_options=_quiet_options()),
                zoo.load_pytorch(export),
                export,
            )
        return _models[key]

    return get


def _reference(pt_model, inputs: dict[str, np.ndarray], **kwargs) -> np.ndarray:
    import torch
    from transformers import GenerationMixin

    tensors = {k: torch.from_numpy(v) for k, v in inputs.items()}
    kwargs = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    with torch.no_grad():
        # Whisper's own generate() strips the prompt and eos; the generic loop returns the
        # encoder-decoder layout every other model gets (compared separately below).
        return GenerationMixin.generate(pt_model, **tensors, **kwargs).numpy()


def _check(model, pt_model, inputs, **kwargs) -> np.ndarray:
    expected = _reference(pt_model, inputs, **kwargs)
    actual = model.generate(**inputs, **kwargs)
    assert actual.dtype == np.int64
    assert actual.shape == expected.shape, (actual, expected)
    np.testing.assert_array_equal(actual, expected)
    return actual


def _searches():
    for archs, cases, seed in ((WITH_PAST, CASES, 1), (MORE_CASES_ARCHS, MORE_CASES, 2)):
        for case, settings in cases.items():
            for arch in archs:
                yield pytest.param(arch, settings, seed, id=f"{arch}-{case}")


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "settings", "seed"), _searches())
def test_generate_matches_transformers(merged, arch, settings, seed):
    from tests import zoo

    model, pt_model, export = merged(arch)
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=seed)
    out = _check(model, pt_model, inputs, **settings)
    assert out.shape[0] == 2 * settings.get("num_return_sequences", 1)
    assert (out[:, 0] == model.resolve_settings().decoder_start_token_id).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "variant"),
    [
        ("marian", "no-past"),
        ("t5", "no-past"),
        ("vision-encoder-decoder", "no-past"),
        ("marian", "merged-only"),
    ],
)
def test_generate_other_layouts(merged, arch, variant):
    from tests import zoo

    model, pt_model, export = merged(arch, variant)
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=6, seed=2)
    _check(model, pt_model, inputs)
    _check(model, pt_model, inputs, num_beams=3, no_repeat_ngram_size=2)


def test_generation_config_defaults_are_used(merged):
    """Settings come from the embedded generation config: blenderbot's encoder n-gram ban."""
    from tests import zoo

    model, pt_model, export = merged("blenderbot")
    assert model.resolve_settings().encoder_no_repeat_ngram_size == 3
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=9, seed=3)
    _check(model, pt_model, inputs, num_beams=2)


def test_default_max_length_is_twenty_new_tokens(merged):
    from tests import zoo

    model, pt_model, export = merged("t5")
    settings = model.resolve_settings()
    assert settings.max_length == 21  # 20 new tokens after the start token
    assert model.resolve_settings(max_new_tokens=4).max_length == 5
    assert model.resolve_settings(max_length=9).max_length == 9
    inputs = zoo.sample_encoder_inputs(export, batch=1, seq=5, seed=0)
    assert model.generate(**inputs, min_new_tokens=25, max_new_tokens=25).shape == (1, 26)


def test_decoder_prompt_is_continued(merged):
    from tests import zoo

    model, pt_model, export = merged("bart")
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=4)
    start = model.resolve_settings().decoder_start_token_id
    prompt = np.array([[start, 20, 21], [start, 22, 23]], dtype=np.int64)
    out = _check(model, pt_model, inputs, decoder_input_ids=prompt, max_new_tokens=6)
    np.testing.assert_array_equal(out[:, :3], prompt)
    # Without the start token, it is prepended, as transformers does.
    out2 = _check(model, pt_model, inputs, decoder_input_ids=prompt[:, 1:], num_beams=2)
    assert (out2[:, 0] == start).all()


def test_whisper_tokens_match_whispers_own_generate(merged):
    import torch

    from tests import zoo

    model, pt_model, export = merged("whisper")
    inputs = zoo.sample_encoder_inputs(export, batch=2, seed=5)
    settings = {"suppress_tokens": [5, 9], "begin_suppress_tokens": [2, 13], "max_new_tokens": 9}
    ours = model.generate(**inputs, **settings)
    with torch.no_grad():
        own = pt_model.generate(**{k: torch.from_numpy(v) for k, v in inputs.items()}, **settings)
    own = own.numpy()
    # Whisper's generate() returns the generated tokens without the prompt and the final eos.
    np.testing.assert_array_equal(ours[:, 1 : 1 + own.shape[1]], own)
    assert not np.isin(ours[:, 1:], [5, 9]).any()


@pytest.mark.parametrize(
    ("arch", "variant"), [("whisper", "default"), ("vision-encoder-decoder", "no-past")]
)
@pytest.mark.parametrize("settings", [{}, {"num_beams": 3}], ids=["greedy", "beam3"])
def test_generate_many_takes_each_input_as_a_mapping_without_the_batch_axis(
    merged, arch, variant, settings
):
    from tests import zoo

    model, pt_model, export = merged(arch, variant)
    ((name, batch),) = zoo.sample_encoder_inputs(export, batch=5, seed=7).items()
    settings = {"max_new_tokens": 6, **settings}
    got = list(model.generate_many([{name: row} for row in batch], max_batch_size=2, **settings))
    assert len(got) == 5
    for row, result in zip(batch, got, strict=True):
        np.testing.assert_array_equal(result, _reference(pt_model, {name: row[None]}, **settings))


def test_attention_mask_is_inferred_from_padding(merged):
    from tests import zoo

    model, pt_model, export = merged("marian")
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=6)
    del inputs["attention_mask"]
    _check(model, pt_model, inputs, num_beams=2)


# -- sampling --------------------------------------------------------------------------------------


def test_sampling_is_reproducible_with_a_seed(merged):
    from tests import zoo

    model, _, export = merged("marian")
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=7)
    a = model.generate(**inputs, do_sample=True, seed=123, max_new_tokens=12)
    b = model.generate(**inputs, do_sample=True, seed=123, max_new_tokens=12)
    np.testing.assert_array_equal(a, b)
    others = [model.generate(**inputs, do_sample=True, seed=s, max_new_tokens=12) for s in range(4)]
    assert any(o.shape != a.shape or (o != a).any() for o in others)
    three = model.generate(**inputs, do_sample=True, seed=1, num_return_sequences=3)
    assert three.shape[0] == 6


def test_sampling_with_top_k_one_is_greedy(merged):
    from tests import zoo

    model, _, export = merged("t5")
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=8)
    greedy = model.generate(**inputs)
    sampled = model.generate(**inputs, do_sample=True, top_k=1, seed=9)
    np.testing.assert_array_equal(sampled, greedy)


FILTERS = [
    {"top_k": 4},
    {"top_p": 0.5, "top_k": 0},
    {"top_k": 6, "top_p": 0.8, "temperature": 0.7},
]


@pytest.mark.parametrize("filters", FILTERS)
def test_sampled_tokens_stay_in_the_filtered_distribution(merged, filters):
    """Replay sampled sequences with the step API: each token is among the top_k most likely
    and inside the top_p nucleus of the distribution before filtering."""
    from onnxmerge.runtime.processors import softmax
    from tests import zoo

    model, _, export = merged("marian")
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=10)
    kwargs = {"do_sample": True, "max_new_tokens": 10, **filters}
    eos = model.resolve_settings(**kwargs).eos_token_id
    # The processors before the sampling filters (penalties, forced tokens...).
    before = build_processors(model.resolve_settings(max_new_tokens=10))
    top_k = filters.get("top_k") or None
    top_p = filters.get("top_p", 1.0)
    for seed in range(3):
        out = model.generate(**inputs, seed=seed, **kwargs)
        step = model.first_step(inputs, out[:, :1])
        for pos in range(1, out.shape[1]):
            scores = before(out[:, :pos], step.logits[:, -1, :].astype(np.float32))
            probs = softmax(scores / np.float32(filters.get("temperature", 1.0)))
            for row in range(out.shape[0]):
                if pos > 1 and out[row, pos - 1] in eos:
                    continue  # finished: padded
                token = out[row, pos]
                order = np.argsort(-probs[row], kind="stable")
                rank = int(np.flatnonzero(order == token)[0])
                if top_k:
                    assert rank < top_k
                mass_before = probs[row][order[:rank]].sum()
                assert mass_before < top_p + 1e-5
            step = model.next_step(out[:, pos : pos + 1], step.cache)


# -- step API ------------------------------------------------------------------------------------


def test_step_api_greedy_loop_matches_generate(merged):
    from tests import zoo

    model, _, export = merged("t5")  # no forced eos in its generation config
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=11)
    start = model.resolve_settings().decoder_start_token_id
    tokens = np.full((2, 1), start, dtype=np.int64)
    step = model.first_step(inputs, tokens)
    for _ in range(6):
        next_tokens = step.logits[:, -1, :].argmax(-1)[:, None]
        tokens = np.concatenate([tokens, next_tokens], axis=1)
        step = model.next_step(next_tokens, step.cache)
    expected = model.generate(**inputs, max_new_tokens=6, eos_token_id=[999])
    np.testing.assert_array_equal(tokens, expected)
    assert step.cache.length == 7


def test_cache_reorder_and_expand(merged):
    from tests import zoo

    model, _, export = merged("bart")
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=12)
    start = model.resolve_settings().decoder_start_token_id
    first = model.first_step(inputs, np.full((2, 1), start, dtype=np.int64))
    swapped = first.cache.reorder([1, 0])
    token = np.array([[30], [31]], dtype=np.int64)
    a = model.next_step(token, first.cache)
    b = model.next_step(token[::-1].copy(), swapped)
    np.testing.assert_allclose(a.logits[::-1], b.logits, atol=1e-5)
    expanded = first.cache.expand(3)
    assert expanded.rows == 6
    c = model.next_step(np.repeat(token, 3, axis=0), expanded)
    np.testing.assert_allclose(c.logits[::3], a.logits, atol=1e-5)
    # The cross-attention tensors' OrtValues are kept from step to step only for the same
    # arrays: a step on another cache in between never reads the expanded one's.
    session = model._session
    if session.writes_into:
        kept = dict(session._shared_values)
        assert kept  # the expanded cache's tensors, which the step before read
        again = model.next_step(np.repeat(token, 3, axis=0), expanded)
        assert all(session._shared_values[name][1] is kept[name][1] for name in kept)
        np.testing.assert_array_equal(again.logits, c.logits)
        np.testing.assert_array_equal(model.next_step(token, first.cache).logits, a.logits)


def test_cached_steps_write_the_cache_into_a_ring_of_buffers(merged, monkeypatch):
    """The runner's cached steps write their presents into its own buffers, each mapped once for
    the whole search: layer i's where layer i - 1's pasts are, layer 0's into a spare layer, so
    that no present lands on a past that its step reads later. The tokens are those of two sets
    of buffers by turns and of onnxruntime's own buffers."""
    from onnxmerge.runtime import Accelerations, Seq2SeqModel, _runners
    from tests import zoo

    model, _, export = merged("marian")
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=4)
    layers = model.info.num_layers
    seen: list[tuple[int, ...]] = []
    real_next = _runners.PresentBuffers.next

    def next_recorded(self, past):
        arrays = real_next(self, past)
        for i, array in enumerate(arrays):
            still_read = past[i // 2 * 2 :] if self._ring else past
            assert not any(np.shares_memory(array, p) for p in still_read)
        seen.append(tuple(a.__array_interface__["data"][0] for a in arrays))
        return arrays

    monkeypatch.setattr(_runners.PresentBuffers, "next", next_recorded)
    steps = 2 * (layers + 1) + 1
    settings = dict(num_beams=3, max_new_tokens=steps + 1, min_new_tokens=steps + 1)
    assert model._session.pasts_die_by_layer
    written = model.generate(**inputs, **settings)
    assert len(seen) == steps and len({a for s in seen for a in s}) == 2 * (layers + 1)
    period = layers + 1  # never moved to grow
    assert all(seen[i] == seen[i - period] for i in range(period, steps))

    seen.clear()
    two_sets = Seq2SeqModel(model.path, accelerations=Accelerations(present_ring=False))
    assert np.array_equal(two_sets.generate(**inputs, **settings), written)
    assert len({a for s in seen for a in s}) == 4 * layers
    assert all(seen[i] == seen[i - 2] for i in range(2, steps))

    seen.clear()
    arena = Seq2SeqModel(model.path, accelerations=Accelerations(present_buffers=False))
    assert np.array_equal(arena.generate(**inputs, **settings), written)
    assert not seen  # onnxruntime's buffers, not the runner's


# -- text ----------------------------------------------------------------------------------------


def test_translate_with_a_tokenizer_beside_the_model(merged, tmp_path):
    pytest.importorskip("tokenizers")
    import shutil

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import onnxmerge

    model, pt_model, _ = merged("marian")
    # Ids as the tiny Marian uses them: 0 unk (bos), 1 pad, 2 eos; words after.
    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    shutil.copy(model.path, tmp_path / "model.onnx")
    tokenizer.save_pretrained(tmp_path)
    beside = onnxmerge.Seq2SeqModel(tmp_path / "model.onnx")
    texts = ["w5 w6 w7 w8", "w9 w10"]
    ours = beside.translate(texts, max_new_tokens=6, num_beams=2)
    encoded = tokenizer(texts, return_tensors="pt", padding=True, return_token_type_ids=False)
    with torch.no_grad():
        ids = pt_model.generate(**encoded, max_new_tokens=6, num_beams=2)
    assert ours == tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert isinstance(beside.translate("w5 w6", max_new_tokens=3), str)
