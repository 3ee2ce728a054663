"""Splice the parts of an export into one graph under the merged-model contract.

The encoder and the decoder without past become the ``else`` branch of an ``If`` on
``use_cache_branch``; the decoder with past becomes the ``then`` branch. Initializers of every part
move to the main graph, where both branches read them from the outer scope.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from pathlib import Path

import numpy as np
import onnx_ir as ir

from onnxmerge import contract
from onnxmerge._version import __version__
from onnxmerge.errors import ExportFolderError, IncompatibleModelsError
from onnxmerge.merge._cross_attention import CrossAttention
from onnxmerge.merge._parts import Part
from onnxmerge.merge._roles import Role
from onnxmerge.passes import base as passes_base
from onnxmerge.passes.base import name_of

logger = logging.getLogger(__name__)

GRAPH_NAME = "onnxmerge"


class _Names:
    """Hands out unique names: the first taker keeps its name, later ones get a role prefix."""

    def __init__(self, reserved: set[str]):
        self.used = set(reserved)

    def claim(self, name: str, prefix: str) -> str:
        if name in self.used:
            name = passes_base.free_name(f"{prefix}/{name}", self.used)
        self.used.add(name)
        return name


def _rename_part(part: Part, values: _Names, nodes: _Names) -> None:
    prefix = part.role.value
    for value in part.initializers:
        value.name = values.claim(name_of(value), prefix)
    for node in ir.traversal.RecursiveGraphIterator(part.graph):
        if node.name:
            node.name = nodes.claim(node.name, prefix)
        for output in node.outputs:
            if output.name:
                output.name = values.claim(output.name, prefix)
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                for sub_input in attr.value.inputs:
                    sub_input.name = values.claim(sub_input.name, prefix)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.value:
                    for sub_input in sub.inputs:
                        sub_input.name = values.claim(sub_input.name, prefix)


def _move_initializers(parts: list[Part], main: ir.Graph) -> None:
    for part in parts:
        for value in part.initializers:
            owner = value.graph
            if owner is main:
                continue
            if owner is not None:
                owner.initializers.pop(name_of(value))
            main.register_initializer(value)


def _take_nodes(part: Part) -> list[ir.Node]:
    """Detach a part's nodes and outputs from its source graph, so a new graph can own them."""
    nodes = list(part.graph)
    part.graph.remove(nodes)
    part.graph.outputs.clear()
    return nodes


def _produced_in(value: ir.Value, nodes: Collection[ir.Node]) -> bool:
    producer = value.producer()
    return producer is not None and producer in nodes


def _branch(name: str, nodes: list[ir.Node], outputs: list[ir.Value]) -> ir.Graph:
    """A subgraph over ``nodes``; outputs not computed inside it go through an Identity."""
    node_set = set(nodes)
    final: list[ir.Value] = []
    for value in outputs:
        if not _produced_in(value, node_set) or value in final:
            out = ir.Value(name=f"{name}/{value.name}.out", type=value.type, shape=value.shape)
            identity = passes_base.node(
                "Identity", [value], [out], name=f"{name}/{value.name}/identity"
            )
            nodes.append(identity)
            node_set.add(identity)
            value = identity.outputs[0]
        final.append(value)
    return ir.Graph([], final, nodes=nodes, name=name)


def _unname_dims(branch: ir.Graph) -> None:
    """Declare the branch's own values without dim names (their ranks and fixed sizes stay).

    A dim name means one size in the whole model, but a strict runtime binds the names it meets
    inside a branch apart from the outer graph's: tract then found ``batch_size`` unbound, or
    bound to another size, inside the ``If`` (docs/runtimes.md). The outer graph's inputs and
    outputs keep their names. Only format 3's ``If``: tract does not load the two-decoder form,
    whose first decoder later passes still simplify by its names."""
    for node in branch:
        for value in node.outputs:
            dims = list(value.shape) if value.shape is not None else []
            if any(isinstance(d, ir.SymbolicDim) for d in dims):
                value.shape = ir.Shape([None if isinstance(d, ir.SymbolicDim) else d for d in dims])


