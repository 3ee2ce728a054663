"""Long-form Whisper: audio longer than one window decoded as transformers'
``WhisperForConditionalGeneration.generate()`` does it (``models/whisper/generation_whisper.py``):
sequential windows moved by the last timestamp token, timestamp rules, segments,
``condition_on_prev_tokens`` and the temperature fallback.

Each row of a batch is decoded alone, in windows, with the model's step API; transformers
decodes the rows of a window together, which gives the same tokens up to float rounding.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxmerge import contract as c
from onnxmerge.errors import GenerationError

if TYPE_CHECKING:
    from onnxmerge.runtime._model import Seq2SeqModel
    from onnxmerge.runtime._search import TokenPicker

# generate() keywords that only long-form decoding reads.
LONGFORM_KEYWORDS = frozenset(
    {
        "return_timestamps",
        "return_segments",
        "condition_on_prev_tokens",
        "compression_ratio_threshold",
        "logprob_threshold",
        "no_speech_threshold",
        "language",
        "task",
        "time_precision",
        "time_precision_features",
        "monitor_progress",
    }
)
# Frames of log-mel per encoder position (Whisper's two convolutions, strides 1 and 2).
INPUT_STRIDE = 2


def window_frames(config: dict) -> int:
    """Log-mel frames one window holds: 3,000 for Whisper (30 s)."""
    return INPUT_STRIDE * int(config.get("max_source_positions", 1500))


def applies(model: Seq2SeqModel, encoder_inputs: Any, keywords: dict[str, Any]) -> bool:
    """Whether ``generate()`` decodes in windows: a Whisper model given more frames than one
    window, or asked for timestamps or segments."""
    if model.model_type != "whisper":
        return False
    if keywords.get("return_timestamps") or keywords.get("return_segments"):
        return True
    features = _features(encoder_inputs, keywords)
    return features is not None and features.shape[-1] > window_frames(model.config)


def _features(encoder_inputs: Any, keywords: dict[str, Any]) -> np.ndarray | None:
    if isinstance(encoder_inputs, np.ndarray):
        return encoder_inputs
    if isinstance(encoder_inputs, dict) and "input_features" in encoder_inputs:
        return np.asarray(encoder_inputs["input_features"])
    value = keywords.get("input_features")
    return None if value is None else np.asarray(value)


@dataclass
class _Plan:
    """What one long-form call decodes with, read once from the keywords and configs."""

    window: int
    timestamp_begin: int
    no_timestamps: int | None
    return_timestamps: bool
    eos: int
    pad: int
    prev_sot: int | None
    suppress: list[int]
    begin_suppress: list[int]
    max_initial_timestamp: int | None
    max_new_tokens: int | None
    lengths: dict[str, int]
    max_positions: int
    temperatures: list[float]
    condition: bool
    compression_ratio_threshold: float | None
    logprob_threshold: float | None
    no_speech_threshold: float | None
    time_precision: float
    time_precision_features: float
    vocab_size: int
    top_k: int | None
    language: Any = None
    task: str | None = None
    lang_to_id: dict[str, int] = field(default_factory=dict)


def generate(
    model: Seq2SeqModel,
    encoder_inputs: Any,
    decoder_input_ids: np.ndarray | None,
    seed: int | None,
    keywords: dict[str, Any],
) -> np.ndarray | dict[str, Any]:
    """Long-form ``generate()``: the generated ids of every window, joined and right-padded
    with the pad token, without the prompt and eos, as transformers returns them; with
    ``return_segments=True`` a dict of ``sequences`` and ``segments`` (per row, a list of
    ``{"start", "end", "tokens"}``, times in seconds).

    Raises:
        GenerationError: invalid inputs or settings, or an option this runtime does not have.
    """
    if decoder_input_ids is not None:
        raise GenerationError(
            "long-form decoding builds its own decoder prompt; drop decoder_input_ids",
            argument="decoder_input_ids",
        )
    features, mask = _inputs(model, encoder_inputs, keywords)
    plan = _plan(model, keywords, features.shape[-1])
    rng = np.random.default_rng(seed)
    rows = features.shape[0]
    if rows > 1 and mask is None:
        raise GenerationError(
            "long-form decoding of a batch needs the attention_mask of the features, to know "
            "where each row's audio ends",
            argument="attention_mask",
        )
    positions = np.zeros((rows, 2), dtype=np.int64)  # each row's frames done and in all
    positions[:, 1] = mask.sum(-1) if rows > 1 and mask is not None else features.shape[-1]
    monitor = keywords.get("monitor_progress")
    all_segments: list[list[dict[str, Any]]] = []
    first_found: list[int] = []  # the window where the first row found its first segment
    for row in range(rows):

        def report(seek: int, row: int = row) -> None:
            positions[row, 0] = seek
            if monitor is not None:
                monitor(positions.copy())

        init = _init_tokens(model, plan, features[row : row + 1])
        frames = int(positions[row, 1])
        segments = _decode_row(
            model, plan, features[row : row + 1], frames, init, rng, report, first_found
        )
        all_segments.append(segments)
    sequences = _join(all_segments, plan.pad)
    if keywords.get("return_segments"):
        return {"sequences": sequences, "segments": all_segments}
    return sequences


def _inputs(
    model: Seq2SeqModel, encoder_inputs: Any, keywords: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray | None]:
    inputs = {"input_features", c.ATTENTION_MASK}
    if isinstance(encoder_inputs, np.ndarray):
        encoder_inputs = {"input_features": encoder_inputs}
    given = dict(encoder_inputs or {})
    given.update({k: v for k, v in keywords.items() if k in inputs})
    unknown = sorted((set(keywords) | set(given)) - inputs - LONGFORM_KEYWORDS - _SETTINGS_READ)
    if unknown:
        raise GenerationError(
            f"long-form decoding does not take {unknown}; it reads "
            f"{sorted(LONGFORM_KEYWORDS | _SETTINGS_READ)}",
            argument=unknown[0],
        )
    features = given.get("input_features")
    if not isinstance(features, np.ndarray) or features.ndim != 3:
        raise GenerationError(
            "input_features must be a numpy array [batch, mel bins, frames]",
            argument="input_features",
        )
    bins = model.config.get("num_mel_bins")
    if bins is not None and features.shape[1] != bins:
        raise GenerationError(
            f"input_features has {features.shape[1]} mel bins, the model takes {bins}",
            argument="input_features",
        )
    mask = given.get(c.ATTENTION_MASK)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.shape != (features.shape[0], features.shape[-1]):
            raise GenerationError(
                f"attention_mask has shape {tuple(mask.shape)}; give one value per frame, "
                f"{(features.shape[0], features.shape[-1])}",
                argument="attention_mask",
            )
    return np.ascontiguousarray(features, dtype=np.float32), mask


# generate() settings long-form decoding reads (the others are refused, not ignored).
_SETTINGS_READ = frozenset(
    {
        "max_new_tokens",
        "max_length",
        "temperature",
        "suppress_tokens",
        "begin_suppress_tokens",
        "eos_token_id",
        "pad_token_id",
        "decoder_start_token_id",
        "top_k",
    }
)


def _setting(name: str, keywords: dict[str, Any], generation: dict, default: Any = None) -> Any:
    value = keywords.get(name)
    return value if value is not None else generation.get(name, default)


def _plan(model: Seq2SeqModel, keywords: dict[str, Any], frames: int) -> _Plan:
    """The settings of one long-form call, as transformers resolves them."""
    generation, config = model.generation_config, model.config
    no_timestamps = generation.get("no_timestamps_token_id")
    return_timestamps = _return_timestamps(model, keywords, frames)
    eos = _setting("eos_token_id", keywords, generation, config.get("eos_token_id"))
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    # Whisper reads the temperature given to generate() only, never the generation config.
    temperature = keywords.get("temperature")
    temperatures = list(temperature) if isinstance(temperature, (list, tuple)) else [temperature]
    suppress = list(_setting("suppress_tokens", keywords, generation, None) or [])
    prev_sot = generation.get("prev_sot_token_id")
    if prev_sot is None and len(suppress) >= 2:
        prev_sot = suppress[-2]
    return _Plan(
        window=window_frames(config),
        timestamp_begin=no_timestamps + 1
        if no_timestamps is not None
        else config["vocab_size"] + 1,
        no_timestamps=no_timestamps,
        return_timestamps=return_timestamps,
        eos=int(eos),
        pad=int(_setting("pad_token_id", keywords, generation, config.get("pad_token_id"))),
        prev_sot=prev_sot,
        suppress=suppress,
        begin_suppress=list(_setting("begin_suppress_tokens", keywords, generation, None) or []),
        max_initial_timestamp=generation.get("max_initial_timestamp_index"),
        max_new_tokens=keywords.get("max_new_tokens", generation.get("max_new_tokens")),
        lengths={k: keywords[k] for k in ("max_length", "max_new_tokens") if k in keywords},
        max_positions=int(config.get("max_target_positions", 448)),
        temperatures=[float(t) if t is not None else 0.0 for t in temperatures],
        condition=bool(_setting("condition_on_prev_tokens", keywords, generation, False)),
        compression_ratio_threshold=_setting("compression_ratio_threshold", keywords, generation),
        logprob_threshold=_setting("logprob_threshold", keywords, generation),
        no_speech_threshold=_setting("no_speech_threshold", keywords, generation),
        time_precision=float(keywords.get("time_precision") or 0.02),
        time_precision_features=float(keywords.get("time_precision_features") or 0.01),
        vocab_size=int(config["vocab_size"]),
        top_k=_setting("top_k", keywords, generation, 50),
        language=_setting("language", keywords, generation),
        task=_setting("task", keywords, generation),
        lang_to_id=dict(generation.get("lang_to_id") or {}),
    )


def _return_timestamps(model: Seq2SeqModel, keywords: dict[str, Any], frames: int) -> bool:
    """Whether windows predict timestamps: asked for, or needed past one window."""
    generation = model.generation_config
    if (
        _setting("no_speech_threshold", keywords, generation) is not None
        and _setting("logprob_threshold", keywords, generation) is None
    ):
        raise GenerationError(
            "no_speech_threshold needs logprob_threshold: a window is skipped as silence when "
            "its tokens are unlikely and no-speech is likely",
            argument="no_speech_threshold",
        )
    return_timestamps = bool(_setting("return_timestamps", keywords, generation, False))
    if frames > window_frames(model.config):
        if keywords.get("return_timestamps") is False:
            raise GenerationError(
                "features longer than one window need timestamps: pass return_timestamps=True "
                "or at most one window of frames",
                argument="return_timestamps",
            )
        return_timestamps = True
    if return_timestamps and generation.get("no_timestamps_token_id") is None:
        why = (
            f"input_features has {frames} frames, more than one window "
            f"({window_frames(model.config)}): long-form decoding needs timestamps, and "
            if frames > window_frames(model.config)
            else ""
        )
        raise GenerationError(
            f"{why}timestamps need the generation config's no_timestamps_token_id (Whisper's "
            "generation_config.json has it); set model.generation_config['no_timestamps_token_id']",
            argument="return_timestamps",
        )
    return return_timestamps


def _language_id(plan: _Plan, language: str) -> int:
    token = language if language.startswith("<|") else f"<|{language.lower()}|>"
    if token not in plan.lang_to_id:
        raise GenerationError(
            f"language {language!r} is not in the generation config's lang_to_id",
            argument="language",
        )
    return int(plan.lang_to_id[token])


def _init_tokens(model: Seq2SeqModel, plan: _Plan, features: np.ndarray) -> list[int]:
    """The decoder prompt of every window: start, language (given, or detected on the first
    window), task, and no-timestamps unless timestamps are asked for."""
    generation = model.generation_config
    start = int(generation.get("decoder_start_token_id", model.config["decoder_start_token_id"]))
    tokens: list[int | None] = [start]
    if plan.language is None and plan.task is None:
        forced = generation.get("forced_decoder_ids") or model.config.get("forced_decoder_ids")
        for position, token in sorted(forced or []):
            if position == len(tokens):
                tokens.append(token)
    if plan.language is not None:
        language = plan.language[0] if isinstance(plan.language, list) else plan.language
        _put_language(tokens, _language_id(plan, language))
    elif plan.lang_to_id and (len(tokens) <= 1 or tokens[1] is None):
        _put_language(tokens, _detect_language(model, plan, features, start))
    task_ids = generation.get("task_to_id") or {}
    if plan.task is not None:
        if plan.task not in task_ids:
            raise GenerationError(f"task {plan.task!r} is not in task_to_id", argument="task")
        tokens = [t for t in tokens if t not in task_ids.values()] + [task_ids[plan.task]]
    elif plan.language is not None and task_ids and not set(tokens) & set(task_ids.values()):
        tokens.append(task_ids["transcribe"])
    if not plan.return_timestamps and plan.no_timestamps is not None:
        if tokens[-1] != plan.no_timestamps:
            tokens.append(plan.no_timestamps)
    elif plan.return_timestamps and tokens[-1] == plan.no_timestamps:
        tokens = tokens[:-1]
    return [int(t) for t in tokens if t is not None]


def _put_language(tokens: list[int | None], language_id: int) -> None:
    if len(tokens) > 1:
        tokens[1] = language_id
    else:
        tokens.append(language_id)


def _detect_language(model: Seq2SeqModel, plan: _Plan, features: np.ndarray, start: int) -> int:
    """The language token most likely after the start token, on the first window."""
    window = _window(features, 0, plan.window, plan.window)
    logits = model.first_step(window, np.array([[start]], dtype=np.int64)).logits[0, -1]
    languages = np.array(sorted(plan.lang_to_id.values()))
    return int(languages[np.argmax(logits[languages])])


def _window(features: np.ndarray, seek: int, frames: int, size: int) -> dict[str, np.ndarray]:
    cut = features[:, :, seek : seek + frames]
    if cut.shape[-1] < size:
        cut = np.pad(cut, ((0, 0), (0, 0), (0, size - cut.shape[-1])))
    return {"input_features": np.ascontiguousarray(cut)}


@dataclass
class _Decoded:
    """One decoding of a window: the generated tokens (eos included, where it came) and, where
    ``logprob_threshold`` reads them, the log-probability of each under the processed scores."""

    tokens: list[int]
    logprobs: list[float]
    no_speech: float = 0.0


def _decode_row(
    model: Seq2SeqModel,
    plan: _Plan,
    features: np.ndarray,
    frames: int,
    init: list[int],
    rng: np.random.Generator,
    report: Callable[[int], None],
    first_found: list[int],
) -> list[dict[str, Any]]:
    """Every segment of one row, window after window, each window starting at the last
    timestamp of the one before; ``report`` hears the frames done after each window.

    ``first_found`` holds the window in which the batch's first row found its first segment
    (this row records it when it is the first): transformers conditions every row of its
    batch on previous tokens from that window on, a row without any on the start token alone.
    """
    segments: list[dict[str, Any]] = []
    seek, condition, number, lead = 0, plan.condition, 0, not first_found
    while seek < frames:
        time_offset = seek * plan.time_precision / INPUT_STRIDE
        window_size = min(frames - seek, plan.window)
        window = _window(features, seek, window_size, plan.window)
        conditioned = plan.condition and (
            bool(segments) if lead else bool(first_found) and first_found[0] < number
        )
        prompt = _prompt(plan, init, segments if condition else [], conditioned)
        sot = len(prompt) - len(init)
        tokens, temperature, skip = _with_fallback(model, plan, window, prompt, sot, rng)
        condition = plan.condition and temperature < 0.5
        if skip:  # silence: no segment, on to the next window
            seek += window_size
        else:
            found, offset = _segments(plan, tokens, time_offset, window_size)
            segments += found
            seek += offset
            if lead and not first_found and found:
                first_found.append(number)
        number += 1
        report(min(seek, frames))
    return segments


def _prompt(
    plan: _Plan, init: list[int], segments: list[dict[str, Any]], conditioned: bool
) -> list[int]:
    """The window's decoder prompt: the previous windows' last tokens (after the previous
    start-of-transcript token) before ``init``, when conditioning on them."""
    if not conditioned:
        return list(init)
    previous: list[int] = []
    for segment in segments:
        tokens = [int(t) for t in segment["tokens"]]
        # A segment that ends on two timestamps gives the model one of them.
        if len(tokens) > 2 and tokens[-2] >= plan.timestamp_begin:
            tokens = tokens[:-1]
        previous += tokens
    previous = previous[-(plan.max_positions // 2 - 1) :]
    start = [plan.prev_sot] if plan.prev_sot is not None else []
    return start + previous + list(init)


def _with_fallback(
    model: Seq2SeqModel,
    plan: _Plan,
    window: dict[str, np.ndarray],
    prompt: list[int],
    sot: int,
    rng: np.random.Generator,
) -> tuple[list[int], float, bool]:
    """Decode a window at each temperature in turn until the result passes the compression
    and log-probability thresholds; the tokens without eos, the temperature used and whether
    the window is silence. ``sot``: where the start-of-transcript token is in the prompt."""
    max_length = _max_length(model, plan, len(prompt))
    tokens: list[int] = []
    temperature, skip = plan.temperatures[0], False
    for temperature in plan.temperatures:
        decoded = _decode(model, plan, window, prompt, sot, max_length, temperature, rng)
        tokens = decoded.tokens
        if tokens and tokens[-1] == plan.pad:
            # transformers strips as many tokens as the sequence holds pad tokens.
            paddings = tokens.count(plan.pad) - (1 if plan.pad == plan.eos else 0)
            tokens = tokens[: len(tokens) - paddings] if paddings else tokens
        retry, skip = _needs_fallback(plan, tokens, decoded)
        if tokens and tokens[-1] == plan.eos:
            tokens = tokens[:-1]
        if not retry:
            break
    return tokens, temperature, skip


def _max_length(model: Seq2SeqModel, plan: _Plan, prompt_length: int) -> int:
    """The window's length limit, prompt included, as transformers sets it."""
    if plan.max_new_tokens is not None and plan.max_new_tokens + prompt_length > plan.max_positions:
        raise GenerationError(
            f"the decoder prompt ({prompt_length} tokens, with the previous window's) and "
            f"max_new_tokens={plan.max_new_tokens} exceed the model's {plan.max_positions} "
            "positions; lower max_new_tokens",
            argument="max_new_tokens",
        )
    return model.resolve_settings(prompt_length, **plan.lengths).max_length


