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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from onnxmerge import contract, model_io
from onnxmerge.errors import (
    GenerationError,
    InvalidMergedModelError,
    OnnxMergeError,
    RefusedOutputError,
)
from onnxmerge.generator import processors, search
from onnxmerge.generator.ops import Names, Ops, typed_input
from onnxmerge.settings import GenerationSettings, resolve_settings

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_NAME = "generator.onnx"
MAX_NEW_TOKENS = "max_new_tokens"
SEQUENCES = "sequences"
SEQUENCES_SCORES = "sequences_scores"
META_GENERATOR = contract.META_GENERATOR
GENERATOR_VERSION = "1"
SEARCHES = ("greedy", "beam")


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
    graph = model.graph
    info = contract.read_contract(
        dict(model.metadata_props), [v.name for v in graph.inputs], [v.name for v in graph.outputs]
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
        validate=lambda p: contract.check_written_model(p, "generator model"),
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


def _assemble(
    model: ir.Model, info: contract.ContractInfo, s: GenerationSettings, num_beams: int
) -> None:
    graph = model.graph
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
    out_names = [v.name for v in if_node.outputs]
    first_out = dict(zip(out_names, first_graph.outputs, strict=True))
    cached_out = dict(zip(out_names, cached_graph.outputs, strict=True))
    first_all, cached_all = _recursive_nodes(first_graph), _recursive_nodes(cached_graph)
    first_nodes, cached_nodes = list(first_graph), list(cached_graph)
    first_graph.remove(first_nodes)
    cached_graph.remove(cached_nodes)
    first_graph.outputs.clear()
    cached_graph.outputs.clear()
    graph.outputs.clear()
    graph.remove(if_node)

    inputs = {v.name: v for v in graph.inputs}
    encoder_inputs = [inputs[n] for n in info.encoder_inputs]
    mask = inputs.get(contract.ATTENTION_MASK)
    logits_value = first_out[contract.LOGITS]
    vocab_dim = logits_value.shape[-1] if logits_value.shape is not None else None
    vocab = vocab_dim if isinstance(vocab_dim, int) else int(info.config.get("vocab_size", 0))
    if vocab <= 0:
        raise InvalidMergedModelError("cannot tell the vocabulary size from the logits or config")
    layers = info.num_layers

    names = Names()
    opset = model.opset_imports.get("", 18)
    main = Ops(names, opset)
    max_new = ir.Value(
        name=MAX_NEW_TOKENS, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([])
    )
    batch = main.dim(encoder_inputs[0], 0)
    start = main.op(
        "ConstantOfShape",
        main.vector(batch, main.i64(1)),
        value=ir.tensor(_array([s.decoder_start_token_id])),
    )
    _redirect(inputs[contract.DECODER_INPUT_IDS], first_all, start)
    max_length = main.op("Add", max_new, main.i64(s.prompt_length))
    trips = main.op("Max", main.op("Sub", max_new, main.i64(1)), main.i64(0))
    encoder_ids = inputs.get("input_ids") if "input_ids" in info.encoder_inputs else None
    first_logits = main.op("Gather", logits_value, main.i64(-1), axis=1)

    decoder_presents = [first_out[n] for n in contract.present_names(layers, "decoder")]
    encoder_presents = [first_out[n] for n in contract.present_names(layers, "encoder")]
    if num_beams > 1:
        # Every beam of an input shares its encoder output: repeat rows once, before the loop.
        expand_rows = main.op(
            "Div",
            main.op("Range", main.i64(0), main.op("Mul", batch, main.i64(num_beams)), main.i64(1)),
            main.i64(num_beams),
        )

        def repeat(value: ir.Value) -> ir.Value:
            return main.op("Gather", value, expand_rows, axis=0)

        first_logits = repeat(first_logits)
        decoder_presents = [repeat(v) for v in decoder_presents]
        encoder_presents = [repeat(v) for v in encoder_presents]
        cached_mask = repeat(mask) if mask is not None else None
        encoder_ids = repeat(encoder_ids) if encoder_ids is not None else None
    else:
        cached_mask = mask

    # The cached decoder reads the loop's state and the first step's encoder key/values.
    body = Ops(names, opset)
    iteration = typed_input(names, "iteration", ir.DataType.INT64, 0)
    condition = typed_input(names, "condition", ir.DataType.BOOL, 0)
    tokens_in = typed_input(names, "tokens", ir.DataType.INT64, 2)
    cache_dtype = decoder_presents[0].dtype or ir.DataType.FLOAT
    past_in = [typed_input(names, "past", cache_dtype, 4) for _ in decoder_presents]
    _redirect(inputs[contract.DECODER_INPUT_IDS], cached_all, tokens_in)
    for name, value in zip(contract.past_names(layers, "decoder"), past_in, strict=True):
        _redirect(inputs[name], cached_all, value)
    for name, value in zip(contract.past_names(layers, "encoder"), encoder_presents, strict=True):
        _redirect(inputs[name], cached_all, value)
    if mask is not None and cached_mask is not mask:
        _redirect(mask, cached_all, cached_mask)
    body_logits = body.op("Gather", cached_out[contract.LOGITS], body.i64(-1), axis=1)
    body_presents = [cached_out[n] for n in contract.present_names(layers, "decoder")]

    if num_beams == 1:
        outputs = _greedy_loop(
            main,
            body,
            s,
            vocab,
            batch,
            first_logits,
            body_logits,
            max_length,
            trips,
            encoder_ids,
            decoder_presents,
            body_presents,
            names,
            (iteration, condition, tokens_in, past_in),
        )
    else:
        outputs = _beam_loop(
            main,
            body,
            s,
            vocab,
            num_beams,
            batch,
            first_logits,
            body_logits,
            max_length,
            trips,
            encoder_ids,
            decoder_presents,
            body_presents,
            names,
            (iteration, condition, tokens_in, past_in),
        )
    loop_body_nodes = cached_nodes + body.nodes
    body_graph = outputs["body"]
    for node in loop_body_nodes:
        body_graph.append(node)
    body_graph.sort()

    # The main graph: what was beside the If, the first step, then the loop (sorted below).
    for node in first_nodes + main.nodes:
        graph.append(node)
    for value in list(graph.inputs):
        if value.name not in info.encoder_inputs:
            graph.inputs.remove(value)
    graph.inputs.append(max_new)
    for value in outputs["graph_outputs"]:
        graph.outputs.append(value)
    graph.sort()


def _array(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _greedy_loop(
    main: Ops,
    body: Ops,
    s: GenerationSettings,
    vocab: int,
    batch: ir.Value,
    first_logits: ir.Value,
    body_logits: ir.Value,
    max_length: ir.Value,
    trips: ir.Value,
    encoder_ids: ir.Value | None,
    decoder_presents: list[ir.Value],
    body_presents: list[ir.Value],
    names: Names,
    body_inputs: tuple,
) -> dict:
    iteration, condition, tokens_in, past_in = body_inputs
    start_sequences = main.op(
        "ConstantOfShape",
        main.vector(batch, main.i64(1)),
        value=ir.tensor(_array([s.decoder_start_token_id])),
    )
    all_rows = main.op("ConstantOfShape", main.vector(batch), value=ir.tensor(_bool_array([True])))
    first = search.greedy_step(
        main, s, vocab, first_logits, start_sequences, all_rows, max_length, encoder_ids
    )
    sequences_in = typed_input(names, "sequences", ir.DataType.INT64, 2)
    unfinished_in = typed_input(names, "unfinished", ir.DataType.BOOL, 1)
    step = search.greedy_step(
        body, s, vocab, body_logits, sequences_in, unfinished_in, max_length, encoder_ids
    )
    body_outputs = [step.keep_going, step.tokens, step.sequences, step.unfinished, *body_presents]
    body_outputs = _own_outputs(body, body_outputs)
    body_graph = ir.Graph(
        [iteration, condition, tokens_in, sequences_in, unfinished_in, *past_in],
        body_outputs,
        nodes=[],
        name=names("decode_loop_body"),
    )
    loop_outputs = [ir.Value(name=names("loop_out")) for _ in body_outputs[1:]]
    loop_outputs[1].name = SEQUENCES
    loop_outputs[1].type = ir.TensorType(ir.DataType.INT64)
    loop_outputs[1].shape = ir.Shape(["batch_size", "sequence_length"])
    loop = ir.Node(
        "",
        "Loop",
        [
            trips,
            first.keep_going,
            first.tokens,
            first.sequences,
            first.unfinished,
            *decoder_presents,
        ],
        attributes=[ir.AttrGraph("body", body_graph)],
        outputs=loop_outputs,
        name=names("decode_loop"),
    )
    main.nodes.append(loop)
    return {"body": body_graph, "graph_outputs": [loop_outputs[1]]}


def _beam_loop(
    main: Ops,
    body: Ops,
    s: GenerationSettings,
    vocab: int,
    num_beams: int,
    batch: ir.Value,
    first_logits: ir.Value,
    body_logits: ir.Value,
    max_length: ir.Value,
    trips: ir.Value,
    encoder_ids: ir.Value | None,
    decoder_presents: list[ir.Value],
    body_presents: list[ir.Value],
    names: Names,
    body_inputs: tuple,
) -> dict:
    iteration, condition, tokens_in, past_in = body_inputs
    state = search.initial_beams(main, s, batch, num_beams)
    first = search.beam_step(
        main, s, vocab, num_beams, first_logits, state, batch, max_length, encoder_ids
    )
    first_cache = [main.op("Gather", v, first.rows, axis=0) for v in decoder_presents]
    first_tokens = _last_column(main, first.running)

    state_in = search.Beams(
        *[
            typed_input(names, "beam_state", dtype, rank)
            for dtype, rank in search.CARRIED_BEAM_TYPES
        ]
    )
    step = search.beam_step(
        body, s, vocab, num_beams, body_logits, state_in, batch, max_length, encoder_ids
    )
    cache = [body.op("Gather", v, step.rows, axis=0) for v in body_presents]
    tokens = _last_column(body, step.running)
    body_outputs = [step.keep_going, tokens, *step.carried(), *cache]
    body_outputs = _own_outputs(body, body_outputs)
    body_graph = ir.Graph(
        [iteration, condition, tokens_in, *state_in.carried(), *past_in],
        body_outputs,
        nodes=[],
        name=names("beam_loop_body"),
    )
    loop_outputs = [ir.Value(name=names("loop_out")) for _ in body_outputs[1:]]
    loop = ir.Node(
        "",
        "Loop",
        [trips, first.keep_going, first_tokens, *first.carried(), *first_cache],
        attributes=[ir.AttrGraph("body", body_graph)],
        outputs=loop_outputs,
        name=names("beam_loop"),
    )
    main.nodes.append(loop)
    final = search.Beams(*loop_outputs[1 : 1 + len(search.CARRIED_BEAM_TYPES)])
    sequences, score = search.best_sequences(main, final, s.prompt_length)
    sequences = main.op("Identity", sequences)
    sequences.name = SEQUENCES
    sequences.type = ir.TensorType(ir.DataType.INT64)
    sequences.shape = ir.Shape(["batch_size", "sequence_length"])
    score = main.op("Identity", score)
    score.name = SEQUENCES_SCORES
    score.type = ir.TensorType(ir.DataType.FLOAT)
    score.shape = ir.Shape(["batch_size"])
    return {"body": body_graph, "graph_outputs": [sequences, score]}


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
