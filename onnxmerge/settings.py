"""Resolve generation settings the way transformers' ``generate()`` does.

Priority: arguments to ``generate()`` > the model's ``generation_config.json`` (or, without one,
the generation parameters of its ``config.json``) > transformers' global defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from onnxmerge.errors import GenerationError


class Setting(NamedTuple):
    default: Any  # transformers.GenerationConfig's default
    read: Callable[[Any], Any]  # how GenerationSettings holds a given value


def _same(value: Any) -> Any:
    return value


def _int_or_zero(value: Any) -> int:
    return int(value or 0)


def _as_token_list(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


# Every setting this runtime reads. A new setting is one entry here and one field of
# GenerationSettings; generate() accepts it by name. Lengths and special tokens are resolved
# together in resolve_settings, so their ``read`` is not used.
SCHEMA: dict[str, Setting] = {
    "max_length": Setting(20, int),
    "max_new_tokens": Setting(None, _same),
    "min_length": Setting(0, _int_or_zero),
    "min_new_tokens": Setting(None, _same),
    "early_stopping": Setting(False, _same),
    "do_sample": Setting(False, bool),
    "num_beams": Setting(1, int),
    "num_return_sequences": Setting(1, int),
    "temperature": Setting(1.0, float),
    "top_k": Setting(50, _same),
    "top_p": Setting(1.0, float),
    "repetition_penalty": Setting(1.0, float),
    "length_penalty": Setting(1.0, float),
    "no_repeat_ngram_size": Setting(0, _int_or_zero),
    "encoder_repetition_penalty": Setting(1.0, float),
    "encoder_no_repeat_ngram_size": Setting(0, _int_or_zero),
    "bad_words_ids": Setting(None, _same),
    "forced_bos_token_id": Setting(None, _same),
    "forced_eos_token_id": Setting(None, _as_token_list),
    "suppress_tokens": Setting(None, _as_token_list),
    "begin_suppress_tokens": Setting(None, _as_token_list),
    "pad_token_id": Setting(None, _same),
    "bos_token_id": Setting(None, _same),
    "eos_token_id": Setting(None, _as_token_list),
    "decoder_start_token_id": Setting(None, _same),
}

GLOBAL_DEFAULTS: dict[str, Any] = {name: setting.default for name, setting in SCHEMA.items()}

# Keywords of generate(): every setting but bos_token_id, which only the model's configs set
# (it stands in for a missing decoder start token).
GENERATE_KEYWORDS = frozenset(SCHEMA) - {"bos_token_id"}

# Parameters that change the output and that this runtime does not implement: refuse them rather
# than silently generate something else. Values are the settings that mean "off".
UNSUPPORTED_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "min_p": (None,),
    "typical_p": (1.0, None),
    "epsilon_cutoff": (0.0, None),
    "eta_cutoff": (0.0, None),
    "sequence_bias": (None,),
    "renormalize_logits": (False, None),
    "remove_invalid_values": (False, None),
    "exponential_decay_length_penalty": (None,),
    "guidance_scale": (None, 1, 1.0),
    "num_beam_groups": (1, None),
    "diversity_penalty": (0.0, None),
    "penalty_alpha": (None,),
    "constraints": (None,),
    "force_words_ids": (None,),
    "forced_decoder_ids": (None, []),
    "max_time": (None,),
    "stop_strings": (None,),
}


@dataclass
class GenerationSettings:
    """Every setting a search reads, after defaults, special tokens and lengths are resolved."""

    max_length: int
    min_length: int
    min_new_tokens: int | None
    max_new_tokens: int | None
    early_stopping: bool | str
    do_sample: bool
    num_beams: int
    num_return_sequences: int
    temperature: float
    top_k: int | None
    top_p: float
    repetition_penalty: float
    length_penalty: float
    no_repeat_ngram_size: int
    encoder_repetition_penalty: float
    encoder_no_repeat_ngram_size: int
    bad_words_ids: list[list[int]] | None
    forced_bos_token_id: int | None
    forced_eos_token_id: list[int] | None
    suppress_tokens: list[int] | None
    begin_suppress_tokens: list[int] | None
    pad_token_id: int | None
    eos_token_id: list[int] | None
    decoder_start_token_id: int
    prompt_length: int = 1

    @property
    def begin_suppress_index(self) -> int:
        """The sequence length at which ``begin_suppress_tokens`` apply: the first generated
        token, or the one after a forced bos that follows a lone start token (transformers)."""
        if self.prompt_length == 1 and self.forced_bos_token_id is not None:
            return self.prompt_length + 1
        return self.prompt_length


def model_generation_defaults(config: dict, generation_config: dict) -> dict[str, Any]:
    """The model's own generation parameters: its generation config, else its config's."""
    source = generation_config if generation_config else config
    defaults = dict(GLOBAL_DEFAULTS)
    for key in list(GLOBAL_DEFAULTS) + list(UNSUPPORTED_OFF_VALUES):
        if key in source and source[key] is not None:
            defaults[key] = source[key]
    return defaults


def resolve_settings(
    config: dict,
    generation_config: dict,
    overrides: dict[str, Any],
    prompt_length: int,
) -> GenerationSettings:
    """Merge defaults and ``overrides`` (None means "not given") and resolve lengths and tokens.

    ``prompt_length`` is the decoder prompt's length (1 for the decoder start token alone).
    """
    values, given = _merged_values(config, generation_config, overrides)
    eos = _as_token_list(values["eos_token_id"])
    pad = values["pad_token_id"]
    if pad is None and eos is not None:
        pad = eos[0]
    start = values["decoder_start_token_id"]
    if start is None:
        start = values["bos_token_id"]
    if start is None:
        raise GenerationError(
            "neither decoder_start_token_id nor bos_token_id is set in the model's configs; pass "
            "decoder_input_ids that start with the decoder start token"
        )
    max_length, min_length = _lengths(config, values, given, prompt_length)
    fields = {f.name for f in dataclasses.fields(GenerationSettings)}
    read = {name: SCHEMA[name].read(values[name]) for name in SCHEMA if name in fields}
    read.update(
        max_length=max_length,
        min_length=min_length,
        pad_token_id=None if pad is None else int(pad),
        eos_token_id=eos,
        decoder_start_token_id=int(start),
    )
    settings = GenerationSettings(**read, prompt_length=prompt_length)
    validate_settings(settings)
    return settings


def _merged_values(
    config: dict, generation_config: dict, overrides: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every setting's value, overrides over the model's, and the overrides given; refuses
    settings this runtime does not implement or know."""
    values = model_generation_defaults(config, generation_config)
    for key, off in UNSUPPORTED_OFF_VALUES.items():
        if key in values and values[key] not in off:
            raise GenerationError(
                f"the model's generation config sets {key}={values[key]!r}, which this runtime "
                "does not implement; pass a supported configuration or use transformers for "
                "this model"
            )
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(given) - set(GLOBAL_DEFAULTS))
    if unknown:
        raise GenerationError(f"unknown generation settings: {', '.join(unknown)}")
    values.update(given)
    return values, given