def _needs_fallback(plan: _Plan, tokens: list[int], decoded: _Decoded) -> tuple[bool, bool]:
    """Whether the window's text repeats too much or is too unlikely, and whether it is
    silence instead: unlikely text where no-speech is likely (transformers' ``_need_fallback``;
    eos counts)."""
    retry, unlikely = False, False
    if plan.compression_ratio_threshold is not None and tokens:
        width = int(math.log2(plan.vocab_size) / 8) + 1
        raw = b"".join(t.to_bytes(width, "little") for t in tokens)
        retry = len(raw) / len(zlib.compress(raw)) > plan.compression_ratio_threshold
    if plan.logprob_threshold is not None and tokens:
        average = sum(decoded.logprobs[: len(tokens)]) / len(tokens)
        unlikely = average < plan.logprob_threshold
        retry = retry or unlikely
    if plan.no_speech_threshold is not None and unlikely:
        if decoded.no_speech > plan.no_speech_threshold:
            return False, True
    return retry, False


def _decode(
    model: Seq2SeqModel,
    plan: _Plan,
    window: dict[str, np.ndarray],
    prompt: list[int],
    sot: int,
    max_length: int,
    temperature: float,
    rng: np.random.Generator,
) -> _Decoded:
    """Greedy (temperature 0) or sampled decoding of one window, at least one token, until
    eos or ``max_length`` tokens with the prompt.

    Greedy decoding that needs no log-probabilities (no ``logprob_threshold``) runs its cached
    steps through the session's int8 head where it has one (``session_cache=``): the timestamp
    rule reads the timestamps' float logits, the bounds screen the text tokens."""
    sequence = list(prompt)
    scored = plan.logprob_threshold is not None
    runner = model._greedy_runner(
        model._step_inputs(window),
        np.array([prompt], dtype=np.int64),
        max_length,
        bounded=temperature == 0.0 and not scored,
    )
    first = runner.start(every_position=True)[0]
    decoded = _Decoded([], [])
    if plan.no_speech_threshold is not None and plan.no_timestamps is not None:
        # The no-speech token's probability right after start-of-transcript.
        after_sot = np.exp(_log_softmax(first[sot].astype(np.float32)))
        decoded.no_speech = float(after_sot[plan.no_timestamps - 1])
    processors = _WindowProcessors(plan, len(prompt))
    logits: np.ndarray | TokenPicker = first[-1:]
    while True:
        if not isinstance(logits, np.ndarray):  # the greedy head's bounds
            token = int(logits.argmax(processors, np.array([sequence]))[0])
        else:
            # In place: the runner's own array, which nothing reads after this.
            scores = _process(plan, np.asarray(logits[0], dtype=np.float32), sequence, len(prompt))
            if temperature > 0.0:
                token = _sample(scores / temperature, plan.top_k, rng)
            else:
                token = int(np.argmax(scores))
            if scored:
                decoded.logprobs.append(float(_log_softmax(scores)[token]))
        sequence.append(token)
        decoded.tokens.append(token)
        if token == plan.eos or len(sequence) >= max_length:
            return decoded
        logits = runner.advance(np.array([token], dtype=np.int64))


