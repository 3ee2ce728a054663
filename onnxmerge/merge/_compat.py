"""Do the files of an export belong together? Checks that need the deduplication's findings.

An analysis, not a rewrite: from what each part brought and what deduplication shared it returns
the problems it finds; the merge decides whether they stop it.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxmerge.merge._parts import Part
from onnxmerge.merge._roles import Role
from onnxmerge.passes import dedup
from onnxmerge.passes.base import tensor_of

# A decoder with past from the same checkpoint shares nearly all of its weights with the decoder.
MIN_SHARED_FRACTION = 0.5


def origins(parts: list[Part]) -> dict[int, tuple[Role, ir.Value]]:
    """Which part brought each initializer (keyed by identity: names change during the splice)."""
    found: dict[int, tuple[Role, ir.Value]] = {}
    for part in parts:
        for value in part.initializers:
            found.setdefault(id(value), (part.role, value))
    return found


def checkpoint_problems(
    parts: list[Part],
    origin: dict[int, tuple[Role, ir.Value]],
    shared: list[dedup.SharedTensor],
    config: dict | None = None,
) -> list[str]:
    """Why the files share too little to come from one checkpoint; empty when they do.

    ``config`` is the export's config.json: a model that declares separate encoder and decoder
    embeddings (Marian's ``share_encoder_decoder_embeddings: false``) shares none by design.
    """
    role_of = {value.name: role for role, value in origin.values()}
    sources = {p.role: p.source for p in parts}
    problems: list[str] = []

    def large(role: Role) -> list[ir.Value]:
        return [
            v
            for r, v in origin.values()
            if r == role
            and v.const_value is not None
            and v.const_value.nbytes >= dedup.MIN_SHARED_BYTES
        ]

    merged_decoder = sources.get(Role.DECODER) == sources.get(Role.DECODER_WITH_PAST)
    if Role.DECODER_WITH_PAST in sources and not merged_decoder:
        total = sum(tensor_of(v).nbytes for v in large(Role.DECODER_WITH_PAST))
        matched = sum(
            s.nbytes
            for s in shared
            if role_of.get(s.removed) == Role.DECODER_WITH_PAST
            and role_of.get(s.kept) in (Role.DECODER, Role.ENCODER)
        )
        if total and matched < MIN_SHARED_FRACTION * total:
            problems.append(
                f"{sources[Role.DECODER_WITH_PAST].name} shares {matched / total:.0%} of its "
                f"weights with {sources[Role.DECODER].name}; the two decoders come from "
                "different checkpoints"
            )
    decoder_roles = {Role.DECODER, Role.DECODER_WITH_PAST}
    # Only real weights count: every file holds the same small shape and axis constants.
    crossing = any(
        (role_of.get(s.kept) == Role.ENCODER) != (role_of.get(s.removed) == Role.ENCODER)
        for s in shared
        if s.nbytes >= dedup.MIN_SHARED_BYTES
    )
    separate = (config or {}).get("share_encoder_decoder_embeddings") is False
    if not crossing and not separate:
        encoder_shapes = {_key(v) for v in large(Role.ENCODER) if len(tensor_of(v).shape) == 2}
        decoder_shapes = {
            _key(v) for role in decoder_roles for v in large(role) if len(tensor_of(v).shape) == 2
        }
        # An embedding-sized matrix in both, yet nothing shared: they were trained apart.
        embeddings = {k for k in encoder_shapes & decoder_shapes if max(k[1]) >= 4 * min(k[1])}
        if embeddings:
            problems.append(
                f"{sources[Role.ENCODER].name} and {sources[Role.DECODER].name} both hold an "
                f"embedding of shape {list(sorted(embeddings)[0][1])} but share no weights; they "
                "come from different checkpoints"
            )
    return problems


def _key(value: ir.Value) -> tuple:
    tensor = tensor_of(value)
    return tensor.dtype, tuple(tensor.shape)