def _empty_like(name: str, value: ir.Value) -> list[ir.Node]:
    """Nodes making a tensor with no elements, keeping ``value``'s fixed dims so runtimes see no
    mismatch; the last node's output is the tensor.

    A ``ConstantOfShape`` of a constant shape rather than an empty ``Constant``: OpenVINO reads
    an empty ``Constant`` as rank 0 and refuses an ``If`` whose branches differ in rank.
    """
    dims = list(value.shape) if value.shape is not None else [0, 0, 0, 0]
    dims = [d if isinstance(d, int) else 0 for d in dims]
    if 0 not in dims:
        dims[0] = 0
    dtype = value.dtype if value.dtype is not None else ir.DataType.FLOAT
    shape = ir.Value(
        name=f"{name}.shape", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([len(dims)])
    )
    shape_node = passes_base.node(
        "Constant", [], [shape], name=f"{name}.shape", value=ir.tensor(np.asarray(dims, np.int64))
    )
    fill = ir.tensor(np.zeros(1, dtype=dtype.numpy()))
    out = ir.Value(name=name, type=value.type, shape=ir.Shape(dims))
    empty = passes_base.node("ConstantOfShape", [shape], [out], name=name, value=fill)
    return [shape_node, empty]


def _input_like(name: str, value: ir.Value) -> ir.Value:
    return ir.Value(name=name, type=value.type, shape=value.shape)


def _placeholder_friendly_input(name: str, value: ir.Value) -> ir.Value:
    """An encoder input whose fixed dims are made symbolic.

    Cached steps do not run the encoder and take zero-length placeholders; onnxruntime refuses
    those for an input declared with fixed dims (Whisper's 80 x 3000 features, say).
    """
    if value.shape is None:
        return _input_like(name, value)
    dims = [d if not isinstance(d, int) else f"{name}_dim{i}" for i, d in enumerate(value.shape)]
    return ir.Value(name=name, type=value.type, shape=ir.Shape(dims))


def _check_opsets(models: dict[Path, ir.Model]) -> tuple[dict[str, int], int]:
    opsets: dict[str, int] = {}
    problems: list[str] = []
    for path, model in models.items():
        for domain, version in model.opset_imports.items():
            domain = "" if domain == "ai.onnx" else domain
            if opsets.setdefault(domain, version) != version:
                problems.append(
                    f"{path.name} imports opset {domain or 'ai.onnx'} {version}, another file "
                    f"imports {opsets[domain]}; export all files with the same --opset"
                )
    if problems:
        raise IncompatibleModelsError("the files use different opsets:", problems)
    # IR versions only gate file-format features; the newest of them reads all the others.
    return opsets, max(model.ir_version for model in models.values())


def splice(
    parts: list[Part], models: dict[Path, ir.Model], cross: CrossAttention | None = None
) -> ir.Model:
    """Join encoder and decoder parts into one model under the contract of ``docs/format.md``.

    A constructor, not a pass: it builds the model that the passes then rewrite, with the
    contract's metadata (format version, layout, encoder inputs) already set. With ``cross``,
    the decoder without past's cross-attention part (:mod:`onnxmerge.merge._cross_attention`), it
    writes format version 3: the decoder with past runs every step and the ``If`` only chooses
    where the cross-attention keys and values come from.
    """
    by_role = {p.role: p for p in parts}
    encoder = by_role[Role.ENCODER]
    decoder = by_role[Role.DECODER]
    with_past = by_role.get(Role.DECODER_WITH_PAST)
    decoder_parts = [decoder] + ([with_past] if with_past else [])
    opsets, ir_version = _check_opsets(models)
    main_inputs, renames, encoder_output = _fitting_inputs(encoder, decoder, with_past)
    encoder_inputs = list(encoder.inputs)
    output_names = _output_names(decoder, with_past is not None)

    # Names: contract names are reserved; every part keeps its own where it is free.
    values = _rename_parts(parts, set(main_inputs) | set(output_names))
    main = ir.Graph(
        list(main_inputs.values()), [], nodes=[], opset_imports=dict(opsets), name=GRAPH_NAME
    )
    _move_initializers(parts, main)
    _wire(encoder, decoder_parts, main_inputs, renames, encoder_output)
    one_decoder, layout = _add_steps(main, main_inputs, by_role, cross, output_names, values)
    return ir.Model(
        main,
        ir_version=ir_version,
        producer_name="onnxmerge",
        producer_version=__version__,
        functions=_local_functions(models),
        metadata_props={
            contract.META_FORMAT_VERSION: contract.FormatFacts(one_decoder=one_decoder).version,
            contract.META_LAYOUT: layout,
            contract.META_ENCODER_INPUTS: json.dumps(encoder_inputs),
        },
    )