class _WindowProcessors:
    """:func:`_process` as a list of processors over ``[rows, vocab]`` scores, for the greedy
    head's bounds: the timestamp rule weighs the timestamps' probabilities together (their
    float logits, ``exact_columns``); everything else it does is masking."""

    keeps_bounds = True

    def __init__(self, plan: _Plan, begin: int):
        self.plan, self.begin = plan, begin

    def exact_columns(self, input_ids: np.ndarray) -> slice | None:
        """The timestamps the rule weighs at this step: those that no mask sets to -inf
        whatever their scores (not below the latest timestamp, not past the first one's limit,
        none after two timestamps in a row); None where no row has any."""
        plan = self.plan
        if not plan.return_timestamps:
            return None
        low: int | None = None
        high: int | None = plan.timestamp_begin
        for ids in input_ids.tolist():
            row = _weighed_timestamps(plan, ids[self.begin :])
            if row is not None:
                low = row.start if low is None else min(low, row.start)
                high = None if row.stop is None or high is None else max(high, row.stop)
        return None if low is None else slice(low, high)

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        for row, ids in zip(scores, input_ids.tolist(), strict=True):
            _process(self.plan, row, ids, self.begin)
        return scores


def _sample(scores: np.ndarray, top_k: int | None, rng: np.random.Generator) -> int:
    if top_k:
        kept = min(int(top_k), scores.size)
        threshold = np.partition(scores, -kept)[-kept]
        scores = np.where(scores < threshold, -np.inf, scores)
    probabilities = np.exp(_log_softmax(scores))
    return int(rng.choice(scores.size, p=probabilities / probabilities.sum()))


