"""The merged model's public interface: input, output and metadata names.

Everything that reads or writes a merged file takes its names from here, so the contract written in
``docs/format.md`` has one implementation.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

from onnxmerge.errors import InvalidArgumentError

# The format versions (docs/format.md). Only this module turns them into facts (FormatFacts) and
# back: readers ask format_of() or ContractInfo, writers record_format().
FORMAT_VERSION = "1"
# Version 2 is version 1 plus weights stored below float32 and META_PRECISION saying which.
QUANTIZED_FORMAT_VERSION = "2"
# Version 3: one decoder for every step; the If only chooses the cross-attention keys/values.
ONE_DECODER_FORMAT_VERSION = "3"
# Version 4: version 3 whose cross-attention keys/values may be fed once per input (beams share).
PER_INPUT_FORMAT_VERSION = "4"
ONE_DECODER_FORMAT_VERSIONS = (ONE_DECODER_FORMAT_VERSION, PER_INPUT_FORMAT_VERSION)
READABLE_FORMAT_VERSIONS = (FORMAT_VERSION, QUANTIZED_FORMAT_VERSION, *ONE_DECODER_FORMAT_VERSIONS)

# metadata_props keys
META_FORMAT_VERSION = "onnxmerge.format_version"
META_LAYOUT = "onnxmerge.layout"
META_CONFIG = "onnxmerge.config"
META_GENERATION_CONFIG = "onnxmerge.generation_config"
META_ENCODER_INPUTS = "onnxmerge.encoder_inputs"
META_GENERATOR = "onnxmerge.generator"  # a generator model (docs/generator.md), not a merged one
MAX_NEW_TOKENS = "max_new_tokens"  # the generator's input besides the encoder's
META_PRECISION = "onnxmerge.precision"  # versions 2-4: precision per part (docs/format.md)
# Version 3, only where a first step of several tokens differs from the decoder without past:
# "1", the prompt is fed one token per step.
META_PROMPT_TOKENS_PER_STEP = "onnxmerge.prompt_tokens_per_step"
# What the merge read: the dtype and the sha256 of each file (onnxmerge.export_layout).
META_SOURCES = "onnxmerge.sources"
# The values META_PRECISION may hold, and those a whole file's weights can be quantized to.
PRECISIONS = ("fp32", "fp16", "int8", "uint8", "int4")
WEIGHT_PRECISIONS = ("int8", "uint8", "fp16", "int4")
# How the products of int8 and uint8 weights quantize their input: one scale for the whole
# tensor, or one per row (docs/quantization.md).
ACTIVATION_SCALES = ("tensor", "row")
# Versions 2-4, in files with int8 or uint8 products: one of ACTIVATION_SCALES. Informational:
# the graph computes the scales itself, and a file without the key runs the same.
META_ACTIVATION_SCALE = "onnxmerge.activation_scale"

LAYOUT_WITH_PAST = "with_past"
LAYOUT_WITHOUT_PAST = "without_past"

DECODER_INPUT_IDS = "decoder_input_ids"
USE_CACHE_BRANCH = "use_cache_branch"
ATTENTION_MASK = "attention_mask"
LOGITS = "logits"

# Names as optimum writes them in its decoder files.
OPTIMUM_DECODER_INPUT_IDS = "input_ids"
OPTIMUM_ENCODER_ATTENTION_MASK = "encoder_attention_mask"
OPTIMUM_ENCODER_HIDDEN_STATES = "encoder_hidden_states"
OPTIMUM_ENCODER_OUTPUT = "last_hidden_state"

CACHE_KINDS = ("key", "value")
_CACHE_NAME = re.compile(r"^(past_key_values|present)\.(\d+)\.(decoder|encoder)\.(key|value)$")


def past_name(layer: int, part: str, kind: str) -> str:
    """``past_key_values.{layer}.{part}.{kind}``; part is decoder|encoder, kind is key|value."""
    return f"past_key_values.{layer}.{part}.{kind}"


def present_name(layer: int, part: str, kind: str) -> str:
    """``present.{layer}.{part}.{kind}``; part is decoder|encoder, kind is key|value."""
    return f"present.{layer}.{part}.{kind}"


def parse_cache_name(name: str) -> tuple[str, int, str, str] | None:
    """Split a past/present name into (prefix, layer, part, kind), or None if it is not one."""
    match = _CACHE_NAME.match(name)
    if match is None:
        return None
    prefix, layer, part, kind = match.groups()
    return prefix, int(layer), part, kind


def past_name_of(present: str) -> str:
    """The past input that the next step feeds ``present`` (a ``present.*`` output) back into."""
    parsed = parse_cache_name(present)
    if parsed is None:
        raise InvalidArgumentError(f"{present!r} is not a past/present name", argument="present")
    return past_name(*parsed[1:])


def present_name_of(past: str) -> str:
    """The present output that a step computes from ``past`` (a ``past_key_values.*`` input)."""
    parsed = parse_cache_name(past)
    if parsed is None:
        raise InvalidArgumentError(f"{past!r} is not a past/present name", argument="past")
    return present_name(*parsed[1:])


def past_names(num_layers: int, part: str) -> list[str]:
    """Every layer's past key and value of ``part`` (decoder|encoder), in the graph's order."""
    return [past_name(i, part, k) for i in range(num_layers) for k in CACHE_KINDS]


def present_names(num_layers: int, part: str) -> list[str]:
    """Every layer's present key and value of ``part`` (decoder|encoder), in the graph's order."""
    return [present_name(i, part, k) for i in range(num_layers) for k in CACHE_KINDS]


def is_encoder_present(name: str) -> bool:
    """A cross-attention present: cached steps return it empty, the caller keeps the first one."""
    parsed = parse_cache_name(name)
    return parsed is not None and parsed[0] == "present" and parsed[2] == "encoder"


def cache_layer(name: str) -> int | None:
    """The layer of a past/present name, or None if it is not one."""
    parsed = parse_cache_name(name)
    return None if parsed is None else parsed[1]


def is_past_name(name: str) -> bool:
    """Whether ``name`` is a cached key or value fed to a step (``past_key_values.*``)."""
    return name.startswith("past_key_values.")


def is_present_name(name: str) -> bool:
    """Whether ``name`` is a key or value a step returns for the cache (``present.*``)."""
    return name.startswith("present.")


@dataclass(frozen=True)
class FormatFacts:
    """What a merged file's format version stands for, as the facts its readers ask about.

    ``one_decoder``: the decoder with past runs every step, the first one included (versions 3
    and 4). ``cross_attention_per_input``: ``past_key_values.*.encoder.*`` may hold one row per
    input, which ``rows / their rows`` consecutive decoder rows read (version 4). ``quantized``:
    ``onnxmerge.quantize`` stored its weights below float32, ``META_PRECISION`` says how (version
    2 for the two-decoder form; versions 3 and 4 keep their number).
    """

    one_decoder: bool = False
    cross_attention_per_input: bool = False
    quantized: bool = False

    def __post_init__(self) -> None:
        if self.cross_attention_per_input and not self.one_decoder:
            raise InvalidArgumentError(
                "cross-attention rows per input exist in the one-decoder form only",
                argument="cross_attention_per_input",
            )

    @property
    def version(self) -> str:
        """The ``META_FORMAT_VERSION`` these facts are written as."""
        if self.cross_attention_per_input:
            return PER_INPUT_FORMAT_VERSION
        if self.one_decoder:
            return ONE_DECODER_FORMAT_VERSION
        return QUANTIZED_FORMAT_VERSION if self.quantized else FORMAT_VERSION


_FACTS_OF_VERSION = {
    FORMAT_VERSION: FormatFacts(),
    QUANTIZED_FORMAT_VERSION: FormatFacts(quantized=True),
    ONE_DECODER_FORMAT_VERSION: FormatFacts(one_decoder=True),
    PER_INPUT_FORMAT_VERSION: FormatFacts(one_decoder=True, cross_attention_per_input=True),
}


def is_merged(metadata: Mapping[str, str]) -> bool:
    """Whether ``metadata`` is a merged file's (written by the merge or quantize; a generator's
    is not), whatever its version."""
    return META_FORMAT_VERSION in metadata


def format_of(metadata: Mapping[str, str], path: object = "the model") -> FormatFacts:
    """The facts a merged file's metadata declares through its format version.

    Raises:
        InvalidMergedModelError: the metadata is not a merged file's (a generator's, say), or
            of a version this onnxmerge does not read.
    """
    from onnxmerge.errors import InvalidMergedModelError

    version = metadata.get(META_FORMAT_VERSION)
    if version is None and META_GENERATOR in metadata:
        raise InvalidMergedModelError(
            f"{path} is a generator model (the decoding loop inside the graph, written by "
            "build_generator or `onnxmerge merge --generation`), not a merged model: run it "
            "with one onnxruntime session.run (docs/generator.md), or generate with the merged "
            "model it was built from (model.onnx)"
        )
    if version is None:
        raise InvalidMergedModelError(
            f"{path} has no {META_FORMAT_VERSION!r} metadata, so it is not a merged model: "
            "merge its export folder first (`onnxmerge merge DIR`, or onnxmerge.merge_seq2seq)"
        )
    facts = _FACTS_OF_VERSION.get(version)
    if facts is None:
        raise InvalidMergedModelError(
            f"the model uses merged-format version {version}, this onnxmerge reads versions "
            f"{', '.join(READABLE_FORMAT_VERSIONS)}; upgrade onnxmerge or merge the export again"
        )
    if META_PRECISION in metadata:
        facts = dataclasses.replace(facts, quantized=True)
    return facts


def record_format(metadata: MutableMapping[str, str], **changes: bool) -> FormatFacts:
    """Write into a merged file's ``metadata`` the version of its facts with ``changes`` (e.g.
    ``quantized=True``); return the new facts.

    Raises:
        InvalidMergedModelError: as :func:`format_of`.
    """
    facts = dataclasses.replace(format_of(metadata), **changes)
    metadata[META_FORMAT_VERSION] = facts.version
    return facts


@dataclass(frozen=True)
class ContractInfo:
    """What a merged file declares about itself, read from its inputs, outputs and metadata."""

    format: FormatFacts
    layout: str
    encoder_inputs: tuple[str, ...]
    num_layers: int
    config: dict = field(default_factory=dict)
    generation_config: dict = field(default_factory=dict)
    precision: dict = field(default_factory=dict)
    # How int8 and uint8 products scale their input (ACTIVATION_SCALES); None where the file has
    # no such products or was quantized before the key was written.
    activation_scale: str | None = None
    # Tokens of a prompt that one step may take (None: any number).
    prompt_tokens_per_step: int | None = None

    @property
    def has_past(self) -> bool:
        """Whether the file caches keys and values between steps."""
        return self.layout == LAYOUT_WITH_PAST

    @property
    def one_decoder(self) -> bool:
        """The decoder with past runs every step, the first one included."""
        return self.format.one_decoder

    @property
    def cross_attention_per_input(self) -> bool:
        """``past_key_values.*.encoder.*`` may hold one row per input, which ``rows / their
        rows`` consecutive decoder rows read."""
        return self.format.cross_attention_per_input

    @property
    def format_version(self) -> str:
        """The version number, for reports; ask the facts (``format``) to decide."""
        return self.format.version


def read_contract(
    metadata: dict[str, str],
    input_names: list[str],
    output_names: list[str],
    path: object = "the model",
) -> ContractInfo:
    """Read the contract of a merged model from its metadata and I/O names.

    Raises:
        InvalidMergedModelError: the names or metadata are not those of a merged seq2seq model.
    """
    from onnxmerge.errors import InvalidMergedModelError

    facts = format_of(metadata, path)
    if DECODER_INPUT_IDS not in input_names or LOGITS not in output_names:
        raise InvalidMergedModelError(
            f"the model lacks the {DECODER_INPUT_IDS!r} input or the {LOGITS!r} output"
        )
    layers = {parsed[1] for name in input_names if (parsed := parse_cache_name(name)) is not None}
    try:
        encoder_inputs = tuple(json.loads(metadata.get(META_ENCODER_INPUTS, "[]")))
        config = json.loads(metadata.get(META_CONFIG, "{}"))
        generation_config = json.loads(metadata.get(META_GENERATION_CONFIG, "{}"))
        precision = json.loads(metadata.get(META_PRECISION, "{}"))
        per_step = metadata.get(META_PROMPT_TOKENS_PER_STEP)
        prompt_tokens_per_step = int(per_step) if per_step is not None else None
    except ValueError as e:
        raise InvalidMergedModelError(
            f"the model's onnxmerge metadata is not valid JSON: {e}"
        ) from e
    return ContractInfo(
        format=facts,
        layout=metadata.get(META_LAYOUT, LAYOUT_WITH_PAST if layers else LAYOUT_WITHOUT_PAST),
        encoder_inputs=encoder_inputs,
        num_layers=len(layers),
        config=config,
        generation_config=generation_config,
        precision=precision,
        activation_scale=metadata.get(META_ACTIVATION_SCALE),
        prompt_tokens_per_step=prompt_tokens_per_step,
    )


__all__ = [
    "FORMAT_VERSION",
    "QUANTIZED_FORMAT_VERSION",
    "ONE_DECODER_FORMAT_VERSION",
    "PER_INPUT_FORMAT_VERSION",
    "ONE_DECODER_FORMAT_VERSIONS",
    "READABLE_FORMAT_VERSIONS",
    "META_FORMAT_VERSION",
    "META_LAYOUT",
    "META_CONFIG",
    "META_GENERATION_CONFIG",
    "META_ENCODER_INPUTS",
    "META_GENERATOR",
    "MAX_NEW_TOKENS",
    "META_PRECISION",
    "META_ACTIVATION_SCALE",
    "META_PROMPT_TOKENS_PER_STEP",
    "META_SOURCES",
    "PRECISIONS",
    "WEIGHT_PRECISIONS",
    "ACTIVATION_SCALES",
    "LAYOUT_WITH_PAST",
    "LAYOUT_WITHOUT_PAST",
    "DECODER_INPUT_IDS",
    "USE_CACHE_BRANCH",
    "ATTENTION_MASK",
    "LOGITS",
    "OPTIMUM_DECODER_INPUT_IDS",
    "OPTIMUM_ENCODER_ATTENTION_MASK",
    "OPTIMUM_ENCODER_HIDDEN_STATES",
    "OPTIMUM_ENCODER_OUTPUT",
    "CACHE_KINDS",
    "past_name",
    "present_name",
    "parse_cache_name",
    "past_name_of",
    "past_names",
    "present_names",
    "is_encoder_present",
    "cache_layer",
    "is_past_name",
    "is_present_name",
    "FormatFacts",
    "is_merged",
    "format_of",
    "record_format",
    "ContractInfo",
    "read_contract",
]