def _fitting_inputs(
    encoder: Part, decoder: Part, with_past: Part | None
) -> tuple[dict[str, ir.Value], dict[str, str], ir.Value]:
    """The merged graph's inputs, the decoders' input renames and the encoder's output, or
    why the parts do not fit together."""
    encoder_output = encoder.outputs.get(contract.OPTIMUM_ENCODER_OUTPUT)
    if encoder_output is None:
        raise ExportFolderError(f"{encoder.source} has no last_hidden_state output")
    decoder_parts = [decoder] + ([with_past] if with_past else [])
    main_inputs, renames, problems = _main_inputs(encoder, decoder_parts, with_past is not None)
    problems += _hidden_state_problems(encoder, decoder, with_past, encoder_output)
    if problems:
        raise IncompatibleModelsError("the encoder and decoders do not fit together:", problems)
    if with_past is not None:
        main_inputs[contract.USE_CACHE_BRANCH] = ir.Value(
            name=contract.USE_CACHE_BRANCH,
            type=ir.TensorType(ir.DataType.BOOL),
            shape=ir.Shape([1]),
        )
    return main_inputs, renames, encoder_output


def _add_steps(
    main: ir.Graph,
    main_inputs: dict[str, ir.Value],
    by_role: dict[Role, Part],
    cross: CrossAttention | None,
    output_names: list[str],
    values: _Names,
) -> tuple[bool, str]:
    """Put the parts' nodes and the outputs in ``main``; return whether one decoder runs every
    step, and the layout."""
    encoder, decoder = by_role[Role.ENCODER], by_role[Role.DECODER]
    with_past = by_role.get(Role.DECODER_WITH_PAST)
    if with_past is not None and cross is not None:
        _one_decoder(main, main_inputs, encoder, decoder, with_past, cross, output_names)
        return True, contract.LAYOUT_WITH_PAST
    first_step_nodes = _take_nodes(encoder) + _take_nodes(decoder)
    first_step_outputs = [decoder.outputs[n] for n in output_names]
    if with_past is None:
        _add_first_step(main, first_step_nodes, output_names, first_step_outputs)
        return False, contract.LAYOUT_WITHOUT_PAST
    if_node = _use_cache_if(
        main_inputs[contract.USE_CACHE_BRANCH],
        (first_step_nodes, first_step_outputs),
        with_past,
        decoder,
        output_names,
        values,
    )
    main.append(if_node)
    main.outputs.extend(if_node.outputs)
    return False, contract.LAYOUT_WITH_PAST