def _lengths(
    config: dict, values: dict[str, Any], given: dict[str, Any], prompt_length: int
) -> tuple[int, int]:
    """``max_length`` and ``min_length`` of the whole sequence, prompt included, as
    transformers resolves them; refuses a length past the decoder's positions."""
    max_length = values["max_length"]
    if values["max_new_tokens"] is not None:
        max_length = values["max_new_tokens"] + prompt_length
    elif "max_length" not in given and max_length == GLOBAL_DEFAULTS["max_length"]:
        # transformers: an unset max_length means 20 new tokens, capped by the positions.
        max_length = max_length + prompt_length
        positions = decoder_positions(config)
        if positions is not None:
            max_length = min(max_length, positions)
    _check_decoder_positions(config, int(max_length), prompt_length)
    min_length = values["min_length"]
    if values["min_new_tokens"] is not None:
        min_length = values["min_new_tokens"] + prompt_length
    return int(max_length), int(min_length or 0)


def encoder_positions(config: dict) -> int | None:
    """How many ``input_ids`` the encoder's position table holds; None where nothing bounds them
    (T5's relative positions) or the encoder reads no ids (Whisper's audio frames)."""
    positions = config.get("max_position_embeddings")
    return positions if isinstance(positions, int) else None


def decoder_positions(config: dict) -> int | None:
    """How many positions the decoder's table holds (Whisper: ``max_target_positions``); None
    where nothing bounds them."""
    positions = config.get("max_target_positions", config.get("max_position_embeddings"))
    return positions if isinstance(positions, int) else None


