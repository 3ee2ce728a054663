"""onnxmerge.transformers: transformers' generate() and pipeline() over a merged file give the
ids of PyTorch's generate() and of Seq2SeqModel.generate()."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.export

pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ARCHS = ("marian", "bart", "t5", "m2m100", "whisper")
_models: dict = {}


@pytest.fixture(scope="module")
def merged(tiny_export, tmp_path_factory):
    """``merged(arch)`` -> (adapter model, Seq2SeqModel, PyTorch model, export), built once."""
    import onnxmerge
    from onnxmerge.transformers import MergedModelForSeq2SeqLM, MergedModelForSpeechSeq2Seq
    from tests import zoo

    def get(arch: str):
        if arch not in _models:
            export = tiny_export(arch)
            out = tmp_path_factory.mktemp(arch) / "model.onnx"
            onnxmerge.merge_seq2seq(export.onnx_dir, out)
            kind = MergedModelForSpeechSeq2Seq if arch == "whisper" else MergedModelForSeq2SeqLM
            _models[arch] = (
                kind.from_pretrained(out.parent, threads=1),
                onnxmerge.Seq2SeqModel(out, threads=1),
                zoo.load_pytorch(export),
                export,
            )
        return _models[arch]

    return get


def _inputs(export, seed: int = 1) -> dict:
    from tests import zoo

    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=seed)
    return {name: torch.from_numpy(value) for name, value in inputs.items()}


def _pytorch(pt_model, inputs, **settings):
    # Whisper's own generate() strips the prompt and eos; the generic loop gives the layout
    # every other model gets, which is what the adapter runs.
    with torch.no_grad():
        return transformers.GenerationMixin.generate(pt_model, **inputs, **settings)


SEARCHES = {
    "greedy": {},
    "beam3": {"num_beams": 3},
    "beam3-return2": {"num_beams": 3, "num_return_sequences": 2, "length_penalty": 0.6},
    "ngram-penalty": {"no_repeat_ngram_size": 2, "repetition_penalty": 1.3, "max_new_tokens": 9},
}


@pytest.mark.slow
@pytest.mark.parametrize("settings", SEARCHES.values(), ids=SEARCHES.keys())
@pytest.mark.parametrize("arch", ARCHS)
def test_ids_equal_pytorch_and_the_runtime(merged, arch, settings):
    model, runtime, pt_model, export = merged(arch)
    inputs = _inputs(export)
    expected = _pytorch(pt_model, inputs, **settings)
    ids = model.generate(**inputs, **settings)
    torch.testing.assert_close(ids, expected, rtol=0, atol=0)
    ours = runtime.generate(**{k: v.numpy() for k, v in inputs.items()}, **settings)
    np.testing.assert_array_equal(ids.numpy(), ours)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant", "merge_format"),
    [("no-past", None), ("default", 2)],
    ids=["no-past", "format-2"],
)
def test_other_layouts_give_pytorchs_ids(tiny_export, tmp_path, variant, merge_format):
    """Default merges are format 4 (cross-attention keys once per input); a format 2 file and
    one without past (the decoder reruns on the prefix) go through the same cache."""
    import onnxmerge
    from onnxmerge.transformers import MergedModelForSeq2SeqLM
    from tests import zoo

    export = tiny_export("marian", variant)
    onnxmerge.merge_seq2seq(export.onnx_dir, tmp_path / "model.onnx", format=merge_format)
    model = MergedModelForSeq2SeqLM.from_pretrained(tmp_path / "model.onnx", threads=1)
    pt_model = zoo.load_pytorch(export)
    inputs = _inputs(export, seed=11)
    start = torch.full((2, 1), model.generation_config.decoder_start_token_id)
    cache = model(decoder_input_ids=start, **inputs).past_key_values.merged
    assert (cache.tokens is not None, cache.per_input) == (variant == "no-past", False)
    for settings in ({}, {"num_beams": 3, "num_return_sequences": 2}):
        expected = _pytorch(pt_model, inputs, **settings)
        torch.testing.assert_close(model.generate(**inputs, **settings), expected, rtol=0, atol=0)


class _BanToken(transformers.LogitsProcessor):
    """A user's processor: forbids one token everywhere."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores):
        scores[:, self.token] = -float("inf")
        return scores


@pytest.mark.parametrize("arch", ("marian", "t5"))
@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_users_logits_processor_is_applied(merged, arch, num_beams):
    model, _, pt_model, export = merged(arch)
    inputs = _inputs(export, seed=2)
    plain = model.generate(**inputs, num_beams=num_beams)
    banned = int(plain[0, 1])  # the first token generated: banning it changes the output
    settings = {"num_beams": num_beams}
    processors = transformers.LogitsProcessorList([_BanToken(banned)])
    expected = _pytorch(pt_model, inputs, logits_processor=processors, **settings)
    ids = model.generate(**inputs, logits_processor=processors, **settings)
    torch.testing.assert_close(ids, expected, rtol=0, atol=0)
    assert not (ids[:, 1:] == banned).any()
    assert not torch.equal(ids[:, : plain.shape[1]], plain[:, : ids.shape[1]])