def _log_softmax(scores: np.ndarray) -> np.ndarray:
    top = np.max(scores)
    shifted = scores - top
    return shifted - np.log(np.sum(np.exp(shifted)))


def _process(plan: _Plan, scores: np.ndarray, sequence: list[int], begin: int) -> np.ndarray:
    """The step's scores after transformers' Whisper processors, in their order: tokens
    suppressed at the first step, tokens always suppressed, then the timestamp rules."""
    at_begin = len(sequence) == begin
    if at_begin and plan.begin_suppress:
        scores[plan.begin_suppress] = -np.inf
    if plan.suppress:
        scores[plan.suppress] = -np.inf
    if plan.return_timestamps:
        _timestamp_rules(plan, scores, sequence[begin:], at_begin)
    return scores


def _timestamp_rules(plan: _Plan, scores: np.ndarray, generated: list[int], at_begin: bool) -> None:
    """``WhisperTimeStampLogitsProcessor``: timestamps come in pairs, never decrease, open the
    text, and win when their probabilities together beat the likeliest text token."""
    begin = plan.timestamp_begin
    scores[plan.no_timestamps] = -np.inf
    weighed = _weighed_timestamps(plan, generated)
    if weighed is None:
        scores[begin:] = -np.inf
    else:
        scores[begin : weighed.start] = -np.inf
        if weighed.stop is not None:
            scores[weighed.stop :] = -np.inf
    # After a lone timestamp, text cannot come: another timestamp or the end.
    if _closes_pair_next(begin, generated):
        scores[: plan.eos] = -np.inf
    if at_begin:
        scores[:begin] = -np.inf
    # transformers compares log-probabilities; their normalizer is the same on both sides, so
    # the scores are compared as they are, without a softmax over the vocabulary.
    if _logsumexp(scores[begin:]) > np.max(scores[:begin]):
        scores[:begin] = -np.inf


