"""Tiny fake seq2seq export folders, written as ONNX text.

The graphs are not real transformers, but they have the interface optimum writes (names, dtypes,
ranks of every input and output) and use their weights the way exported models do: one embedding
read by the encoder and both decoders, an LM head stored either as its own transposed copy of the
embedding or as a ``Transpose`` node of it (or untied: a matrix of its own), per-layer projections
repeated in both decoders, small 1-D int64 shape tensors. They run in onnxruntime, so the merged
model can be compared with them.

``write_export`` writes a folder in one of the layouts optimum produces; ``run_sources`` runs the
source files of a folder the way a generation loop would, for comparison with the merged model.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import onnx.parser

VOCAB = 96
D_MODEL = 16
HEADS = 2
HEAD_DIM = D_MODEL // HEADS
LAYERS = 2
OPSET = 17
IR_VERSION = 8

ENCODER = "encoder_model.onnx"
DECODER = "decoder_model.onnx"
DECODER_WITH_PAST = "decoder_with_past_model.onnx"
MERGED_DECODER = "decoder_model_merged.onnx"

EMBEDDING = "model.shared.weight"
LM_HEAD = "lm_head.weight"
FINAL_BIAS = "final_logits_bias"
ENCODER_PROJ = "model.encoder.proj.weight"
OUT_PROJ = "model.decoder.out_proj.weight"
KV_SHAPE = "kv_shape"  # 1-D int64, the tensor optimum's merge_decoders raised KeyError on
HIDDEN_SHAPE = "hidden_shape"
SEQ_AXIS = "seq_axis"
LAST_AXIS = "last_axis"

LAYOUTS = ("with_past", "no_past", "merged_only", "all")


def q(name: str) -> str:
    """A name quoted for ONNX text, which accepts dots and slashes only inside quotes."""
    return f'"{name}"'


def layer_weight(layer: int, kind: str) -> str:
    """Names like optimum's: ``model.decoder.layers.0.self_attn.k_proj.weight``."""
    attn, proj = {
        "k": ("self_attn", "k_proj"),
        "v": ("self_attn", "v_proj"),
        "ek": ("encoder_attn", "k_proj"),
        "ev": ("encoder_attn", "v_proj"),
    }[kind]
    return f"model.decoder.layers.{layer}.{attn}.{proj}.weight"