def _check_decoder_positions(config: dict, max_length: int, prompt_length: int) -> None:
    """Refuse a length past the decoder's positions before anything runs, rather than fail in
    the runtime mid-corpus: every token but the last is fed back, at positions 0..max_length-2."""
    positions = decoder_positions(config)
    if positions is None or max_length <= positions + 1:
        return
    if prompt_length > positions:
        raise GenerationError(
            f"the decoder prompt has {prompt_length} tokens, more than the decoder's "
            f"{positions} positions"
        )
    raise GenerationError(
        f"max_length {max_length} ({max_length - prompt_length} new tokens) is past the "
        f"decoder's {positions} positions: give max_new_tokens of at most "
        f"{positions + 1 - prompt_length}"
    )


def validate_settings(s: GenerationSettings) -> None:
    """Refuse settings that cannot run together.

    Raises:
        GenerationError: a count below 1, more sequences than beams, or another combination
            ``generate()`` refuses; the message names the setting.
    """
    if s.num_beams < 1:
        raise GenerationError(f"num_beams must be >= 1, got {s.num_beams}")
    if s.num_return_sequences < 1:
        raise GenerationError(f"num_return_sequences must be >= 1, got {s.num_return_sequences}")
    if s.num_beams > 1 and s.num_return_sequences > s.num_beams:
        raise GenerationError(
            f"num_return_sequences ({s.num_return_sequences}) must be <= num_beams ({s.num_beams})"
        )
    if s.num_beams == 1 and not s.do_sample and s.num_return_sequences > 1:
        raise GenerationError(
            "greedy search returns one sequence per input: set num_beams >= num_return_sequences "
            "or do_sample=True"
        )
    if s.max_new_tokens is not None and s.max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be >= 1, got {s.max_new_tokens}")
    if s.prompt_length >= s.max_length:
        raise GenerationError(
            f"decoder_input_ids are {s.prompt_length} tokens long but max_length is "
            f"{s.max_length}; "
            "raise max_length or set max_new_tokens"
        )
    if s.early_stopping not in (True, False, "never"):
        raise GenerationError(
            f"early_stopping must be True, False or 'never', got {s.early_stopping!r}"
        )
    if s.do_sample and not s.temperature > 0:
        raise GenerationError(f"temperature must be > 0 when sampling, got {s.temperature}")
    if s.do_sample and not 0 <= s.top_p <= 1:
        raise GenerationError(f"top_p must be in [0, 1], got {s.top_p}")
    if s.top_k is not None and s.top_k < 0:
        raise GenerationError(f"top_k must be >= 0, got {s.top_k}")
    if s.repetition_penalty <= 0:
        raise GenerationError(f"repetition_penalty must be > 0, got {s.repetition_penalty}")
    if s.no_repeat_ngram_size < 0:
        raise GenerationError(f"no_repeat_ngram_size must be >= 0, got {s.no_repeat_ngram_size}")
    if s.bad_words_ids is not None and (
        not isinstance(s.bad_words_ids, list)
        or not s.bad_words_ids
        or not all(isinstance(w, (list, tuple)) and w for w in s.bad_words_ids)
    ):
        raise GenerationError("bad_words_ids must be a non-empty list of non-empty lists of ids")


__all__ = [
    "Setting",
    "SCHEMA",
    "GLOBAL_DEFAULTS",
    "GENERATE_KEYWORDS",
    "UNSUPPORTED_OFF_VALUES",
    "GenerationSettings",
    "model_generation_defaults",
    "resolve_settings",
    "validate_settings",
    "encoder_positions",
    "decoder_positions",
]