def _weighed_timestamps(plan: _Plan, generated: list[int]) -> slice | None:
    """The timestamps that may follow ``generated`` (None: none may): they come in pairs and
    never decrease, and the first is at most ``max_initial_timestamp``. The rest
    ``_timestamp_rules`` masks, whatever their scores."""
    begin = plan.timestamp_begin
    closes_pair = _closes_pair_next(begin, generated)
    if generated and generated[-1] >= begin and not closes_pair:
        return None  # a pair just closed, or the window opened with a timestamp
    low, high = begin, None
    latest = next((t for t in reversed(generated) if t >= begin), None)
    if latest is not None:
        low = latest if closes_pair else latest + 1
    if not generated and plan.max_initial_timestamp is not None:
        high = begin + plan.max_initial_timestamp + 1
    if low >= (plan.vocab_size if high is None else high):
        return None
    return slice(low, high)


def _closes_pair_next(begin: int, generated: list[int]) -> bool:
    """Whether the next token closes a pair: the last is a timestamp after text, and the
    next may repeat it."""
    return len(generated) >= 2 and generated[-1] >= begin and generated[-2] < begin


def _logsumexp(values: np.ndarray) -> float:
    top = np.max(values)
    if not np.isfinite(top):
        return float(top)
    return float(top + np.log(np.sum(np.exp(values - top))))