def make_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """The weights of one fake checkpoint; equal seeds give byte-equal weights."""
    rng = np.random.default_rng(seed)

    def matrix(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    weights = {
        EMBEDDING: matrix(VOCAB, D_MODEL),
        ENCODER_PROJ: matrix(D_MODEL, D_MODEL),
        OUT_PROJ: matrix(D_MODEL, D_MODEL),
        FINAL_BIAS: matrix(VOCAB),
    }
    for layer in range(LAYERS):
        for kind in ("k", "v", "ek", "ev"):
            weights[layer_weight(layer, kind)] = matrix(D_MODEL, D_MODEL)
    weights[LM_HEAD] = np.ascontiguousarray(weights[EMBEDDING].T)
    return weights


def _shape_tensors() -> dict[str, np.ndarray]:
    return {
        KV_SHAPE: np.array([0, 0, HEADS, HEAD_DIM], dtype=np.int64),
        HIDDEN_SHAPE: np.array([0, 0, D_MODEL], dtype=np.int64),
        SEQ_AXIS: np.array([1], dtype=np.int64),
        LAST_AXIS: np.array([-1], dtype=np.int64),
    }


def _header(opset: int, ir_version: int) -> str:
    return f'<ir_version: {ir_version}, opset_import: ["" : {opset}]>'


def _finish(text: str, weights: dict[str, np.ndarray], node_prefix: str) -> onnx.ModelProto:
    """Parse, attach the initializers the graph reads, and name nodes as torch's exporter does."""
    model = onnx.parser.parse_model(text)
    read = {name for node in model.graph.node for name in node.input}
    tensors = {**weights, **_shape_tensors()}
    for name in sorted(read & set(tensors)):
        model.graph.initializer.append(onnx.numpy_helper.from_array(tensors[name], name))
    for index, node in enumerate(model.graph.node):
        node.name = f"{node_prefix}/{node.op_type}_{index}"
    return model


def encoder_text(*, opset: int = OPSET, ir_version: int = IR_VERSION) -> str:
    return f"""
{_header(opset, ir_version)}
encoder (int64[batch, encoder_sequence_length] input_ids,
         int64[batch, encoder_sequence_length] attention_mask)
    => (float[batch, encoder_sequence_length, {D_MODEL}] last_hidden_state) {{
  embedded = Gather({q(EMBEDDING)}, input_ids)
  projected = MatMul(embedded, {q(ENCODER_PROJ)})
  mask_float = Cast<to = 1>(attention_mask)
  mask_3d = Unsqueeze(mask_float, {LAST_AXIS})
  last_hidden_state = Mul(projected, mask_3d)
}}
"""


def _kv(source: str, weight: str, out: str, p: str) -> str:
    """Project ``source`` [b, s, d] with ``weight`` and split heads: ``out`` is [b, h, s, hd]."""
    return f"""
  {q(p + out + "/proj")} = MatMul({q(source)}, {q(weight)})
  {q(p + out + "/heads")} = Reshape({q(p + out + "/proj")}, {KV_SHAPE})
  {q(p + out)} = Transpose<perm = [0, 2, 1, 3]>({q(p + out + "/heads")})"""


def _decoder_body(*, past: bool, presents: bool, head: str, p: str) -> str:
    """Nodes of a decoder; every value it computes is named with prefix ``p``."""
    lines = [
        f"""
  {q(p + "x")} = Gather({q(EMBEDDING)}, input_ids)
  {q(p + "mask_float")} = Cast<to = 1>(encoder_attention_mask)
  {q(p + "mask_3d")} = Unsqueeze({q(p + "mask_float")}, {LAST_AXIS})"""
    ]
    for layer in range(LAYERS):
        for kind in ("key", "value"):
            weight = layer_weight(layer, kind[0])
            new = f"present.{layer}.decoder.{kind}"
            if past:
                lines.append(_kv(p + "x", weight, f"new.{layer}.{kind}", p))
                lines.append(
                    f"\n  {q(p + new)} = Concat<axis = 2>("
                    f"{q(f'past_key_values.{layer}.decoder.{kind}')}, "
                    f"{q(p + f'new.{layer}.{kind}')})"
                )
            elif presents:
                lines.append(_kv(p + "x", weight, new, p))
            else:
                lines.append(_kv(p + "x", weight, f"self.{layer}.{kind}", p))
            if not past:
                enc = f"present.{layer}.encoder.{kind}"
                target = enc if presents else f"cross.{layer}.{kind}"
                lines.append(
                    _kv("encoder_hidden_states", layer_weight(layer, "e" + kind[0]), target, p)
                )
    # Context from the encoder side: the hidden states, or the cached cross-attention values.
    if past:
        lines.append(f"""
  {q(p + "cross_t")} = Transpose<perm = [0, 2, 1, 3]>({q("past_key_values.0.encoder.value")})
  {q(p + "cross_h")} = Reshape({q(p + "cross_t")}, {HIDDEN_SHAPE})""")
        self_value = p + "present.0.decoder.value"
    else:
        cross = p + ("present.0.encoder.value" if presents else "cross.0.value")
        lines.append(f"""
  {q(p + "cross_t")} = Transpose<perm = [0, 2, 1, 3]>({q(cross)})
  {q(p + "cross_h")} = Reshape({q(p + "cross_t")}, {HIDDEN_SHAPE})""")
        self_value = p + ("present.0.decoder.value" if presents else "self.0.value")
    lines.append(f"""
  {q(p + "cross_masked")} = Mul({q(p + "cross_h")}, {q(p + "mask_3d")})
  {q(p + "cross_ctx")} = ReduceSum<keepdims = 1>({q(p + "cross_masked")}, {SEQ_AXIS})
  {q(p + "self_t")} = Transpose<perm = [0, 2, 1, 3]>({q(self_value)})
  {q(p + "self_h")} = Reshape({q(p + "self_t")}, {HIDDEN_SHAPE})
  {q(p + "self_ctx")} = ReduceSum<keepdims = 1>({q(p + "self_h")}, {SEQ_AXIS})
  {q(p + "h1")} = Add({q(p + "x")}, {q(p + "cross_ctx")})
  {q(p + "h2")} = Add({q(p + "h1")}, {q(p + "self_ctx")})
  {q(p + "h3")} = MatMul({q(p + "h2")}, {q(OUT_PROJ)})""")
    if head in ("copy", "untied"):  # the weights tell them apart
        lines.append(f"\n  {q(p + 'lm')} = MatMul({q(p + 'h3')}, {q(LM_HEAD)})")
    elif head in ("tied", "tied-no-bias"):
        product = p + ("logits" if head == "tied-no-bias" else "lm")
        lines.append(f"""
  {q(p + "head")} = Transpose<perm = [1, 0]>({q(EMBEDDING)})
  {q(product)} = MatMul({q(p + "h3")}, {q(p + "head")})""")
    else:
        raise ValueError(f"head must be 'copy', 'untied', 'tied' or 'tied-no-bias', not {head!r}")
    if head != "tied-no-bias":
        lines.append(f"\n  {q(p + 'logits')} = Add({q(p + 'lm')}, {q(FINAL_BIAS)})")
    return "".join(lines)


def _cache_type(layer: int, part: str, kind: str, prefix: str, length: str) -> str:
    return f"float[batch, {HEADS}, {length}, {HEAD_DIM}] {q(f'{prefix}.{layer}.{part}.{kind}')}"


def _present_outputs(with_encoder: bool) -> list[str]:
    outputs = []
    for layer in range(LAYERS):
        parts = ("decoder", "encoder") if with_encoder else ("decoder",)
        for part in parts:
            length = "decoder_total_length" if part == "decoder" else "encoder_sequence_length"
            for kind in ("key", "value"):
                outputs.append(_cache_type(layer, part, kind, "present", length))
    return outputs


def _past_inputs() -> list[str]:
    inputs = []
    for layer in range(LAYERS):
        for part in ("decoder", "encoder"):
            length = (
                "past_decoder_sequence_length" if part == "decoder" else "encoder_sequence_length"
            )
            for kind in ("key", "value"):
                inputs.append(_cache_type(layer, part, kind, "past_key_values", length))
    return inputs


def _logits_type() -> str:
    return f"float[batch, decoder_sequence_length, {VOCAB}] logits"


def decoder_text(
    *, presents: bool = True, head: str = "copy", opset: int = OPSET, ir_version: int = IR_VERSION
) -> str:
    inputs = [
        "int64[batch, encoder_sequence_length] encoder_attention_mask",
        "int64[batch, decoder_sequence_length] input_ids",
        f"float[batch, encoder_sequence_length, {D_MODEL}] encoder_hidden_states",
    ]
    outputs = [_logits_type()] + (_present_outputs(True) if presents else [])
    body = _decoder_body(past=False, presents=presents, head=head, p="")
    return (
        f"{_header(opset, ir_version)}\ndecoder ({', '.join(inputs)})\n"
        f"    => ({', '.join(outputs)}) {{{body}\n}}\n"
    )


def decoder_with_past_text(
    *, head: str = "copy", opset: int = OPSET, ir_version: int = IR_VERSION
) -> str:
    inputs = [
        "int64[batch, encoder_sequence_length] encoder_attention_mask",
        "int64[batch, 1] input_ids",
        *_past_inputs(),
    ]
    outputs = [_logits_type()] + _present_outputs(False)
    body = _decoder_body(past=True, presents=True, head=head, p="")
    return (
        f"{_header(opset, ir_version)}\ndecoder_with_past ({', '.join(inputs)})\n"
        f"    => ({', '.join(outputs)}) {{{body}\n}}\n"
    )


def make_encoder(weights: dict[str, np.ndarray], **kw) -> onnx.ModelProto:
    return _finish(encoder_text(**kw), weights, "/model/encoder")


def make_decoder(
    weights: dict[str, np.ndarray], *, presents: bool = True, head: str = "copy", **kw
) -> onnx.ModelProto:
    return _finish(decoder_text(presents=presents, head=head, **kw), weights, "/model/decoder")


def make_decoder_with_past(
    weights: dict[str, np.ndarray], *, head: str = "copy", **kw
) -> onnx.ModelProto:
    return _finish(decoder_with_past_text(head=head, **kw), weights, "/model/decoder")


def make_merged_decoder(
    weights: dict[str, np.ndarray],
    *,
    head: str = "copy",
    opset: int = OPSET,
    ir_version: int = IR_VERSION,
) -> onnx.ModelProto:
    """A decoder_model_merged.onnx as optimum writes it: one ``If`` on ``use_cache_branch``.

    ``then_branch`` is the decoder with past, ``else_branch`` the decoder without; the initializers
    live in the main graph and both branches read them from the outer scope. Both branches use the
    same names for their intermediate values, as optimum's do.
    """
    no_past = make_decoder(weights, head=head, opset=opset, ir_version=ir_version)
    with_past = make_decoder_with_past(weights, head=head, opset=opset, ir_version=ir_version)

    def branch(
        model: onnx.ModelProto,
        name: str,
        outputs: list[onnx.ValueInfoProto],
        extra: Iterable[onnx.NodeProto] = (),
    ) -> onnx.GraphProto:
        prefix = "branch/"
        renamed = {o.name: prefix + o.name for o in model.graph.output}
        nodes = []
        for node in model.graph.node:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.output[:] = [renamed.get(o, o) for o in node.output]
            copy.input[:] = [renamed.get(i, i) for i in node.input]
            nodes.append(copy)
        nodes.extend(extra)
        branch_outputs = []
        for output in outputs:
            info = onnx.ValueInfoProto()
            info.CopyFrom(output)
            info.name = prefix + output.name
            branch_outputs.append(info)
        return onnx.helper.make_graph(nodes, name, [], branch_outputs)

    outputs = list(no_past.graph.output)
    empties = []
    for output in outputs:
        if output.name.startswith("present.") and ".encoder." in output.name:
            empty = onnx.numpy_helper.from_array(
                np.zeros((0, HEADS, 0, HEAD_DIM), dtype=np.float32), "empty"
            )
            empties.append(
                onnx.helper.make_node(
                    "Constant",
                    [],
                    ["branch/" + output.name],
                    value=empty,
                    name=f"/empty/{output.name}",
                )
            )
    then_branch = branch(with_past, "with_past", outputs, empties)
    else_branch = branch(no_past, "no_past", outputs)
    if_node = onnx.helper.make_node(
        "If",
        ["use_cache_branch"],
        [o.name for o in outputs],
        name="optimum::if",
        then_branch=then_branch,
        else_branch=else_branch,
    )
    inputs = [i for i in no_past.graph.input]
    inputs += [i for i in with_past.graph.input if i.name.startswith("past_key_values.")]
    inputs.append(
        onnx.helper.make_tensor_value_info("use_cache_branch", onnx.TensorProto.BOOL, [1])
    )
    initializers = {t.name: t for t in no_past.graph.initializer}
    for t in with_past.graph.initializer:
        initializers.setdefault(t.name, t)
    graph = onnx.helper.make_graph(
        [if_node], "merged_decoder", inputs, outputs, initializer=list(initializers.values())
    )
    return onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=ir_version
    )


