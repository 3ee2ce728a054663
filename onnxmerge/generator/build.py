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
import tempfile
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
    InvalidMergedModelError,
    OnnxMergeError,
    RefusedOutputError,
)
from onnxmerge.generator import processors, search
from onnxmerge.generator.ops import Names, Ops, typed_input
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


def build_generator(
    source: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    search: str = "greedy",
    num_beams: int = 4,
    generation_config: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write one ONNX model that generates token ids from encoder inputs; return its path.

    Args:
        source: an optimum export folder (merged first, to a temporary file) or a merged file.
        output: the file to write; ``generator.onnx`` beside the merged file, or inside the
            export folder, by default.
        search: ``"greedy"`` or ``"beam"`` (transformers' beam search, length penalty and early
            stopping from the model's generation config).
        num_beams: beams per input for ``search="beam"``.
        generation_config: settings that replace the model's own (``min_new_tokens``,
            ``suppress_tokens``, ``length_penalty``, ...), as ``generate()`` keyword arguments.
        overwrite: replace an existing output file.

    Raises:
        OnnxMergeError: or a subclass, saying what is wrong; nothing is written then.
    """
    if search not in SEARCHES:
        raise OnnxMergeError(f"search must be one of {', '.join(SEARCHES)}, got {search!r}")
    if search == "beam" and num_beams < 2:
        raise OnnxMergeError(f"beam search needs num_beams >= 2, got {num_beams}")
    source = Path(source)
    if source.is_dir():
        output = Path(output) if output is not None else source / DEFAULT_OUTPUT_NAME
        from onnxmerge.merge import merge_seq2seq

        with tempfile.TemporaryDirectory(prefix="onnxmerge-generator-") as tmp:
            merged = merge_seq2seq(source, Path(tmp) / "model.onnx")
            return _build_from_merged(
                merged, output, search, num_beams, generation_config, overwrite
            )
    if not source.is_file():
        raise InvalidMergedModelError(
            f"{source} is neither an export folder nor a merged model file"
        )
    output = Path(output) if output is not None else source.parent / DEFAULT_OUTPUT_NAME
    return _build_from_merged(source, output, search, num_beams, generation_config, overwrite)


def _build_from_merged(
    merged: Path,
    output: Path,
    search_kind: str,
    num_beams: int,
    generation_config: Mapping[str, Any] | None,
    overwrite: bool,
) -> Path:
    if output.exists() and not overwrite:
        raise RefusedOutputError(f"{output} exists; pass overwrite=True to replace it")
    if output.exists() and output.resolve() == merged.resolve():
        raise RefusedOutputError(f"the output {output} is the input; choose another output path")
    model, data_files = model_io.load_model(merged)
    tolerated = check.unknown_operators([model])
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
    beams = num_beams if search_kind == "beam" else 1
    overrides = dict(generation_config or {})
    given = set(overrides)
    fixed = {"num_beams", "do_sample", "num_return_sequences", "max_new_tokens", "max_length"}
    if fixed & set(overrides):
        raise GenerationError(
            f"{sorted(fixed & set(overrides))} cannot be set here: the search and num_beams are "
            "arguments of build_generator, and max_new_tokens is an input of the generator"
        )
    overrides.update(num_beams=beams, do_sample=False, num_return_sequences=1)
    settings = resolve_settings(info.config, info.generation_config, overrides, 1)
    processors.check_supported(settings, given)
    _assemble(model, info, settings, beams)
    # The cached steps' empty encoder presents are no longer returned: drop what made them.
    ir.passes.common.RemoveUnusedNodesPass()(model)
    model.metadata_props.pop(contract.META_FORMAT_VERSION, None)
    model.metadata_props.pop(contract.META_LAYOUT, None)
    model.metadata_props[META_GENERATOR] = json.dumps(
        {"version": GENERATOR_VERSION, "search": search_kind, "num_beams": beams}, sort_keys=True
    )
    model_io.save_model_atomically(
        model,
        output,
        validate=lambda p: check.check_written_model(
            p, what="generator model", tolerated=tolerated, sources=[merged]
        ),
        protected=frozenset({merged.resolve(), *data_files}),
    )
    logger.info("wrote the %s generator %s from %s", search_kind, output, merged)
    return output


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

    batch: ir.Value
    logits: ir.Value  # [rows, vocab], the last position
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


def _assemble(
    model: ir.Model, info: contract.ContractInfo, s: GenerationSettings, num_beams: int
) -> None:
    graph = model.graph
    branches = _take_branches(graph)
    inputs = {name_of(v): v for v in graph.inputs}
    vocab = _vocab_size(info, branches.first_out[contract.LOGITS])
    names = Names()
    opset = model.opset_imports.get("", 18)
    main, body = Ops(names, opset), Ops(names, opset)
    max_new = ir.Value(
        name=MAX_NEW_TOKENS, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([])
    )
    first = _first_step(main, info, s, num_beams, branches, inputs, max_new)
    cached = _wire_cached_decoder(body, info, branches, inputs, first)
    parts = _LoopParts(main, body, names, s, vocab, num_beams, first, cached)
    loop = _greedy_loop(parts) if num_beams == 1 else _beam_loop(parts)
    for node in branches.cached_nodes + body.nodes:
        loop.body_graph.append(node)
    loop.body_graph.sort()
    # The main graph: what was beside the If, the first step, then the loop (sorted below).
    for node in branches.first_nodes + main.nodes:
        graph.append(node)
    for value in list(graph.inputs):
        if value.name not in info.encoder_inputs:
            graph.inputs.remove(value)
    graph.inputs.append(max_new)
    graph.outputs.extend(loop.graph_outputs)
    graph.sort()


def _take_branches(graph: ir.Graph) -> _Branches:
    """Remove the ``If`` on ``use_cache_branch`` and empty its branches; return their parts."""
    if_nodes = [
        n
        for n in graph
        if n.op_type == "If"
        and n.inputs[0] is not None
        and n.inputs[0].name == contract.USE_CACHE_BRANCH
    ]
    if len(if_nodes) != 1:
        raise InvalidMergedModelError("the merged model has no If node on use_cache_branch")
    if_node = if_nodes[0]
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
) -> _FirstStep:
    encoder_inputs = [inputs[n] for n in info.encoder_inputs]
    batch = main.dim(encoder_inputs[0], 0)
    start = main.op(
        "ConstantOfShape",
        main.vector(batch, main.i64(1)),
        value=ir.tensor(_array([s.decoder_start_token_id])),
    )
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
) -> _CachedStep:
    """The cached decoder reads the loop's state and the first step's encoder key/values."""
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
    encoder_pasts = contract.past_names(layers, "encoder")
    for name, value in zip(encoder_pasts, first.encoder_presents, strict=True):
        _redirect(inputs[name], cached_all, value)
    if first.mask is not None and first.cached_mask is not first.mask:
        _redirect(first.mask, cached_all, first.cached_mask)
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
    main, s, first = p.main, p.settings, p.first
    greedy = _search(p)
    start_sequences = main.op(
        "ConstantOfShape",
        main.vector(first.batch, main.i64(1)),
        value=ir.tensor(_array([s.decoder_start_token_id])),
    )
    all_rows = main.op(
        "ConstantOfShape", main.vector(first.batch), value=ir.tensor(_bool_array([True]))
    )
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
            first_step.sequences,
            first_step.unfinished,
        ],
        initial_cache=first.decoder_presents,
    )
    sequences = _name_output(loop.graph_outputs[1], SEQUENCES, ir.DataType.INT64, SEQUENCES_DIMS)
    return _Loop(loop.body_graph, [sequences])


def _beam_loop(p: _LoopParts) -> _Loop:
    main, body, first = p.main, p.body, p.first
    beams = _search(p)
    state = search.initial_beams(main, p.settings, first.batch, p.num_beams)
    first_step = search.beam_step(main, beams, first.logits, state)
    first_cache = [main.op("Gather", v, first_step.rows, axis=0) for v in first.decoder_presents]
    first_tokens = _last_column(main, first_step.running)
    carried = [
        typed_input(p.names, "beam_state", dtype, rank) for dtype, rank in search.CARRIED_BEAM_TYPES
    ]
    step = search.beam_step(body, beams, p.cached.logits, search.Beams(*carried))
    cache = [body.op("Gather", v, step.rows, axis=0) for v in p.cached.presents]
    tokens = _last_column(body, step.running)
    loop = _decode_loop(
        p,
        "beam_loop",
        carried_in=carried,
        body_outputs=[step.keep_going, tokens, *step.carried()],
        body_cache=cache,
        initial=[first_step.keep_going, first_tokens, *first_step.carried()],
        initial_cache=first_cache,
    )
    final = search.Beams(*loop.graph_outputs[1 : 1 + len(search.CARRIED_BEAM_TYPES)])
    sequences, score = search.best_sequences(main, final, p.settings.prompt_length)
    sequences = main.op("Identity", sequences)
    _name_output(sequences, SEQUENCES, ir.DataType.INT64, SEQUENCES_DIMS)
    score = main.op("Identity", score)
    _name_output(score, SEQUENCES_SCORES, ir.DataType.FLOAT, ["batch_size"])
    return _Loop(loop.body_graph, [sequences, score])


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
    loop = ir.Node(
        "",
        "Loop",
        [p.first.trips, *initial, *initial_cache],
        attributes=[ir.AttrGraph("body", body_graph)],
        outputs=loop_outputs,
        name=p.names(name),
    )
    p.main.nodes.append(loop)
    return _Loop(body_graph, loop_outputs)


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