def _segments(
    plan: _Plan, tokens: list[int], time_offset: float, window_size: int
) -> tuple[list[dict[str, Any]], int]:
    """The window's segments and how many frames the next window starts after
    (transformers' ``_retrieve_segment``)."""
    begin, precision = plan.timestamp_begin, plan.time_precision
    is_stamp = [t >= begin for t in tokens]
    single_ending = is_stamp[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(tokens) - 1) if is_stamp[i] and is_stamp[i + 1]]
    if not cuts:
        stamps = [t for t in tokens if t >= begin]
        last = int(window_size * plan.time_precision_features / precision)
        if stamps and stamps[-1] != begin:
            last = stamps[-1] - begin
        return [_segment(time_offset, 0.0, last * precision, tokens)], window_size
    if single_ending:
        cuts.append(len(tokens))
    else:
        cuts[-1] += 1  # the last segment keeps its closing timestamp
    segments, start = [], 0
    for number, cut in enumerate(cuts):
        piece = tokens[start:cut]
        end_index = -1 if number < len(cuts) - 1 or single_ending else -2
        segments.append(
            _segment(
                time_offset,
                (piece[0] - begin) * precision,
                (piece[end_index] - begin) * precision,
                piece,
            )
        )
        start = cut
    if single_ending:
        return segments, window_size
    return segments, (tokens[start - 2] - begin) * INPUT_STRIDE


def _segment(offset: float, start: float, end: float, tokens: list[int]) -> dict[str, Any]:
    return {
        "start": offset + start,
        "end": offset + end,
        "tokens": np.array(tokens, dtype=np.int64),
    }


def _join(rows: list[list[dict[str, Any]]], pad: int) -> np.ndarray:
    """Each row's segment tokens end to end, right-padded to the longest row."""
    joined = [
        np.concatenate([s["tokens"] for s in segments]) if segments else np.zeros(0, np.int64)
        for segments in rows
    ]
    width = max((len(j) for j in joined), default=0)
    out = np.full((len(joined), width), pad, dtype=np.int64)
    for row, tokens in enumerate(joined):
        out[row, : len(tokens)] = tokens
    return out
