"""Whisper's log-mel features in standard ONNX operators: PCM samples in, ``input_features`` out.

The graph computes what transformers' ``WhisperFeatureExtractor`` computes: each row cut or
zero-padded to the model's window (30 s at 16 kHz), samples past the row's length zeroed, a
centered STFT (reflect padding, periodic Hann window), the power spectrum, the Slaney mel bank,
``log10(max(x, 1e-10))`` without the last frame, the clamp to each example's maximum − 8 and
``(x + 4) / 4``. Frames are cut with strided ``Slice``s and the windowed DFT is one ``MatMul``
with a precomputed basis: onnxruntime (and onnxruntime-web) run it as a matrix product, where
their ``STFT`` kernel evaluates a plain DFT per frame for a length of 400.

``build_features`` writes the feature part alone; ``features_graph`` appends the same nodes to
another graph (the generator with ``audio=True``); ``prepare_audio`` checks PCM in Python and
returns the two inputs, so bad input fails before onnxruntime runs.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from onnxmerge import check, contract, model_io
from onnxmerge.errors import (
    AudioInputError,
    InvalidArgumentError,
    InvalidMergedModelError,
)
from onnxmerge.generator._ops import Names, Ops

AUDIO = "audio"
AUDIO_LENGTHS = "audio_lengths"
INPUT_FEATURES = "input_features"
META_FEATURES = "onnxmerge.audio_features"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
DEFAULT_FEATURES_NAME = "features.onnx"
FEATURES_OPSET = 18
MEL_FLOOR = 1e-10
MAX_FREQUENCY = 8000.0  # WhisperFeatureExtractor's mel bank stops there, whatever the rate


@dataclass(frozen=True)
class FeatureSpec:
    """The extractor's parameters; the defaults are whisper's (80 bins, 30 s at 16 kHz)."""

    n_mels: int = 80
    n_samples: int = 480_000
    n_fft: int = 400
    hop_length: int = 160
    sampling_rate: int = 16_000

    @property
    def frames(self) -> int:
        """Frames of features a full window gives (3,000 for Whisper's 30 s)."""
        return self.n_samples // self.hop_length

    def as_dict(self) -> dict[str, int]:
        """The settings as the feature model's metadata records them."""
        return {
            "n_mels": self.n_mels,
            "n_samples": self.n_samples,
            "n_fft": self.n_fft,
            "hop_length": self.hop_length,
            "sampling_rate": self.sampling_rate,
        }


def feature_spec(
    config: Mapping[str, Any], preprocessor: Mapping[str, Any] | None = None
) -> FeatureSpec:
    """The features a Whisper model reads, from its config and preprocessor config.

    The encoder takes exactly ``2 * max_source_positions`` frames (its convolution halves them),
    so the window follows from the config; a preprocessor config that disagrees is refused.
    """
    if config.get("model_type") != "whisper" and "num_mel_bins" not in config:
        raise InvalidMergedModelError(
            f"the model is a {config.get('model_type')!r}, not Whisper: audio input needs "
            "Whisper's log-mel features"
        )
    pre = dict(preprocessor or {})
    hop = int(pre.get("hop_length", 160))
    rate = int(pre.get("sampling_rate", 16_000))
    n_fft = int(pre.get("n_fft", 400))
    n_mels = int(pre.get("feature_size", config.get("num_mel_bins", 80)))
    if n_mels != int(config.get("num_mel_bins", n_mels)):
        raise InvalidMergedModelError(
            f"the preprocessor config gives {n_mels} mel bins, the model reads "
            f"{config['num_mel_bins']}"
        )
    frames = 2 * int(config.get("max_source_positions", 1500))
    n_samples = frames * hop
    given = pre.get("n_samples")
    if given is None and "chunk_length" in pre:
        given = int(pre["chunk_length"]) * rate
    if given is not None and int(given) != n_samples:
        raise InvalidMergedModelError(
            f"the preprocessor config cuts audio to {given} samples, but the encoder reads "
            f"{frames} frames of {hop} ({n_samples} samples)"
        )
    if float(pre.get("dither", 0.0)) != 0.0 or pre.get("do_normalize"):
        raise InvalidMergedModelError(
            "the preprocessor config asks for dither or normalisation, which the graph does not do"
        )
    return FeatureSpec(n_mels, n_samples, n_fft, hop, rate)


# -- the Slaney mel bank, as transformers.audio_utils.mel_filter_bank builds it -------------------

_MIN_LOG_HERTZ, _MIN_LOG_MEL, _LOGSTEP = 1000.0, 15.0, 27.0 / math.log(6.4)


def _hertz_to_mel(freq: np.ndarray) -> np.ndarray:
    mels = 3.0 * freq / 200.0
    high = freq >= _MIN_LOG_HERTZ
    mels[high] = _MIN_LOG_MEL + np.log(freq[high] / _MIN_LOG_HERTZ) * _LOGSTEP
    return mels


def _mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    high = mels >= _MIN_LOG_MEL
    freq[high] = _MIN_LOG_HERTZ * np.exp((mels[high] - _MIN_LOG_MEL) / _LOGSTEP)
    return freq


def mel_filters(spec: FeatureSpec = FeatureSpec()) -> np.ndarray:
    """The extractor's mel bank, ``[n_fft // 2 + 1, n_mels]`` in float64 (Slaney scale and norm)."""
    edges = _hertz_to_mel(np.array([0.0, MAX_FREQUENCY]))
    filter_freqs = _mel_to_hertz(np.linspace(edges[0], edges[1], spec.n_mels + 2))
    fft_freqs = np.linspace(0, spec.sampling_rate // 2, spec.n_fft // 2 + 1)
    diff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    bank = np.maximum(0.0, np.minimum(down, up))
    return bank * (2.0 / (filter_freqs[2:] - filter_freqs[:-2]))[None, :]


def _dft_basis(spec: FeatureSpec) -> np.ndarray:
    """``[n_fft, 2 * bins]``: the periodic Hann window times cos, then times −sin."""
    n = np.arange(spec.n_fft)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * n / spec.n_fft)
    bins = np.arange(spec.n_fft // 2 + 1)
    angle = 2 * np.pi * np.outer(n, bins) / spec.n_fft
    return np.concatenate([np.cos(angle), -np.sin(angle)], axis=1) * window[:, None]


# -- the graph -------------------------------------------------------------------------------------


def audio_inputs() -> tuple[ir.Value, ir.Value]:
    """The two inputs: ``audio`` float32 ``[batch, samples]`` and ``audio_lengths`` int64."""
    audio = ir.Value(
        name=AUDIO, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch_size", "samples"])
    )
    lengths = ir.Value(
        name=AUDIO_LENGTHS, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch_size"])
    )
    return audio, lengths


def _initializer(
    graph: ir.Graph, names: Names, hint: str, array: np.ndarray, dtype: type = np.float32
) -> ir.Value:
    array = array.astype(dtype)
    value = ir.Value(
        name=names(hint),
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
        shape=ir.Shape(array.shape),
        const_value=ir.tensor(array),
    )
    graph.register_initializer(value)
    return value


def features_graph(
    ops: Ops, graph: ir.Graph, audio: ir.Value, lengths: ir.Value, spec: FeatureSpec
) -> ir.Value:
    """Append to ``ops`` the nodes from PCM to ``[batch, n_mels, frames]`` features; the mel bank
    and the DFT basis become initializers of ``graph``. Returns the features."""
    signal, width = _padded_signal(ops, audio, lengths, spec)
    framed, count = _frames(ops, signal, width, spec)
    basis = _initializer(graph, ops.names, "dft_basis", _dft_basis(spec), np.float64)
    spectrum = ops.op("MatMul", framed, basis)  # [batch, count, 2 * bins]: re, then im
    power = ops.op("Mul", spectrum, spectrum)
    # re² and im² each meet the mel bank: one product over the stacked bank sums them.
    bank = mel_filters(spec)
    stacked = _initializer(
        graph, ops.names, "mel_filters", np.concatenate([bank, bank], axis=0), np.float64
    )
    mel = ops.op("Cast", ops.op("MatMul", power, stacked), to=ir.DataType.FLOAT)
    missing_frames = ops.op("Sub", ops.i64(spec.frames), count)
    mel = ops.op("Pad", mel, ops.vector(ops.i64([0, 0, 0, 0]), missing_frames, ops.i64([0])))
    log = ops.op(
        "Mul", ops.op("Log", ops.op("Max", mel, ops.f32(MEL_FLOOR))), ops.f32(1 / math.log(10))
    )
    peak = ops.reduce("ReduceMax", ops.reduce("ReduceMax", log, 2, True), 1, True)
    log = ops.op("Max", log, ops.op("Sub", peak, ops.f32(8.0)))
    scaled = ops.op("Div", ops.op("Add", log, ops.f32(4.0)), ops.f32(4.0))
    return ops.op("Transpose", scaled, perm=[0, 2, 1])


def _padded_signal(
    ops: Ops, audio: ir.Value, lengths: ir.Value, spec: FeatureSpec
) -> tuple[ir.Value, ir.Value]:
    """Each row cut to the window, zeroed past its length, zero-padded to the window and
    reflect-padded for centered frames; and the cut width."""
    total = spec.n_samples
    cut = ops.slice(audio, 0, total, axis=1)
    width = ops.dim(cut, 1)
    positions = ops.op("Range", ops.i64(0), width, ops.i64(1))
    keep = ops.op("Less", ops.unsqueeze(positions, 0), ops.unsqueeze(lengths, 1))
    cut = ops.op("Where", keep, cut, ops.f32(0.0))
    missing = ops.op("Sub", ops.i64(total), width)
    pads = ops.vector(ops.i64([0, 0, 0]), missing)
    signal = ops.op("Pad", cut, pads, mode="constant")
    # Centered frames: reflect n/2 on both sides, as torch.stft(center=True) and transformers do.
    half = spec.n_fft // 2
    signal = ops.op("Pad", signal, ops.i64([0, half, 0, half]), mode="reflect")
    return signal, width


def _frames(
    ops: Ops, signal: ir.Value, width: ir.Value, spec: FeatureSpec
) -> tuple[ir.Value, ir.Value]:
    """``[batch, count, n_fft]`` frames of the padded signal, in float64, and ``count``: the
    frames that read any sample of the longest row."""
    n, hop, half = spec.n_fft, spec.hop_length, spec.n_fft // 2
    # Frames past the longest row read zeros only: their mel energy is 0, the floor. Compute the
    # first ``count`` frames and pad the rest with zeros; frame t reads samples [t*hop, t*hop + n)
    # of the padded signal, that is, in chunks of g = gcd(hop, n), chunks t*r .. t*r + m - 1.
    g = math.gcd(hop, n)
    r, m = hop // g, n // g
    reach = ops.op(
        "Add", ops.op("Div", ops.op("Add", width, ops.i64(half - 1)), ops.i64(hop)), ops.i64(1)
    )
    # The extractor drops the last of n_samples // hop + 1 frames.
    count = ops.op("Min", reach, ops.i64(spec.frames))
    prefix = ops.op(
        "Mul", ops.op("Add", ops.op("Mul", count, ops.i64(r)), ops.i64(m - r)), ops.i64(g)
    )
    signal = ops.slice(signal, 0, prefix, axis=1)
    # float64 from here to the mel energies: a float32 DFT of 400 terms loses about 1e-4 of the
    # features on bins near the clamp (max - 8), where the extractor's FFT stays within 4e-5.
    signal = ops.op("Cast", signal, to=ir.DataType.DOUBLE)
    chunks = ops.op("Reshape", signal, ops.i64([0, -1, g]))
    last = ops.op("Mul", ops.op("Sub", count, ops.i64(1)), ops.i64(r))
    pieces = [
        ops.op(
            "Slice",
            chunks,
            ops.i64([j]),
            ops.unsqueeze(ops.op("Add", last, ops.i64(j + 1)), 0),
            ops.i64([1]),
            ops.i64([r]),
        )
        for j in range(m)
    ]
    return ops.op("Concat", *pieces, axis=2), count


def features_model(spec: FeatureSpec) -> ir.Model:
    """A model ``(audio, audio_lengths) -> input_features`` alone."""
    audio, lengths = audio_inputs()
    graph = ir.Graph(
        [audio, lengths], [], nodes=[], name="whisper_features", opset_imports={"": FEATURES_OPSET}
    )
    ops = Ops(Names("features"), FEATURES_OPSET)
    features = features_graph(ops, graph, audio, lengths, spec)
    for node in ops.nodes:
        graph.append(node)
    features.name = INPUT_FEATURES
    features.type = ir.TensorType(ir.DataType.FLOAT)
    features.shape = ir.Shape(["batch_size", spec.n_mels, spec.frames])
    graph.outputs.append(features)
    model = ir.Model(graph, ir_version=10, producer_name="onnxmerge")
    model.metadata_props[META_FEATURES] = json.dumps(spec.as_dict(), sort_keys=True)
    return model


def spec_for_source(source: Path) -> FeatureSpec:
    """The feature spec of an export folder, a merged model or a generator."""
    if source.is_dir():
        config_file = source / "config.json"
        if not config_file.is_file():
            raise InvalidMergedModelError(f"no config.json in {source}: is it an optimum export?")
        config = json.loads(config_file.read_text("utf-8"))
        pre_file = source / PREPROCESSOR_CONFIG
        pre = json.loads(pre_file.read_text("utf-8")) if pre_file.is_file() else None
        return feature_spec(config, pre)
    if not source.is_file():
        raise InvalidMergedModelError(f"{source} is neither an export folder nor a model file")
    import onnx

    metadata = {
        p.key: p.value
        for p in onnx.load(os.fspath(source), load_external_data=False).metadata_props
    }
    config = json.loads(metadata.get(contract.META_CONFIG, "{}"))
    pre_file = source.parent / PREPROCESSOR_CONFIG
    pre = json.loads(pre_file.read_text("utf-8")) if pre_file.is_file() else None
    return feature_spec(config, pre)


def build_features(
    source: str | os.PathLike | None,
    output: str | os.PathLike,
    *,
    spec: FeatureSpec | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the feature model alone (``audio``, ``audio_lengths`` -> ``input_features``).

    Args:
        source: a Whisper export folder, merged model or generator; its config (and
            ``preprocessor_config.json`` beside it) gives the spec. ``None`` with ``spec``.
        output: the file to write.
        spec: the features to compute, in place of the source's.
        overwrite: replace an existing output file.
    """
    output = Path(output)
    if source is None:
        if spec is None:
            raise InvalidArgumentError("give a Whisper source or a FeatureSpec", argument="source")
        model_io.check_output(output, [], overwrite=overwrite)
    else:
        source = Path(source)
        model_io.check_output(output, [source] if source.is_file() else [], overwrite=overwrite)
        spec = spec or spec_for_source(source)
    model = features_model(spec)
    # Checked, not run: run_once's sample inputs are an encoder's and a decoder's.
    model_io.save_model_atomically(
        model,
        output,
        validate=lambda p: check.check_written_model(p, what="feature model", run=False),
    )
    return output


# -- checking PCM in Python -----------------------------------------------------------------------


def prepare_audio(
    audio: np.ndarray | Sequence[np.ndarray],
    *,
    sampling_rate: int | None = None,
    spec: FeatureSpec = FeatureSpec(),
) -> dict[str, np.ndarray]:
    """The feeds ``audio`` and ``audio_lengths`` for PCM, or an ``AudioInputError`` saying why not.

    ``audio`` is one mono row (``[samples]``), a batch ``[batch, samples]`` of rows that all fill
    it, or a list of rows of different lengths (zero-padded here, their lengths kept). A
    ``sampling_rate`` other than the model's is refused: resample first.
    """
    if sampling_rate is not None and sampling_rate != spec.sampling_rate:
        raise AudioInputError(
            f"the audio is sampled at {sampling_rate} Hz; the model reads {spec.sampling_rate} Hz: "
            "resample it first (e.g. librosa.resample, or torchaudio.functional.resample)"
        )
    if isinstance(audio, np.ndarray):
        rows = [audio] if audio.ndim == 1 else list(audio) if audio.ndim == 2 else None
        if rows is None:
            raise AudioInputError(
                f"audio has shape {audio.shape}; give mono PCM, [samples] or [batch, samples] "
                "(for stereo, average the channels: audio.mean(axis=channel_axis))"
            )
    else:
        rows = [np.asarray(row) for row in audio]
        bad = [row.shape for row in rows if row.ndim != 1]
        if bad:
            raise AudioInputError(
                f"each row of audio must be mono PCM, [samples]; got shapes {bad} (for stereo, "
                "average the channels)"
            )
    if not rows:
        raise AudioInputError("audio is an empty batch: give at least one row")
    for i, row in enumerate(rows):
        if row.size == 0:
            raise AudioInputError(f"row {i} of audio has no samples")
        if not np.issubdtype(row.dtype, np.floating):
            raise AudioInputError(
                f"row {i} of audio is {row.dtype}; give float PCM in [-1, 1] (int16 / 32768)"
            )
        if not np.isfinite(row).all():
            raise AudioInputError(f"row {i} of audio holds NaN or infinite samples")
    lengths = np.array([min(row.size, spec.n_samples) for row in rows], np.int64)
    batch = np.zeros((len(rows), int(lengths.max())), np.float32)
    for i, row in enumerate(rows):
        batch[i, : lengths[i]] = row[: lengths[i]]
    return {AUDIO: batch, AUDIO_LENGTHS: lengths}


# -- Whisper's decoder prompt ---------------------------------------------------------------------

# generate() keywords of Whisper that choose the prompt rather than the search.
PROMPT_KEYWORDS = ("language", "task", "return_timestamps")


def whisper_prompt(
    generation_config: Mapping[str, Any],
    *,
    language: str | None = None,
    task: str | None = None,
    return_timestamps: bool = False,
) -> list[int]:
    """The decoder prompt Whisper's ``generate()`` starts from (transformers 4.57's
    ``_retrieve_init_tokens``): the start token, then the language and task tokens, then
    ``<|notimestamps|>``; from ``language``/``task``, else the config's ``forced_decoder_ids``.

    Raises ``GenerationError`` where ``generate()`` would detect the language (a multilingual
    model, no language given or forced) and for timestamps: neither is in the graph.
    """
    from onnxmerge.errors import GenerationError

    g = generation_config
    if return_timestamps or g.get("return_timestamps"):
        raise GenerationError(
            "return_timestamps is not in the graph: the generator transcribes without timestamps"
        )
    language = language if language is not None else g.get("language")
    task = task if task is not None else g.get("task")
    start = g.get("decoder_start_token_id")
    if start is None:
        raise GenerationError("the generation config has no decoder_start_token_id")
    prompt: list[int | None] = [int(start)]
    if language is None and task is None:
        prompt += _forced_tokens(g.get("forced_decoder_ids") or [])
    prompt = _with_language(prompt, language, g.get("lang_to_id") or {})
    prompt = _with_task(prompt, task, language, g.get("task_to_id") or {})
    no_timestamps = g.get("no_timestamps_token_id")
    if no_timestamps is not None and prompt[-1] != no_timestamps:
        prompt.append(no_timestamps)
    return [int(t) for t in prompt if t is not None]


def _forced_tokens(forced: list) -> list[int | None]:
    """The tokens ``forced_decoder_ids`` put after the start token, in Whisper's pattern
    (positions 1, 2, ... in order); none where they do not start at position 1."""
    from onnxmerge.errors import GenerationError

    if not forced or forced[0][0] != 1:
        return []
    tokens = []
    for position, (index, token) in enumerate(forced, start=1):
        if index != position:
            raise GenerationError(
                f"forced_decoder_ids {forced} do not follow Whisper's prompt pattern"
            )
        tokens.append(token)
    return tokens


def _with_language(
    prompt: list[int | None], language: str | None, lang_to_id: Mapping[str, int]
) -> list[int | None]:
    """``prompt`` with ``language``'s token second; refuses a multilingual model's prompt
    without one, whose language ``generate()`` would detect."""
    from onnxmerge.errors import GenerationError

    if language is not None:
        token = language if language.startswith("<|") else f"<|{language.lower()}|>"
        if token not in lang_to_id:
            raise GenerationError(
                f"language {language!r} is not one of the model's: give a code such as 'en' "
                f"({', '.join(sorted(lang_to_id)[:8])}, ...)"
            )
        return [*prompt[:1], lang_to_id[token], *prompt[2:]]
    if lang_to_id and (len(prompt) == 1 or prompt[1] is None):
        raise GenerationError(
            "this multilingual Whisper detects the language when none is given, which the graph "
            "does not do: pass language='en' (or another code) in generation_config"
        )
    return prompt


def _with_task(
    prompt: list[int | None], task: str | None, language: str | None, task_to_id: Mapping[str, int]
) -> list[int | None]:
    """``prompt`` with ``task``'s token in place of a forced one or appended; ``transcribe``
    where only a language is given."""
    from onnxmerge.errors import GenerationError

    if task is not None:
        if task not in task_to_id:
            raise GenerationError(f"task {task!r} is not one of {sorted(task_to_id)}")
        tasks = set(task_to_id.values())
        if any(t in tasks for t in prompt):
            return [task_to_id[task] if t in tasks else t for t in prompt]
        return [*prompt, task_to_id[task]]
    if language is not None and task_to_id and not set(task_to_id.values()) & set(prompt):
        return [*prompt, task_to_id["transcribe"]]
    return prompt


__all__ = [
    "AUDIO",
    "AUDIO_LENGTHS",
    "INPUT_FEATURES",
    "META_FEATURES",
    "PREPROCESSOR_CONFIG",
    "DEFAULT_FEATURES_NAME",
    "FEATURES_OPSET",
    "MEL_FLOOR",
    "MAX_FREQUENCY",
    "FeatureSpec",
    "feature_spec",
    "mel_filters",
    "audio_inputs",
    "features_graph",
    "features_model",
    "spec_for_source",
    "build_features",
    "prepare_audio",
    "PROMPT_KEYWORDS",
    "whisper_prompt",
]