def _main_inputs(
    encoder: Part, decoder_parts: list[Part], cached: bool
) -> tuple[dict[str, ir.Value], dict[str, str], list[str]]:
    """The merged graph's inputs in the contract's order, the decoders' renames, and problems."""
    main_inputs: dict[str, ir.Value] = {
        name: _placeholder_friendly_input(name, v)
        if cached and name != contract.ATTENTION_MASK
        else _input_like(name, v)
        for name, v in encoder.inputs.items()
    }
    mask_name = (
        contract.ATTENTION_MASK
        if contract.ATTENTION_MASK in main_inputs
        else contract.OPTIMUM_ENCODER_ATTENTION_MASK
    )
    renames = {
        contract.OPTIMUM_DECODER_INPUT_IDS: contract.DECODER_INPUT_IDS,
        contract.OPTIMUM_ENCODER_ATTENTION_MASK: mask_name,
    }
    problems: list[str] = []
    for part in decoder_parts:
        for name, value in part.inputs.items():
            if name == contract.OPTIMUM_ENCODER_HIDDEN_STATES:
                continue
            target = renames.get(name, name)
            existing = main_inputs.get(target)
            if existing is None:
                main_inputs[target] = _input_like(target, value)
            elif existing.dtype != value.dtype:
                problems.append(
                    f"{part.source.name} input {name!r} is {value.dtype}, but {target!r} is "
                    f"{existing.dtype} elsewhere"
                )
    return main_inputs, renames, problems


def _hidden_state_problems(
    encoder: Part, decoder: Part, with_past: Part | None, encoder_output: ir.Value
) -> list[str]:
    """Why the decoders cannot read the encoder's hidden states as format 1 hands them over."""
    problems = []
    hidden = decoder.inputs.get(contract.OPTIMUM_ENCODER_HIDDEN_STATES)
    if hidden is None:
        problems.append(f"{decoder.source.name} has no encoder_hidden_states input")
    elif hidden.dtype != encoder_output.dtype:
        problems.append(
            f"{encoder.source.name} returns {encoder_output.dtype} hidden states but "
            f"{decoder.source.name} expects {hidden.dtype}"
        )
    if with_past is not None and with_past.inputs.get(contract.OPTIMUM_ENCODER_HIDDEN_STATES):
        if any(_read_by(with_past, with_past.inputs[contract.OPTIMUM_ENCODER_HIDDEN_STATES])):
            problems.append(
                f"{with_past.source.name} reads encoder_hidden_states on every cached step "
                "(cross attention without an encoder cache, as in GPT-2 decoders of "
                "vision-encoder-decoder models); format 1 runs the encoder only on the first "
                "step. Export without past (--task image-to-text) to merge such a model"
            )
    return problems


def _output_names(decoder: Part, cached: bool) -> list[str]:
    """The decoder's outputs the merged model returns: no presents without a cached branch."""
    names = [n for n in decoder.outputs if cached or not contract.is_present_name(n)]
    if not cached and len(names) != len(decoder.outputs):
        logger.warning(
            "%s returns present key/values but no decoder with past was found: the merged "
            "model will have no cache",
            decoder.source.name,
        )
    return names


def _rename_parts(parts: list[Part], reserved: set[str]) -> _Names:
    """Give every value and node a name unique in the merged model; return the value names."""
    values = _Names(reserved)
    nodes = _Names(set())
    seen_initializers: set[int] = set()
    for part in parts:
        part.initializers = [v for v in part.initializers if id(v) not in seen_initializers]
        seen_initializers.update(id(v) for v in part.initializers)
        _rename_part(part, values, nodes)
    return values


def _wire(
    encoder: Part,
    decoder_parts: list[Part],
    main_inputs: dict[str, ir.Value],
    renames: dict[str, str],
    encoder_output: ir.Value,
) -> None:
    """Part inputs read the main inputs; the decoders read the encoder's output."""
    for part in [encoder, *decoder_parts]:
        for name, value in part.inputs.items():
            if name == contract.OPTIMUM_ENCODER_HIDDEN_STATES:
                replacement = encoder_output
            elif part is encoder:
                replacement = main_inputs[name]
            else:
                replacement = main_inputs[renames.get(name, name)]
            if value is not replacement and value.uses():
                ir.convenience.replace_all_uses_with(value, replacement)


