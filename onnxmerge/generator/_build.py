"""Assemble the generator: the merged model's two decoder branches around an ONNX Loop.

The first step (encoder + decoder without past, the merged model's ``else`` branch) runs in the
main graph; the decoder with past (the ``then`` branch) becomes the Loop body. Both keep reading
the initializers of the main graph from the outer scope, so every weight is stored once, as in
the merged file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from onnxmerge import check, contract, model_io
from onnxmerge.errors import (
    GenerationError,
    InvalidArgumentError,
    InvalidMergedModelError,
)
from onnxmerge.generator import _processor_nodes as processors
from onnxmerge.generator import _search_nodes as search
from onnxmerge.generator import audio as audio_front
from onnxmerge.generator._ops import Names, Ops, typed_input
from onnxmerge.merge import Source, merged_model, resolve_source
from onnxmerge.passes import base as passes_base
from onnxmerge.passes.base import name_of
from onnxmerge.settings import GenerationSettings, resolve_settings

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_NAME = "generator.onnx"
MAX_NEW_TOKENS = contract.MAX_NEW_TOKENS
SEQUENCES = "sequences"
SEQUENCES_SCORES = "sequences_scores"
META_GENERATOR = contract.META_GENERATOR
GENERATOR_VERSION = "1"
SEARCHES = ("greedy", "beam")
SEQUENCES_DIMS = ["batch_size", "sequence_length"]


@dataclass(frozen=True)
class GeneratorResult:
    """What :func:`build_generator` wrote."""

    path: Path
    search: str
    num_beams: int  # 1 for greedy search
    audio: bool
    output_bytes: int


# Settings the generator takes as arguments (search, num_beams) or inputs (max_new_tokens).
_FIXED = {"num_beams", "do_sample", "num_return_sequences", "max_new_tokens", "max_length"}


def build_generator(
    source: str | os.PathLike | Source,
    output: str | os.PathLike | None = None,
    *,
    search: str = "greedy",
    num_beams: int = 4,
    generation_config: Mapping[str, Any] | None = None,
    audio: bool = False,
    overwrite: bool = False,
    external_data: bool | None = None,
    progress: Callable[[str], None] | None = None,
    dtype: str | None = None,
) -> model_io.WrittenPath[GeneratorResult]:
    """Write one ONNX model that generates token ids from encoder inputs; return its path.

    Args:
        source: a merged file, or an optimum export folder or Hub repository (merged first, to a
            temporary file, unless it holds the merge of its files already).
        output: the file to write; ``generator.onnx`` beside the merged file, or inside the
            export folder, by default.
        search: ``"greedy"`` or ``"beam"`` (transformers' beam search, length penalty and early
            stopping from the model's generation config).
        num_beams: beams per input for ``search="beam"``.
        generation_config: settings that replace the model's own (``min_new_tokens``,
            ``suppress_tokens``, ``length_penalty``, ...), as ``generate()`` keyword arguments.
        audio: Whisper only: the inputs are 16 kHz PCM (``audio``, ``audio_lengths``) in place
            of ``input_features``, which the graph computes as ``WhisperFeatureExtractor`` does
            (``onnxmerge.generator.audio``), from ``preprocessor_config.json`` beside the source
            when there is one, else from the model's config.
        overwrite: replace an existing output file.
        external_data: as :func:`onnxmerge.merge_seq2seq` takes it (``None``: one file up to
            2 GB).
        progress: called with the name of each step as it starts.
        dtype: which files of a folder with several dtypes (transformers.js's names).

    Returns:
        The written file's path; its ``report`` is the :class:`GeneratorResult`.

    Raises:
        InvalidArgumentError: ``search``, ``num_beams`` or ``generation_config`` cannot be taken
            (``GenerationError`` for a setting).
        OnnxMergeError: or a subclass, saying what is wrong; nothing is written then.
    """
    _check_arguments(search, num_beams, generation_config)
    found = resolve_source(source, dtype)
    folder = found.path if found.layout else found.path.parent
    output = Path(output) if output is not None else folder / DEFAULT_OUTPUT_NAME
    model_io.check_output(output, found.files(), overwrite=overwrite)
    preprocessor = _preprocessor_config(found.config_dir) if audio else None
    step = progress or (lambda _name: None)
    with merged_model(found, progress=step) as merged:
        step(f"building the {search} decoding loop")
        request = _Request(search, num_beams, dict(generation_config or {}), preprocessor)
        result = _build_from_merged(merged, output, request, external_data)
    return model_io.WrittenPath.of(result.path, result)


def _check_arguments(
    search: str, num_beams: int, generation_config: Mapping[str, Any] | None
) -> None:
    if search not in SEARCHES:
        raise InvalidArgumentError(
            f"search must be one of {', '.join(SEARCHES)}, got {search!r}", argument="search"
        )
    if search == "beam" and num_beams < 2:
        raise InvalidArgumentError(
            f"beam search needs num_beams >= 2, got {num_beams}", argument="num_beams"
        )
    fixed = sorted(_FIXED & set(generation_config or {}))
    if fixed:
        raise GenerationError(
            f"{fixed} cannot be set here: the search and num_beams are arguments of "
            "build_generator, and max_new_tokens is an input of the generator",
            argument="generation_config",
        )


def _preprocessor_config(folder: Path) -> dict[str, Any]:
    """The preprocessor config in ``folder``, or ``{}`` (the model's config then decides)."""
    path = folder / audio_front.PREPROCESSOR_CONFIG
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text("utf-8"))
    except ValueError as e:
        raise InvalidMergedModelError(f"{path} is not JSON: {e}") from e


@dataclass(frozen=True)
class _Request:
    """The generator asked for: its search and the settings that replace the model's."""

    search: str
    num_beams: int
    overrides: dict[str, Any]
    preprocessor: dict[str, Any] | None  # None: token ids in, not audio

    @property
    def beams(self) -> int:
        return self.num_beams if self.search == "beam" else 1


def _build_from_merged(
    merged: Path, output: Path, request: _Request, external_data: bool | None
) -> GeneratorResult:
    model, data_files = model_io.load_model(merged)
    tolerated = check.unknown_operators([model])
    info = _contract_with_past(model, merged)
    settings, prompt = _settings(info, request)
    spec = None
    if request.preprocessor is not None:
        spec = _audio_spec(info, request.preprocessor, merged)
    if info.one_decoder:
        _assemble_one_decoder(model, info, settings, request.beams, prompt)
    else:
        _assemble(model, info, settings, request.beams, prompt)
    if spec is not None:
        _prepend_audio(model, spec)
    # The cached steps' empty encoder presents are no longer returned: drop what made them.
    ir.passes.common.RemoveUnusedNodesPass()(model)
    _describe(model, request, prompt, spec)
    model_io.save_model_atomically(
        model,
        output,
        external_data=external_data,
        validate=lambda p: check.check_written_model(
            p, what="generator model", tolerated=tolerated, sources=[merged]
        ),
        protected=frozenset({merged.resolve(), *data_files}),
    )
    logger.info("wrote the %s generator %s from %s", request.search, output, merged)
    written = model_io.file_bytes(output, model_io.data_files_of(output))
    return GeneratorResult(output, request.search, request.beams, spec is not None, written)


def _contract_with_past(model: ir.Model, merged: Path) -> contract.ContractInfo:
    """The merged model's contract; refused when it has no decoder with past."""
    graph = model.graph
    info = contract.read_contract(
        dict(model.metadata_props),
        [name_of(v) for v in graph.inputs],
        [name_of(v) for v in graph.outputs],
    )
    if not info.has_past:
        raise InvalidMergedModelError(
            f"{merged} was merged without past key/values; the generator needs a decoder with "
            "past: export with --task text2text-generation-with-past and merge again"
        )
    return info


def _settings(
    info: contract.ContractInfo, request: _Request
) -> tuple[GenerationSettings, list[int] | None]:
    """The generation settings the graph bakes in, and Whisper's decoder prompt."""
    overrides = dict(request.overrides)
    given = set(overrides)
    model_generation = dict(info.generation_config)
    prompt = None
    if info.config.get("model_type") == "whisper":
        prompt = _whisper_prompt(model_generation, overrides)
    overrides.update(num_beams=request.beams, do_sample=False, num_return_sequences=1)
    given = set(overrides) & given
    prompt_length = len(prompt) if prompt else 1
    settings = resolve_settings(info.config, model_generation, overrides, prompt_length)
    processors.check_supported(settings, given)
    return settings, prompt


def _describe(
    model: ir.Model,
    request: _Request,
    prompt: list[int] | None,
    spec: audio_front.FeatureSpec | None,
) -> None:
    """The generator's metadata: what it computes, in place of the merged model's layout."""
    model.metadata_props.pop(contract.META_FORMAT_VERSION, None)
    model.metadata_props.pop(contract.META_LAYOUT, None)
    description: dict[str, Any] = {
        "version": GENERATOR_VERSION,
        "search": request.search,
        "num_beams": request.beams,
    }
    if prompt:
        description["decoder_prompt"] = prompt
    model.metadata_props[META_GENERATOR] = json.dumps(description, sort_keys=True)
    if spec is not None:
        model.metadata_props[audio_front.META_FEATURES] = json.dumps(spec.as_dict(), sort_keys=True)


def _whisper_prompt(generation: dict[str, Any], overrides: dict[str, Any]) -> list[int]:
    """Whisper's prompt (start, language, task, no-timestamps tokens), the keywords that chose
    it removed from ``overrides`` and the deprecated ``forced_decoder_ids`` from ``generation``."""
    chosen = {k: overrides.pop(k) for k in audio_front.PROMPT_KEYWORDS if k in overrides}
    merged = {**generation, **{k: v for k, v in overrides.items() if v is not None}}
    prompt = audio_front.whisper_prompt(merged, **chosen)
    generation.pop("forced_decoder_ids", None)
    overrides.pop("forced_decoder_ids", None)
    return prompt


def _audio_spec(
    info: contract.ContractInfo, preprocessor: dict[str, Any], merged: Path
) -> audio_front.FeatureSpec:
    if list(info.encoder_inputs) != [audio_front.INPUT_FEATURES]:
        raise InvalidMergedModelError(
            f"audio=True needs a Whisper model, whose encoder reads input_features; {merged} "
            f"reads {list(info.encoder_inputs)}"
        )
    return audio_front.feature_spec(info.config, preprocessor)


def _prepend_audio(model: ir.Model, spec: audio_front.FeatureSpec) -> None:
    """Feed the encoder the features graph's output: PCM and lengths become the inputs."""
    graph = model.graph
    features_in = next(v for v in graph.inputs if v.name == audio_front.INPUT_FEATURES)
    ops = Ops(Names("audio"), model.opset_imports.get("", 18))
    pcm, lengths = audio_front.audio_inputs()
    features = audio_front.features_graph(ops, graph, pcm, lengths, spec)
    if features_in.dtype not in (None, ir.DataType.FLOAT):  # an fp16 encoder reads fp16
        features = ops.op("Cast", features, to=features_in.dtype)
    ir.convenience.replace_all_uses_with(features_in, features)
    for node in ops.nodes:
        graph.append(node)
    position = graph.inputs.index(features_in)
    graph.inputs.remove(features_in)
    graph.inputs.insert(position, lengths)
    graph.inputs.insert(position, pcm)
    graph.sort()


def _recursive_nodes(graph: ir.Graph) -> set[ir.Node]:
    return set(ir.traversal.RecursiveGraphIterator(graph))


def _redirect(value: ir.Value, nodes: set[ir.Node], replacement: ir.Value) -> None:
    """Make the uses of ``value`` by ``nodes`` read ``replacement`` instead."""
    for use in list(value.uses()):
        if use.node in nodes:
            use.node.replace_input_with(use.idx, replacement)


@dataclass(frozen=True)
class _Branches:
    """The merged model's ``If``, taken apart: its branches' nodes and outputs, by output name."""

    first_nodes: list[ir.Node]  # the else branch: decoder without past
    cached_nodes: list[ir.Node]  # the then branch: decoder with past
    first_all: set[ir.Node]  # with the nodes of nested subgraphs
    cached_all: set[ir.Node]
    first_out: dict[str, ir.Value]
    cached_out: dict[str, ir.Value]


@dataclass(frozen=True)
class _FirstStep:
    """The first decoder step in the main graph, rows repeated for every beam."""

    start: ir.Value  # [batch, prompt length]: the decoder prompt
    batch: ir.Value
    logits: ir.Value | None  # [rows, vocab], the last position; None where the Loop computes it
    max_length: ir.Value
    trips: ir.Value
    encoder_ids: ir.Value | None
    decoder_presents: list[ir.Value]
    encoder_presents: list[ir.Value]
    mask: ir.Value | None
    cached_mask: ir.Value | None  # what the cached decoder reads as the attention mask


@dataclass(frozen=True)
class _CachedStep:
    """The decoder with past, wired to read the Loop body's inputs."""

    iteration: ir.Value
    condition: ir.Value
    tokens_in: ir.Value
    past_in: list[ir.Value]
    logits: ir.Value
    presents: list[ir.Value]


@dataclass(frozen=True)
class _LoopParts:
    """What a loop builder needs."""

    main: Ops
    body: Ops
    names: Names
    settings: GenerationSettings
    vocab: int
    num_beams: int
    first: _FirstStep
    cached: _CachedStep


@dataclass(frozen=True)
class _Loop:
    body_graph: ir.Graph
    graph_outputs: list[ir.Value]


def _builders(model: ir.Model) -> tuple[Names, Ops, Ops, ir.Value]:
    """One fresh-name scheme for the whole file, node builders for the main graph and for the
    Loop's body, and the ``max_new_tokens`` input every generator takes."""
    names = Names()
    opset = model.opset_imports.get("", 18)
    max_new = ir.Value(
        name=MAX_NEW_TOKENS, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([])
    )
    return names, Ops(names, opset), Ops(names, opset), max_new


def _assemble(
    model: ir.Model,
    info: contract.ContractInfo,
    s: GenerationSettings,
    num_beams: int,
    prompt: list[int] | None = None,
) -> None:
    graph = model.graph
    branches = _take_branches(graph)
    inputs = {name_of(v): v for v in graph.inputs}
    vocab = _vocab_size(info, branches.first_out[contract.LOGITS])
    names, main, body, max_new = _builders(model)
    first = _first_step(main, info, s, num_beams, branches, inputs, max_new, prompt)
    cached = _wire_cached_decoder(body, info, branches, inputs, first)
    parts = _LoopParts(main, body, names, s, vocab, num_beams, first, cached)
    loop = _greedy_loop(parts) if num_beams == 1 else _beam_loop(parts)
    # The main graph: what was beside the If, the first step, then the loop.
    _place(graph, info, loop, branches.cached_nodes + body.nodes, branches.first_nodes + main.nodes)
    graph.inputs.append(max_new)


def _assemble_one_decoder(
    model: ir.Model,
    info: contract.ContractInfo,
    s: GenerationSettings,
    num_beams: int,
    prompt: list[int] | None = None,
) -> None:
    """Format version 3: the encoder and the cross-attention projections (the ``If``'s ``else``
    branch) run once before the Loop; the decoder, every step's, is the Loop body, which starts
    from a zero-length self-attention past. The decoder's weights are read in one graph only."""
    graph = model.graph
    if_node = _use_cache_if(graph)
    branches = _take_one_decoder_branches(graph, if_node)
    inputs = {name_of(v): v for v in graph.inputs}
    names, main, body, max_new = _builders(model)
    first = _one_decoder_first_step(main, info, s, num_beams, branches, inputs, max_new, prompt)
    encoder_names = contract.present_names(info.num_layers, "encoder")
    presents = dict(zip(encoder_names, first.encoder_presents, strict=True))
    for value in if_node.outputs:
        _redirect(value, branches.cached_all, presents[name_of(value)])
    cached = _wire_cached_decoder(body, info, branches, inputs, first, with_encoder=False)
    vocab = _vocab_size(info, branches.cached_out[contract.LOGITS])
    parts = _LoopParts(main, body, names, s, vocab, num_beams, first, cached)
    loop = _first_in_loop(parts)
    _place(graph, info, loop, branches.cached_nodes + body.nodes, branches.first_nodes + main.nodes)
    graph.inputs.append(max_new)


def _take_one_decoder_branches(graph: ir.Graph, if_node: ir.Node) -> _Branches:
    """Empty the ``If``'s branches and take the decoder out of the main graph; return the
    first step's nodes and cross-attention outputs, and the decoder's nodes and outputs."""
    first_graph = if_node.attributes["else_branch"].value
    cached_graph = if_node.attributes["then_branch"].value
    first_nodes = list(first_graph)
    cross = dict(zip([name_of(v) for v in if_node.outputs], first_graph.outputs, strict=True))
    first_graph.remove(first_nodes)
    first_graph.outputs.clear()
    cached_graph.remove(list(cached_graph))
    cached_graph.outputs.clear()
    outputs = {name_of(v): v for v in graph.outputs}
    graph.outputs.clear()
    before = _runs_before_loop(graph, if_node, first_nodes)
    decoder_nodes = [n for n in graph if n is not if_node and n not in before]
    graph.remove([*decoder_nodes, if_node])
    return _Branches(
        first_nodes=first_nodes,
        cached_nodes=decoder_nodes,
        first_all=set(),
        cached_all={m for n in decoder_nodes for m in (n, *_subgraph_nodes(n))},
        first_out=cross,
        cached_out=outputs,
    )


def _runs_before_loop(
    graph: ir.Graph, if_node: ir.Node, first_nodes: list[ir.Node]
) -> set[ir.Node]:
    """The main graph's nodes that stay out of the Loop: computed once per run."""
    # What the first part reads from the main graph (a weight's Cast, say) stays before the Loop.
    before = _producers_of([v for n in (if_node, *first_nodes) for v in _outer_reads(n)], graph)
    # So does what reads only stored tensors (an int4 weight's DequantizeLinear): computed once
    # per run, and onnxruntime's 4-bit fusion fails on weights read from inside a Loop.
    constant: set[ir.Value] = set(graph.initializers.values())
    for node in graph:
        if node is not if_node and all(v is None or v in constant for v in _outer_reads(node)):
            before.add(node)
            constant.update(node.outputs)
    return before


def _one_decoder_first_step(
    main: Ops,
    info: contract.ContractInfo,
    s: GenerationSettings,
    num_beams: int,
    branches: _Branches,
    inputs: dict[str, ir.Value],
    max_new: ir.Value,
    prompt: list[int] | None,
) -> _FirstStep:
    """What the Loop starts from: the encoder's key/values and inputs, rows repeated for every
    beam, an empty self-attention past and the prompt; the first iteration computes the logits."""
    encoder_names = contract.present_names(info.num_layers, "encoder")
    encoder_inputs = [inputs[n] for n in info.encoder_inputs]
    batch = main.dim(encoder_inputs[0], 0)
    encoder_ids = inputs.get("input_ids") if "input_ids" in info.encoder_inputs else None
    mask = inputs.get(contract.ATTENTION_MASK)
    cached_mask = mask
    encoder_presents = [branches.first_out[n] for n in encoder_names]
    # Format 4: every beam reads its input's cross-attention row, which is then not repeated.
    repeat_rows: Callable[[ir.Value], ir.Value] = lambda v: v  # noqa: E731
    if num_beams > 1:
        repeat = _beam_repeater(main, batch, num_beams)
        if info.cross_attention_per_input:
            repeat_rows = repeat
        else:
            encoder_presents = [repeat(v) for v in encoder_presents]
        cached_mask = repeat(mask) if mask is not None else None
        encoder_ids = repeat(encoder_ids) if encoder_ids is not None else None
    # Each layer's self-attention past starts empty: its cross key/value's heads, one row a beam.
    empty_past = []
    for present in encoder_presents:
        empty = repeat_rows(main.slice(present, 0, 0, axis=2))
        empty.type = branches.first_out[encoder_names[0]].type
        empty_past.append(empty)
    return _FirstStep(
        start=_prompt_rows(main, info, batch, prompt or [s.decoder_start_token_id]),
        batch=batch,
        logits=None,  # computed by the Loop's first iteration
        max_length=main.op("Add", max_new, main.i64(s.prompt_length)),
        trips=main.op("Max", max_new, main.i64(1)),
        encoder_ids=encoder_ids,
        decoder_presents=empty_past,
        encoder_presents=encoder_presents,
        mask=mask,
        cached_mask=cached_mask,
    )


def _prompt_rows(
    main: Ops, info: contract.ContractInfo, batch: ir.Value, tokens: list[int]
) -> ir.Value:
    """``[batch, len(tokens)]``: the decoder prompt in every row."""
    if len(tokens) > 1 and info.prompt_tokens_per_step == 1:
        raise GenerationError(
            f"the merged model takes a decoder prompt one token per step, and this model's "
            f"prompt has {len(tokens)}: merge the export with format=2 (--format 2) to build "
            "its generator"
        )
    return main.op("Expand", main.i64([tokens]), main.vector(batch, main.i64(len(tokens))))


def _place(
    graph: ir.Graph,
    info: contract.ContractInfo,
    loop: _Loop,
    body_nodes: list[ir.Node],
    main_nodes: list[ir.Node],
) -> None:
    """Put the nodes in the Loop's body and the main graph; keep only the encoder's inputs."""
    for node in body_nodes:
        loop.body_graph.append(node)
    loop.body_graph.sort()
    for node in main_nodes:
        graph.append(node)
    for value in list(graph.inputs):
        if value.name not in info.encoder_inputs:
            graph.inputs.remove(value)
    graph.outputs.extend(loop.graph_outputs)
    graph.sort()


def _first_in_loop(p: _LoopParts) -> _Loop:
    """The search's Loop where the first step is the Loop's first iteration."""
    main, first, s = p.main, p.first, p.settings
    start = first.start  # [batch, prompt length]
    # The first iteration reads the whole prompt, the others one token: a length the Loop
    # must not take from its initial value (:func:`_unfixed_length`).
    tokens = start if s.prompt_length == 1 else _unfixed_length(main, start, 1, first.trips)
    if p.num_beams > 1:
        tokens = _beam_repeater(main, first.batch, p.num_beams)(tokens)
    go = main.const(True, np.bool_)
    if p.num_beams == 1:
        sequences_in = typed_input(p.names, "sequences", ir.DataType.INT64, 2)
        unfinished_in = typed_input(p.names, "unfinished", ir.DataType.BOOL, 1)
        step = search.greedy_step(p.body, _search(p), p.cached.logits, sequences_in, unfinished_in)
        all_rows = main.op(
            "ConstantOfShape", main.vector(first.batch), value=ir.tensor(_bool_array([True]))
        )
        loop = _decode_loop(
            p,
            "decode_loop",
            carried_in=[sequences_in, unfinished_in],
            body_outputs=[step.keep_going, step.tokens, step.sequences, step.unfinished],
            body_cache=p.cached.presents,
            initial=[go, tokens, _unfixed_length(main, start, 1, first.trips), all_rows],
            initial_cache=first.decoder_presents,
        )
        sequences = _name_output(
            loop.graph_outputs[1], SEQUENCES, ir.DataType.INT64, SEQUENCES_DIMS
        )
        return _Loop(loop.body_graph, [sequences])
    beams = _search(p)
    state = search.initial_beams(main, s, first.batch, p.num_beams, start)
    carried = [
        typed_input(p.names, "beam_state", dtype, rank) for dtype, rank in search.CARRIED_BEAM_TYPES
    ]
    body = p.body
    stepped = search.beam_step(body, beams, p.cached.logits, search.Beams(*carried))
    assert stepped.keep_going is not None  # beam_step sets it
    cache = [body.op("Gather", v, stepped.rows, axis=0) for v in p.cached.presents]
    loop = _decode_loop(
        p,
        "beam_loop",
        carried_in=carried,
        body_outputs=[stepped.keep_going, _last_column(body, stepped.running), *stepped.carried()],
        body_cache=cache,
        initial=[go, tokens, *_growing(main, state, first.trips)],
        initial_cache=first.decoder_presents,
    )
    final = search.Beams(*loop.graph_outputs[1 : 1 + len(search.CARRIED_BEAM_TYPES)])
    sequences, score = search.best_sequences(main, final, s.prompt_length)
    sequences = main.op("Identity", sequences)
    _name_output(sequences, SEQUENCES, ir.DataType.INT64, SEQUENCES_DIMS)
    score = main.op("Identity", score)
    _name_output(score, SEQUENCES_SCORES, ir.DataType.FLOAT, ["batch_size"])
    return _Loop(loop.body_graph, [sequences, score])


def _outer_reads(node: ir.Node) -> list[ir.Value]:
    """The values ``node`` and its subgraphs read."""
    return [v for n in (node, *_subgraph_nodes(node)) for v in n.inputs if v is not None]


def _producers_of(values: list[ir.Value], graph: ir.Graph) -> set[ir.Node]:
    """The nodes of ``graph`` that compute ``values``, with everything they need."""
    found: set[ir.Node] = set()
    stack = [v.producer() for v in values]
    while stack:
        node = stack.pop()
        if node is None or node in found or node.graph is not graph:
            continue
        found.add(node)
        stack.extend(v.producer() for v in _outer_reads(node))
    return found


def _subgraph_nodes(node: ir.Node) -> list[ir.Node]:
    found: list[ir.Node] = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            found.extend(ir.traversal.RecursiveGraphIterator(attr.value))
        elif attr.type == ir.AttributeType.GRAPHS:
            for sub in attr.value:
                found.extend(ir.traversal.RecursiveGraphIterator(sub))
    return found


def _use_cache_if(graph: ir.Graph) -> ir.Node:
    if_nodes = [
        n
        for n in graph
        if n.op_type == "If"
        and n.inputs[0] is not None
        and n.inputs[0].name == contract.USE_CACHE_BRANCH
    ]
    if len(if_nodes) != 1:
        raise InvalidMergedModelError("the merged model has no If node on use_cache_branch")
    return if_nodes[0]


def _take_branches(graph: ir.Graph) -> _Branches:
    """Remove the ``If`` on ``use_cache_branch`` and empty its branches; return their parts."""
    if_node = _use_cache_if(graph)
    cached_graph = if_node.attributes["then_branch"].value
    first_graph = if_node.attributes["else_branch"].value
    out_names = [name_of(v) for v in if_node.outputs]
    branches = _Branches(
        first_nodes=list(first_graph),
        cached_nodes=list(cached_graph),
        first_all=_recursive_nodes(first_graph),
        cached_all=_recursive_nodes(cached_graph),
        first_out=dict(zip(out_names, first_graph.outputs, strict=True)),
        cached_out=dict(zip(out_names, cached_graph.outputs, strict=True)),
    )
    first_graph.remove(branches.first_nodes)
    cached_graph.remove(branches.cached_nodes)
    first_graph.outputs.clear()
    cached_graph.outputs.clear()
    graph.outputs.clear()
    graph.remove(if_node)
    return branches


def _vocab_size(info: contract.ContractInfo, logits: ir.Value) -> int:
    vocab_dim = logits.shape[-1] if logits.shape is not None else None
    vocab = vocab_dim if isinstance(vocab_dim, int) else int(info.config.get("vocab_size", 0))
    if vocab <= 0:
        raise InvalidMergedModelError("cannot tell the vocabulary size from the logits or config")
    return vocab


def _first_step(
    main: Ops,
    info: contract.ContractInfo,
    s: GenerationSettings,
    num_beams: int,
    branches: _Branches,
    inputs: dict[str, ir.Value],
    max_new: ir.Value,
    prompt: list[int] | None,
) -> _FirstStep:
    encoder_inputs = [inputs[n] for n in info.encoder_inputs]
    batch = main.dim(encoder_inputs[0], 0)
    prompt = prompt or [s.decoder_start_token_id]
    start = main.op("Expand", main.i64([prompt]), main.vector(batch, main.i64(len(prompt))))
    _redirect(inputs[contract.DECODER_INPUT_IDS], branches.first_all, start)
    max_length = main.op("Add", max_new, main.i64(s.prompt_length))
    trips = main.op("Max", main.op("Sub", max_new, main.i64(1)), main.i64(0))
    encoder_ids = inputs.get("input_ids") if "input_ids" in info.encoder_inputs else None
    logits = main.op("Gather", branches.first_out[contract.LOGITS], main.i64(-1), axis=1)
    layers = info.num_layers
    decoder_presents = [branches.first_out[n] for n in contract.present_names(layers, "decoder")]
    encoder_presents = [branches.first_out[n] for n in contract.present_names(layers, "encoder")]
    mask = inputs.get(contract.ATTENTION_MASK)
    cached_mask = mask
    if num_beams > 1:
        repeat = _beam_repeater(main, batch, num_beams)
        logits = repeat(logits)
        decoder_presents = [repeat(v) for v in decoder_presents]
        encoder_presents = [repeat(v) for v in encoder_presents]
        cached_mask = repeat(mask) if mask is not None else None
        encoder_ids = repeat(encoder_ids) if encoder_ids is not None else None
    return _FirstStep(
        start=start,
        batch=batch,
        logits=logits,
        max_length=max_length,
        trips=trips,
        encoder_ids=encoder_ids,
        decoder_presents=decoder_presents,
        encoder_presents=encoder_presents,
        mask=mask,
        cached_mask=cached_mask,
    )


def _beam_repeater(main: Ops, batch: ir.Value, num_beams: int) -> Callable[[ir.Value], ir.Value]:
    """Every beam of an input shares its encoder output: repeat rows once, before the loop."""
    expand_rows = main.op(
        "Div",
        main.op("Range", main.i64(0), main.op("Mul", batch, main.i64(num_beams)), main.i64(1)),
        main.i64(num_beams),
    )

    def repeat(value: ir.Value) -> ir.Value:
        return main.op("Gather", value, expand_rows, axis=0)

    return repeat


def _wire_cached_decoder(
    body: Ops,
    info: contract.ContractInfo,
    branches: _Branches,
    inputs: dict[str, ir.Value],
    first: _FirstStep,
    *,
    with_encoder: bool = True,
) -> _CachedStep:
    """The cached decoder reads the loop's state and the first step's encoder key/values
    (already wired where ``with_encoder`` is false)."""
    names = body.names
    iteration = typed_input(names, "iteration", ir.DataType.INT64, 0)
    condition = typed_input(names, "condition", ir.DataType.BOOL, 0)
    tokens_in = typed_input(names, "tokens", ir.DataType.INT64, 2)
    cache_dtype = first.decoder_presents[0].dtype or ir.DataType.FLOAT
    past_in = [typed_input(names, "past", cache_dtype, 4) for _ in first.decoder_presents]
    cached_all, layers = branches.cached_all, info.num_layers
    _redirect(inputs[contract.DECODER_INPUT_IDS], cached_all, tokens_in)
    for name, value in zip(contract.past_names(layers, "decoder"), past_in, strict=True):
        _redirect(inputs[name], cached_all, value)
    if with_encoder:
        encoder_pasts = contract.past_names(layers, "encoder")
        for name, value in zip(encoder_pasts, first.encoder_presents, strict=True):
            _redirect(inputs[name], cached_all, value)
    mask, cached_mask = first.mask, first.cached_mask
    if mask is not None and cached_mask is not None and cached_mask is not mask:
        _redirect(mask, cached_all, cached_mask)
    logits = body.op("Gather", branches.cached_out[contract.LOGITS], body.i64(-1), axis=1)
    presents = [branches.cached_out[n] for n in contract.present_names(layers, "decoder")]
    return _CachedStep(iteration, condition, tokens_in, past_in, logits, presents)


def _array(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _search(p: _LoopParts) -> search.Search:
    first = p.first
    return search.Search(
        p.settings, p.vocab, first.max_length, first.encoder_ids, first.batch, p.num_beams
    )


def _greedy_loop(p: _LoopParts) -> _Loop:
    main, first = p.main, p.first
    greedy = _search(p)
    start_sequences = first.start
    all_rows = main.op(
        "ConstantOfShape", main.vector(first.batch), value=ir.tensor(_bool_array([True]))
    )
    assert first.logits is not None  # the first step in the main graph computed them
    first_step = search.greedy_step(main, greedy, first.logits, start_sequences, all_rows)
    sequences_in = typed_input(p.names, "sequences", ir.DataType.INT64, 2)
    unfinished_in = typed_input(p.names, "unfinished", ir.DataType.BOOL, 1)
    step = search.greedy_step(p.body, greedy, p.cached.logits, sequences_in, unfinished_in)
    loop = _decode_loop(
        p,
        "decode_loop",
        carried_in=[sequences_in, unfinished_in],
        body_outputs=[step.keep_going, step.tokens, step.sequences, step.unfinished],
        body_cache=p.cached.presents,
        initial=[
            first_step.keep_going,
            first_step.tokens,
            _unfixed_length(main, first_step.sequences, 1, first.trips),
            first_step.unfinished,
        ],
        initial_cache=first.decoder_presents,
    )
    sequences = _name_output(loop.graph_outputs[1], SEQUENCES, ir.DataType.INT64, SEQUENCES_DIMS)
    return _Loop(loop.body_graph, [sequences])


def _beam_loop(p: _LoopParts) -> _Loop:
    main, body, first = p.main, p.body, p.first
    beams = _search(p)
    state = search.initial_beams(main, p.settings, first.batch, p.num_beams, first.start)
    assert first.logits is not None  # the first step in the main graph computed them
    first_step = search.beam_step(main, beams, first.logits, state)
    first_cache = [main.op("Gather", v, first_step.rows, axis=0) for v in first.decoder_presents]
    first_tokens = _last_column(main, first_step.running)
    carried = [
        typed_input(p.names, "beam_state", dtype, rank) for dtype, rank in search.CARRIED_BEAM_TYPES
    ]
    step = search.beam_step(body, beams, p.cached.logits, search.Beams(*carried))
    assert first_step.keep_going is not None and step.keep_going is not None  # beam_step sets it
    cache = [body.op("Gather", v, step.rows, axis=0) for v in p.cached.presents]
    tokens = _last_column(body, step.running)
    loop = _decode_loop(
        p,
        "beam_loop",
        carried_in=carried,
        body_outputs=[step.keep_going, tokens, *step.carried()],
        body_cache=cache,
        initial=[first_step.keep_going, first_tokens, *_growing(main, first_step, first.trips)],
        initial_cache=first_cache,
    )
    final = search.Beams(*loop.graph_outputs[1 : 1 + len(search.CARRIED_BEAM_TYPES)])
    sequences, score = search.best_sequences(main, final, p.settings.prompt_length)
    sequences = main.op("Identity", sequences)
    _name_output(sequences, SEQUENCES, ir.DataType.INT64, SEQUENCES_DIMS)
    score = main.op("Identity", score)
    _name_output(score, SEQUENCES_SCORES, ir.DataType.FLOAT, ["batch_size"])
    return _Loop(loop.body_graph, [sequences, score])


def _growing(ops: Ops, beams: search.Beams, trips: ir.Value) -> list[ir.Value]:
    """The carried beam state, the hypotheses' token axis made unknown (:func:`_unfixed_length`)."""
    state = beams.carried()
    for i in (0, 2):  # running and finished hypotheses: [batch, beams, length]
        state[i] = _unfixed_length(ops, state[i], 2, trips)
    return state


def _decode_loop(
    p: _LoopParts,
    name: str,
    *,
    carried_in: list[ir.Value],
    body_outputs: list[ir.Value],
    body_cache: list[ir.Value],
    initial: list[ir.Value],
    initial_cache: list[ir.Value],
) -> _Loop:
    """Append to the main graph a Loop whose body runs the cached decoder and one search step.

    The body reads (iteration, condition, tokens, *carried_in, *past) and returns
    ``body_outputs`` (keep going, tokens, the carried state) and ``body_cache``; ``initial`` and
    ``initial_cache`` are the first step's values of the same. Returns the Loop's outputs.
    """
    cached = p.cached
    outputs = _own_outputs(p.body, [*body_outputs, *body_cache])
    body_graph = ir.Graph(
        [cached.iteration, cached.condition, cached.tokens_in, *carried_in, *cached.past_in],
        outputs,
        nodes=[],
        name=p.names(f"{name}_body"),
    )
    loop_outputs = [ir.Value(name=p.names("loop_out")) for _ in outputs[1:]]
    dtype = p.cached.past_in[0].dtype
    assert dtype is not None  # typed_input gave every past input its type
    initial_cache = [_unfixed_length(p.main, v, 2, p.first.trips, dtype) for v in initial_cache]
    inputs = [p.first.trips, *initial, *initial_cache]
    loop = passes_base.node("Loop", inputs, loop_outputs, name=p.names(name), body=body_graph)
    p.main.nodes.append(loop)
    return _Loop(body_graph, loop_outputs)


def _unfixed_length(
    ops: Ops, value: ir.Value, axis: int, trips: ir.Value, dtype: ir.DataType = ir.DataType.INT64
) -> ir.Value:
    """``value`` with its length along ``axis`` no longer known before the graph runs.

    OpenVINO shapes a Loop body after the initial values of its loop-carried inputs: a value
    that grows by one position per iteration but enters with a length known when the model is
    compiled (the first step's cache, 1) keeps that length inside the body, and the second
    iteration fails ("Concat node ... incompatible with provided dimensions"). Zero positions
    appended, counted from a runtime input (``trips * 0``), change nothing and hide the length.
    """
    zero = ops.op("Mul", trips, ops.i64(0))
    none = ops.unsqueeze(zero, 0)
    shape = ops.op(
        "Concat",
        ops.op("Shape", value, start=0, end=axis),
        none,
        ops.op("Shape", value, start=axis + 1),
        axis=0,
    )
    empty = ops.op("ConstantOfShape", shape, value=ir.tensor(np.zeros(1, dtype.numpy())))
    # Sliced to an end only known at run time, the least length OpenVINO assumes is 0 too, so
    # the Loop's outputs fit its initial values when it runs no iteration.
    whole = ops.slice(value, 0, ops.op("Add", zero, ops.i64(2**62)), axis)
    return ops.op("Concat", whole, empty, axis=axis)


def _name_output(value: ir.Value, name: str, dtype: ir.DataType, dims: list[str]) -> ir.Value:
    """Name and type ``value`` as an output of the generator."""
    value.name = name
    value.type = ir.TensorType(dtype)
    value.shape = ir.Shape(dims)
    return value


def _last_column(ops: Ops, running: ir.Value) -> ir.Value:
    """``running[:, :, -1]`` as ``[batch * beams, 1]``: the tokens the next step reads."""
    last = ops.slice(running, -1, 2**62, axis=2)
    return ops.op("Reshape", last, ops.i64([-1, 1]))


def _own_outputs(ops: Ops, outputs: list[ir.Value]) -> list[ir.Value]:
    """Body outputs must be distinct values; wrap repeats in an Identity."""
    final: list[ir.Value] = []
    for value in outputs:
        if value in final:
            value = ops.op("Identity", value)
        final.append(value)
    return final


def _bool_array(values: list[bool]) -> np.ndarray:
    return np.asarray(values, dtype=np.bool_)