@pytest.mark.parametrize("arch", ("marian", "bart"))
@pytest.mark.parametrize("num_beams", [1, 3])
def test_scores_and_dict_output_match_pytorch(merged, arch, num_beams):
    model, _, pt_model, export = merged(arch)
    inputs = _inputs(export, seed=3)
    settings = {"num_beams": num_beams, "output_scores": True, "return_dict_in_generate": True}
    expected = _pytorch(pt_model, inputs, **settings)
    out = model.generate(**inputs, **settings)
    torch.testing.assert_close(out.sequences, expected.sequences, rtol=0, atol=0)
    assert len(out.scores) == len(expected.scores)
    for ours, theirs in zip(out.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    if num_beams > 1:
        torch.testing.assert_close(out.sequences_scores, expected.sequences_scores)


def test_sampling_with_a_seed_matches_pytorch(merged):
    model, _, pt_model, export = merged("marian")
    inputs = _inputs(export, seed=4)
    settings = {"do_sample": True, "top_k": 5, "num_return_sequences": 2}
    torch.manual_seed(0)
    expected = _pytorch(pt_model, inputs, **settings)
    torch.manual_seed(0)
    ids = model.generate(**inputs, **settings)
    torch.testing.assert_close(ids, expected, rtol=0, atol=0)


def _forward_calls(model, monkeypatch) -> list[int]:
    calls: list[int] = []
    forward = model.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    return calls


class _Silent(transformers.generation.streamers.BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


# Calls the runtime's own search answers: the same ids as GenerationMixin driving the steps.
RUNTIME_CALLS = {
    "default-length": {},
    "max-length": {"max_length": 9},
    "new-tokens": {"max_new_tokens": 6, "min_new_tokens": 4},
    "beam-return2": {"num_beams": 3, "num_return_sequences": 2, "early_stopping": True},
    "penalties": {"no_repeat_ngram_size": 2, "repetition_penalty": 1.3, "length_penalty": 0.6},
    "config": {"generation_config": transformers.GenerationConfig(num_beams=4, max_new_tokens=7)},
}


@pytest.mark.parametrize("settings", RUNTIME_CALLS.values(), ids=RUNTIME_CALLS.keys())
@pytest.mark.parametrize("arch", ("marian", "t5"))
def test_plain_calls_run_the_runtimes_search_with_generation_mixins_ids(
    merged, arch, settings, monkeypatch
):
    model, _, _, export = merged(arch)
    inputs = _inputs(export, seed=3)
    calls = _forward_calls(model, monkeypatch)
    ids = model.generate(**inputs, **settings)
    assert calls == []  # no step went through forward()
    monkeypatch.setattr(model, "runtime_search", False)
    expected = model.generate(**inputs, **settings)
    assert calls  # GenerationMixin drove the steps
    torch.testing.assert_close(ids, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "settings",
    [
        {"do_sample": True, "top_k": 5},  # torch's draws
        {"output_scores": True, "return_dict_in_generate": True},
        {"streamer": _Silent()},
        {
            "logits_processor": transformers.LogitsProcessorList(
                [transformers.MinLengthLogitsProcessor(4, 2)]
            )
        },
        {"use_cache": False},
        {"typical_p": 0.9, "do_sample": False},
    ],
    ids=["sampling", "scores", "streamer", "processor", "no-cache", "typical-p"],
)
def test_calls_beyond_the_runtime_go_through_generation_mixin(merged, settings, monkeypatch):
    model, _, _, export = merged("marian")
    calls = _forward_calls(model, monkeypatch)
    model.generate(**_inputs(export, seed=3), max_new_tokens=3, **settings)
    assert calls


class _StopAtFive(transformers.StoppingCriteria):
    """A user's stopping criterion: every row stops at five tokens."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 5, dtype=torch.bool)


# Options our own runtime does not have; through the adapter they give PyTorch's ids.
BEYOND_THE_RUNTIME = {
    "stopping-criteria": {"stopping_criteria": transformers.StoppingCriteriaList([_StopAtFive()])},
    "sequence-bias": {"sequence_bias": {(5,): -10.0, (7, 8): 4.0}},
    "typical-min-p": {"do_sample": True, "typical_p": 0.9, "min_p": 0.05},
    "beam-sample": {"do_sample": True, "num_beams": 3},
    "no-cache-beam": {"use_cache": False, "num_beams": 2},
    "watermark": {
        "do_sample": True,
        "watermarking_config": transformers.WatermarkingConfig(greenlist_ratio=0.5),
    },
}


@pytest.mark.parametrize("settings", BEYOND_THE_RUNTIME.values(), ids=BEYOND_THE_RUNTIME.keys())
def test_options_beyond_the_runtime_match_pytorch(merged, settings):
    model, _, pt_model, export = merged("marian")
    inputs = _inputs(export, seed=7)
    torch.manual_seed(0)
    expected = _pytorch(pt_model, inputs, **settings)
    torch.manual_seed(0)
    ids = model.generate(**inputs, **settings)
    torch.testing.assert_close(ids, expected, rtol=0, atol=0)


def test_prompt_lookup_decoding_feeds_several_tokens_and_crops_the_cache(merged):
    model, _, pt_model, export = merged("bart")
    inputs = {name: value[:1] for name, value in _inputs(export, seed=8).items()}
    settings = {"prompt_lookup_num_tokens": 3, "max_new_tokens": 15}
    expected = _pytorch(pt_model, inputs, **settings)
    torch.testing.assert_close(model.generate(**inputs, **settings), expected, rtol=0, atol=0)


class _Collect(transformers.generation.BaseStreamer):
    def __init__(self):
        self.pieces: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.pieces.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_a_streamer_gets_each_token_as_it_comes(merged):
    model, _, pt_model, export = merged("marian")
    inputs = {name: value[:1] for name, value in _inputs(export, seed=5).items()}
    streamer = _Collect()
    ids = model.generate(**inputs, streamer=streamer, max_new_tokens=8)
    assert streamer.ended
    assert [token for piece in streamer.pieces for token in piece] == ids[0].tolist()
    assert all(len(piece) == 1 for piece in streamer.pieces[1:])  # one step, one token
    torch.testing.assert_close(ids, _pytorch(pt_model, inputs, max_new_tokens=8), rtol=0, atol=0)


def test_the_config_comes_from_the_file(merged):
    model, runtime, _, _ = merged("m2m100")
    assert model.config.model_type == runtime.model_type == "m2m_100"
    assert model.config.is_encoder_decoder
    assert model.generation_config.decoder_start_token_id == (
        runtime.resolve_settings().decoder_start_token_id
    )
    assert model.can_generate()


def test_the_cache_moves_rows_through_the_runtime_cache(merged):
    from onnxmerge.transformers import MergedCache

    model, runtime, _, export = merged("bart")
    inputs = _inputs(export, seed=6)
    out = model(decoder_input_ids=torch.full((2, 1), 2), **inputs)
    cache = out.past_key_values
    assert isinstance(cache, MergedCache) and isinstance(cache, transformers.Cache)
    assert (cache.get_seq_length(), len(cache), cache.is_compileable) == (
        1,
        runtime.num_layers,
        False,
    )
    first = cache.merged.decoder[0]
    cache.reorder_cache(torch.tensor([1, 0]))
    np.testing.assert_array_equal(cache.merged.decoder[0], first[[1, 0]])
    cache.batch_repeat_interleave(2)
    assert cache.merged.rows == 4
    step = model(decoder_input_ids=torch.full((4, 1), 5), past_key_values=cache)
    assert step.past_key_values.get_seq_length() == 2
    step.past_key_values.crop(1)
    assert step.past_key_values.get_seq_length() == 1
    legacy = step.past_key_values.to_legacy_cache()
    assert len(legacy) == runtime.num_layers and len(legacy[0]) == 4
    np.testing.assert_array_equal(legacy[0][0].numpy(), step.past_key_values.merged.decoder[0])


def test_saving_is_refused_rather_than_writing_no_weights(merged, tmp_path):
    model, _, _, _ = merged("marian")
    with pytest.raises(NotImplementedError, match="copying its file"):
        model.save_pretrained(tmp_path)
    assert not any(tmp_path.iterdir())


def test_a_path_without_a_merged_model_is_refused(tmp_path):
    from onnxmerge.errors import InvalidArgumentError
    from onnxmerge.transformers import MergedModelForSeq2SeqLM

    with pytest.raises(InvalidArgumentError, match="no merged model there") as raised:
        MergedModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert raised.value.argument == "pretrained_model_name_or_path"


def test_encoder_outputs_of_another_model_are_refused(merged):
    from onnxmerge.errors import InvalidArgumentError

    model, _, _, export = merged("marian")
    other = transformers.modeling_outputs.BaseModelOutput(last_hidden_state=torch.zeros(2, 7, 8))
    with pytest.raises(InvalidArgumentError, match="get_encoder"):
        model(decoder_input_ids=torch.zeros(2, 1, dtype=torch.long), encoder_outputs=other)


# ---------------------------------------------------------------------------------------------
# the trained demo model, through pipeline()


@pytest.fixture(scope="module")
def demo(demo_export, tmp_path_factory):
    import shutil

    import onnxmerge

    folder = tmp_path_factory.mktemp("demo")
    for name in demo_export.iterdir():
        if name.suffix != ".onnx" and name.is_file():
            shutil.copy(name, folder / name.name)
    onnxmerge.merge_seq2seq(demo_export, folder / "model.onnx")
    return folder


@pytest.mark.parametrize("settings", [{}, {"num_beams": 4}], ids=["greedy", "beam4"])
def test_translation_pipeline_gives_the_runtimes_text(demo, settings):
    from onnxmerge import Seq2SeqModel
    from onnxmerge.demo import DEMO_SENTENCES
    from onnxmerge.transformers import MergedModelForSeq2SeqLM

    tokenizer = transformers.AutoTokenizer.from_pretrained(demo)
    model = MergedModelForSeq2SeqLM.from_pretrained(demo)
    translator = transformers.pipeline("translation", model=model, tokenizer=tokenizer)
    sources = list(DEMO_SENTENCES)[:4]
    texts = [found["translation_text"] for found in translator(sources, **settings)]
    assert texts == Seq2SeqModel(demo / "model.onnx").translate(sources, tokenizer, **settings)
    assert all(texts)


# ---------------------------------------------------------------------------------------------
# speech, through pipeline("automatic-speech-recognition")


def _tiny_whisper_tokenizer(folder):
    """A Whisper tokenizer over the tiny model's 128 ids: its special tokens where the tiny
    config puts them, single characters after; ``<|notimestamps|>`` last, so that no id the
    model can produce reads as a timestamp."""
    import json

    from tests import zoo

    specials = ["<|bos|>", "<|pad|>", "<|endoftext|>", "<|startoftranscript|>"]
    ends = ["<|startofprev|>", "<|notimestamps|>"]
    vocab = specials + [chr(c) for c in range(33, 127)] + ["Ġ"]
    vocab += [f"{a}{b}" for a in "abcdefghij" for b in "abcdefghij"]
    vocab = vocab[: zoo.VOCAB - len(ends)] + ends
    (folder / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return transformers.WhisperTokenizer(
        folder / "vocab.json",
        folder / "merges.txt",
        unk_token="<|endoftext|>",
        bos_token="<|bos|>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|startoftranscript|>", *ends],
    )


def test_speech_recognition_pipeline_gives_pytorchs_tokens(merged, tmp_path):
    from tests import zoo

    model, runtime, pt_model, _ = merged("whisper")
    tokenizer = _tiny_whisper_tokenizer(tmp_path)
    # One second of audio makes the tiny model's frames: 16000 samples / 250 = 64.
    features = transformers.WhisperFeatureExtractor(
        feature_size=zoo.WHISPER_MEL_BINS, hop_length=250, chunk_length=1
    )
    assert features.nb_max_frames == 2 * zoo.WHISPER_SOURCE_POSITIONS
    seen = []
    generate = model.generate

    def recorded(**kwargs):
        seen.append(kwargs)
        return generate(**kwargs)

    model.generate = recorded
    try:
        asr = transformers.pipeline(
            "automatic-speech-recognition",
            model=model,
            tokenizer=tokenizer,
            feature_extractor=features,
        )
        audio = np.random.default_rng(9).uniform(-0.5, 0.5, 16000).astype(np.float32)
        text = asr(audio, generate_kwargs={"max_new_tokens": 8})["text"]
    finally:
        del model.generate
    given = seen[0]["input_features"]
    expected = _pytorch(pt_model, {"input_features": given}, max_new_tokens=8)
    np.testing.assert_array_equal(
        runtime.generate(input_features=given.numpy(), max_new_tokens=8), expected.numpy()
    )
    assert text == tokenizer.decode(expected[0], skip_special_tokens=True)
    assert text


@pytest.mark.parametrize("num_beams", [1, 2])
def test_a_whisper_decoder_prompt_is_continued(merged, num_beams):
    model, runtime, pt_model, export = merged("whisper")
    inputs = _inputs(export, seed=10)
    prompt = torch.tensor([[3, 50, 51], [3, 52, 53]])
    settings = {"decoder_input_ids": prompt, "num_beams": num_beams, "max_new_tokens": 6}
    expected = _pytorch(pt_model, inputs, **settings)
    ids = model.generate(**inputs, **settings)
    torch.testing.assert_close(ids, expected, rtol=0, atol=0)
    torch.testing.assert_close(ids[:, :3], prompt, rtol=0, atol=0)