def _add_first_step(
    main: ir.Graph, nodes: list[ir.Node], names: list[str], outputs: list[ir.Value]
) -> None:
    """Without a cache the first step is the whole model: its nodes go into the main graph."""
    main.extend(nodes)
    for name, value in zip(names, outputs, strict=True):
        if not _produced_in(value, set(nodes)) or value in main.outputs:
            identity = passes_base.node("Identity", [value], [_input_like(name, value)])
            main.append(identity)
            value = identity.outputs[0]
        else:
            value.name = name
        main.outputs.append(value)


def _one_decoder(
    main: ir.Graph,
    main_inputs: dict[str, ir.Value],
    encoder: Part,
    decoder: Part,
    with_past: Part,
    cross: CrossAttention,
    output_names: list[str],
) -> None:
    """Format version 3: the ``If`` yields the cross-attention keys and values (computed by the
    encoder and the decoder's projections of its states on the first step, passed through on
    the others), and the decoder with past, in the main graph, runs every step."""
    cache_problems = _cache_mismatches(output_names, with_past)
    if cache_problems:
        raise IncompatibleModelsError("the decoders' caches do not match:", cache_problems)
    first_step_nodes = _take_cross_attention_nodes(encoder, decoder, cross)
    cached_nodes = _take_nodes(with_past)
    cross_names = [n for n in output_names if contract.is_encoder_present(n)]
    if_node = _cross_attention_if(main_inputs, decoder, cross_names, first_step_nodes, cached_nodes)
    main.append(if_node)
    main.extend(cached_nodes)
    by_name = dict(zip(cross_names, if_node.outputs, strict=True))
    cached_set = set(cached_nodes)
    for name in output_names:
        value = by_name.get(name)
        if value is None:
            value = _cached_output(main, name, with_past, decoder, cached_set)
        main.outputs.append(value)
    # What computed the empty encoder presents of an optimum merged decoder's cached branch.
    outputs = set(main.outputs)
    for node in reversed(cached_nodes):
        if not any(v.uses() or v in outputs for v in node.outputs):
            main.remove(node, safe=True)


def _take_cross_attention_nodes(
    encoder: Part, decoder: Part, cross: CrossAttention
) -> list[ir.Node]:
    """Detach the first step's nodes of format 3: the encoder's, and the decoder's projections
    of its states, which read their batch size from the encoder's output."""
    hidden = encoder.outputs[contract.OPTIMUM_ENCODER_OUTPUT]
    encoder_nodes = _take_nodes(encoder)
    for node in cross.batch_reads:
        node.replace_input_with(0, hidden)
    kept = set(cross.nodes)
    # The rest of the decoder without past is not needed: the decoder with past replaces it.
    decoder.graph.outputs.clear()
    decoder.graph.remove([n for n in decoder.graph if n not in kept], safe=True)
    cross_nodes = list(decoder.graph)
    decoder.graph.remove(cross_nodes)
    return encoder_nodes + cross_nodes


def _cross_attention_if(
    main_inputs: dict[str, ir.Value],
    decoder: Part,
    cross_names: list[str],
    first_step_nodes: list[ir.Node],
    cached_nodes: list[ir.Node],
) -> ir.Node:
    """The ``If`` yielding the cross-attention keys and values: computed on the first step, the
    past inputs on the others. The cached nodes read its outputs instead of those inputs."""
    computed = [decoder.outputs[n] for n in cross_names]
    passed = [main_inputs[contract.past_name(*_layer_part_kind(n))] for n in cross_names]
    outputs = [_input_like(n, v) for n, v in zip(cross_names, computed, strict=True)]
    branches = _branch("with_past", [], passed), _branch("no_past", first_step_nodes, computed)
    for branch in branches:
        _unname_dims(branch)
    if_node = passes_base.node(
        "If",
        [main_inputs[contract.USE_CACHE_BRANCH]],
        outputs,
        name="use_cache_branch",
        then_branch=branches[0],
        else_branch=branches[1],
    )
    cached_set = set(cached_nodes)
    for past, branch_output in zip(passed, if_node.outputs, strict=True):
        for use in list(past.uses()):
            if use.node in cached_set:
                use.node.replace_input_with(use.idx, branch_output)
    return if_node