def constant_for(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """Turn initializer ``name`` into a ``Constant`` node, as torch writes some weights."""
    tensor = next(t for t in model.graph.initializer if t.name == name)
    keep = [t for t in model.graph.initializer if t.name != name]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    value = onnx.TensorProto()
    value.CopyFrom(tensor)
    value.name = ""
    node = onnx.helper.make_node("Constant", [], [name], value=value, name=f"/Constant_{name}")
    model.graph.node.insert(0, node)
    return model


def save(model: onnx.ModelProto, path: Path, *, external_data: bool = False) -> Path:
    """Save as optimum does: with external data, tensors of 1 KiB or more go to ``<name>_data``."""
    path = Path(path)
    if external_data:
        onnx.save(
            model,
            os.fspath(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + "_data",
            size_threshold=1024,
        )
    else:
        onnx.save(model, os.fspath(path))
    return path


def write_export(
    folder: Path,
    *,
    layout: str = "with_past",
    head: str = "copy",
    seed: int = 0,
    encoder_seed: int | None = None,
    with_past_seed: int | None = None,
    opsets: dict[str, int] | None = None,
    ir_versions: dict[str, int] | None = None,
    out_proj_as_constant: bool = False,
    external_data: bool = False,
    config: bool = True,
    names: dict[str, str] | None = None,
) -> Path:
    """Write a fake export folder; return it.

    ``layout``: ``with_past`` (encoder, decoder, decoder with past), ``no_past`` (encoder and a
    decoder without presents), ``merged_only`` (encoder and decoder_model_merged), ``all`` (the
    four files optimum writes). ``encoder_seed``/``with_past_seed`` give that file weights of
    another checkpoint. ``opsets``/``ir_versions``/``names`` are keyed by the conventional file
    name.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    opsets = opsets or {}
    ir_versions = ir_versions or {}
    names = names or {}
    weights = make_weights(seed)
    if head == "untied":
        weights[LM_HEAD] = make_weights(seed + 1)[LM_HEAD]

    def kw(file: str) -> dict:
        return {"opset": opsets.get(file, OPSET), "ir_version": ir_versions.get(file, IR_VERSION)}

    models: dict[str, onnx.ModelProto] = {
        ENCODER: make_encoder(
            make_weights(encoder_seed) if encoder_seed is not None else weights, **kw(ENCODER)
        )
    }
    if layout == "no_past":
        models[DECODER] = make_decoder(weights, presents=False, head=head, **kw(DECODER))
    if layout in ("with_past", "all"):
        models[DECODER] = make_decoder(weights, head=head, **kw(DECODER))
        past_weights = make_weights(with_past_seed) if with_past_seed is not None else weights
        models[DECODER_WITH_PAST] = make_decoder_with_past(
            past_weights, head=head, **kw(DECODER_WITH_PAST)
        )
    if layout in ("merged_only", "all"):
        models[MERGED_DECODER] = make_merged_decoder(weights, head=head, **kw(MERGED_DECODER))
    if out_proj_as_constant:
        for file, model in models.items():
            if file in (DECODER, DECODER_WITH_PAST):
                constant_for(model, OUT_PROJ)
    for file, model in models.items():
        save(model, folder / names.get(file, file), external_data=external_data)
    if config:
        (folder / "config.json").write_text(
            json.dumps(
                {
                    "model_type": "fake",
                    "d_model": D_MODEL,
                    "vocab_size": VOCAB,
                    "decoder_layers": LAYERS,
                    "decoder_start_token_id": 2,
                }
            )
        )
        (folder / "generation_config.json").write_text(json.dumps({"max_length": 8}))
    return folder


# ---------------------------------------------------------------- running the files


def session(path_or_bytes, *, optimize: bool = False):
    """An onnxruntime CPU session, graph optimisations off unless asked."""
    from onnxmerge._ort import open_session, session_options

    return open_session(path_or_bytes, session_options(optimize=optimize))


def sample_inputs(
    seed: int = 1, *, batch: int = 2, encoder_length: int = 5, past_length: int = 3
) -> dict[str, np.ndarray]:
    """Encoder ids and mask (one padded row), a decoder prefix, a cache, the next token."""
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(3, VOCAB, size=(batch, encoder_length), dtype=np.int64)
    mask = np.ones((batch, encoder_length), dtype=np.int64)
    mask[-1, -2:] = 0
    inputs = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "decoder_input_ids": rng.integers(3, VOCAB, size=(batch, 2), dtype=np.int64),
        "next_token": rng.integers(3, VOCAB, size=(batch, 1), dtype=np.int64),
    }
    for layer in range(LAYERS):
        for part, length in (("decoder", past_length), ("encoder", encoder_length)):
            for kind in ("key", "value"):
                inputs[f"past_key_values.{layer}.{part}.{kind}"] = rng.standard_normal(
                    (batch, HEADS, length, HEAD_DIM)
                ).astype(np.float32)
    return inputs


def past_names() -> list[str]:
    return [
        f"past_key_values.{layer}.{part}.{kind}"
        for layer in range(LAYERS)
        for part in ("decoder", "encoder")
        for kind in ("key", "value")
    ]


def run_sources(
    folder: Path, inputs: dict[str, np.ndarray], *, files: dict[str, str] | None = None
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """Run encoder + decoder (first step) and decoder with past (cached step) from the folder.

    Returns the outputs of each step by name; the cached step is None without that file.
    """
    files = {
        ENCODER: ENCODER,
        DECODER: DECODER,
        DECODER_WITH_PAST: DECODER_WITH_PAST,
        **(files or {}),
    }
    folder = Path(folder)
    encoder = session(folder / files[ENCODER])
    hidden = encoder.run(
        None, {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    )[0]
    decoder = session(folder / files[DECODER])
    first = dict(
        zip(
            [o.name for o in decoder.get_outputs()],
            decoder.run(
                None,
                {
                    "encoder_attention_mask": inputs["attention_mask"],
                    "input_ids": inputs["decoder_input_ids"],
                    "encoder_hidden_states": hidden,
                },
            ),
            strict=True,
        )
    )
    with_past_path = folder / files[DECODER_WITH_PAST]
    if not with_past_path.exists():
        return first, None
    with_past = session(with_past_path)
    feed = {"encoder_attention_mask": inputs["attention_mask"], "input_ids": inputs["next_token"]}
    feed.update({name: inputs[name] for name in past_names()})
    cached = dict(
        zip([o.name for o in with_past.get_outputs()], with_past.run(None, feed), strict=True)
    )
    return first, cached


def run_merged(
    path_or_bytes, inputs: dict[str, np.ndarray], *, use_cache: bool, optimize: bool = False
) -> dict[str, np.ndarray]:
    """Run a merged model's first step (``use_cache=False``) or cached step."""
    merged = session(path_or_bytes, optimize=optimize)
    names = {i.name for i in merged.get_inputs()}
    batch = inputs["input_ids"].shape[0]
    feed: dict[str, np.ndarray] = {"attention_mask": inputs["attention_mask"]}
    if use_cache:
        feed["input_ids"] = np.zeros((batch, 0), dtype=np.int64)
        feed["decoder_input_ids"] = inputs["next_token"]
        feed.update({name: inputs[name] for name in past_names()})
    else:
        feed["input_ids"] = inputs["input_ids"]
        feed["decoder_input_ids"] = inputs["decoder_input_ids"]
        for name in past_names():
            feed[name] = np.zeros((batch, HEADS, 0, HEAD_DIM), dtype=np.float32)
    if "use_cache_branch" in names:
        feed["use_cache_branch"] = np.array([use_cache])
    feed = {k: v for k, v in feed.items() if k in names}
    return dict(zip([o.name for o in merged.get_outputs()], merged.run(None, feed), strict=True))


def max_abs_diff(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> float:
    """Largest difference over the outputs ``expected`` has; shapes must agree."""
    worst = 0.0
    for name, value in expected.items():
        got = actual[name]
        assert got.shape == value.shape, f"{name}: shape {got.shape}, expected {value.shape}"
        if value.size:
            worst = max(worst, float(np.max(np.abs(got.astype(np.float64) - value))))
    return worst


def folder_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path (detects any change)."""
    folder = Path(folder)
    return {
        os.fspath(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------- single graphs for pass tests


def proto_from_text(text: str, tensors: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """Parse a model and add ``tensors`` as main-graph initializers (subgraphs may read them)."""
    model = onnx.parser.parse_model(text)
    for name, array in (tensors or {}).items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(array), name))
    return model


def ir_from_text(text: str, tensors: dict[str, np.ndarray] | None = None):
    """An onnx-ir model from text; initializers are bound before subgraphs are resolved."""
    import onnx_ir as ir

    return ir.serde.deserialize_model(proto_from_text(text, tensors))


def run_model(model, feeds: dict[str, np.ndarray], *, optimize: bool = False) -> list[np.ndarray]:
    """Run an onnx-ir model or a ModelProto in onnxruntime."""
    import onnx_ir as ir

    proto = ir.serde.serialize_model(model) if isinstance(model, ir.Model) else model
    return session(proto.SerializeToString(), optimize=optimize).run(None, feeds)


def all_nodes(model) -> list:
    """Every node of an onnx-ir model, subgraphs included, with the graph that holds it."""
    import onnx_ir as ir

    return list(ir.traversal.RecursiveGraphIterator(model.graph))


def export_parts(*, with_past_seed: int | None = None) -> tuple[list, dict]:
    """The parts of a small with-past export and their models, without touching disk.

    ``with_past_seed`` gives the decoder with past weights of another checkpoint.
    """
    import onnx_ir as ir

    from onnxmerge.merge._parts import parts_of_file
    from onnxmerge.merge._roles import Role

    weights = make_weights()
    past_weights = make_weights(with_past_seed) if with_past_seed is not None else weights
    protos = {
        Role.ENCODER: make_encoder(weights),
        Role.DECODER: make_decoder(weights),
        Role.DECODER_WITH_PAST: make_decoder_with_past(past_weights),
    }
    models = {}
    parts = []
    for role, proto in protos.items():
        path = Path(f"{role.value}.onnx")
        models[path] = ir.serde.deserialize_model(proto)
        parts += parts_of_file(models[path], role, path)
    return parts, models