def _cached_output(
    main: ir.Graph, name: str, with_past: Part, decoder: Part, cached_nodes: set[ir.Node]
) -> ir.Value:
    """The decoder with past's output ``name``, ready to be the main graph's output ``name``."""
    value = with_past.outputs.get(name)
    if value is None:
        raise IncompatibleModelsError(
            f"{with_past.source.name} lacks the output {name!r} that "
            f"{decoder.source.name} has; the two decoders are not from one export"
        )
    if not _produced_in(value, cached_nodes) or value in main.outputs:
        identity = passes_base.node("Identity", [value], [_input_like(name, value)])
        main.append(identity)
        value = identity.outputs[0]
    else:
        value.name = name
    # The interface is the first step's: the decoder with past was declared for one new token
    # a step.
    value.shape = decoder.outputs[name].shape
    return value


def _layer_part_kind(name: str) -> tuple[int, str, str]:
    parsed = contract.parse_cache_name(name)
    assert parsed is not None
    return parsed[1], parsed[2], parsed[3]


def _use_cache_if(
    condition: ir.Value,
    first_step: tuple[list[ir.Node], list[ir.Value]],
    with_past: Part,
    decoder: Part,
    output_names: list[str],
    values: _Names,
) -> ir.Node:
    """The ``If`` on ``use_cache_branch``: cached step in ``then``, first step in ``else``."""
    first_step_nodes, first_step_outputs = first_step
    cached_nodes = _take_nodes(with_past)
    cached_outputs = []
    for name, value in zip(output_names, first_step_outputs, strict=True):
        if name in with_past.outputs:
            cached_outputs.append(with_past.outputs[name])
        elif contract.is_encoder_present(name):
            empty = _empty_like(values.claim(f"{name}.empty", "decoder_with_past"), value)
            cached_nodes.extend(empty)
            cached_outputs.append(empty[-1].outputs[0])
        else:
            raise IncompatibleModelsError(
                f"{with_past.source.name} lacks the output {name!r} that "
                f"{decoder.source.name} has; the two decoders are not from one export"
            )
    cache_problems = _cache_mismatches(output_names, with_past)
    if cache_problems:
        raise IncompatibleModelsError("the decoders' caches do not match:", cache_problems)
    then_branch = _branch("with_past", cached_nodes, cached_outputs)
    else_branch = _branch("no_past", first_step_nodes, first_step_outputs)
    outputs = [_input_like(n, v) for n, v in zip(output_names, first_step_outputs, strict=True)]
    return passes_base.node(
        "If",
        [condition],
        outputs,
        name="use_cache_branch",
        then_branch=then_branch,
        else_branch=else_branch,
    )


def _local_functions(models: dict[Path, ir.Model]) -> list[ir.Function]:
    """Every file's local functions; one key defined twice cannot be told apart."""
    functions = {}
    for model in models.values():
        for key, function in model.functions.items():
            if key in functions:
                raise IncompatibleModelsError(
                    f"two files define the local function {key}; merge cannot tell them apart"
                )
            functions[key] = function
    return list(functions.values())


def _read_by(part: Part, value: ir.Value) -> list[ir.Node]:
    nodes = set(ir.traversal.RecursiveGraphIterator(part.graph))
    return [use.node for use in value.uses() if use.node in nodes]


def _cache_mismatches(output_names: list[str], with_past: Part) -> list[str]:
    """Past inputs the decoder with past lacks, or has without a matching present output."""
    expected = set()
    for name in output_names:
        parsed = contract.parse_cache_name(name)
        if parsed is not None:
            expected.add(contract.past_name(*parsed[1:]))
    found = {n for n in with_past.inputs if contract.is_past_name(n)}
    source = with_past.source.name
    return [f"{source} lacks the input {n!r}" for n in sorted(expected - found)] + [
        f"{source} takes {n!r}, which the decoder without past does not return"
        for n in sorted(found - expected)
    ]
