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
    by_role = {p.role: p for p in parts}
    problems = [_decoders_apart(by_role, origin, shared, role_of)]
    separate = (config or {}).get("share_encoder_decoder_embeddings") is False
    if not separate:
        problems.append(_encoder_decoder_apart(by_role, origin, shared, role_of))
    return [p for p in problems if p is not None]


def _large(origin: dict[int, tuple[Role, ir.Value]], role: Role) -> list[ir.Value]:
    """The initializers ``role`` brought that are large enough to be shared."""
    return [
        v
        for r, v in origin.values()
        if r == role
        and v.const_value is not None
        and v.const_value.nbytes >= dedup.MIN_SHARED_BYTES
    ]


def _decoders_apart(
    by_role: dict[Role, Part],
    origin: dict[int, tuple[Role, ir.Value]],
    shared: list[dedup.SharedTensor],
    role_of: dict[str | None, Role],
) -> str | None:
    """Why the decoder with past is not from the decoder's checkpoint, if it is not."""
    with_past, decoder = by_role.get(Role.DECODER_WITH_PAST), by_role.get(Role.DECODER)
    if with_past is None or (decoder is not None and decoder.source == with_past.source):
        return None
    total = sum(tensor_of(v).nbytes for v in _large(origin, Role.DECODER_WITH_PAST))
    matched = sum(
        s.nbytes
        for s in shared
        if role_of.get(s.removed) == Role.DECODER_WITH_PAST
        and role_of.get(s.kept) in (Role.DECODER, Role.ENCODER)
    )
    if not total or matched >= MIN_SHARED_FRACTION * total:
        return None
    return (
        f"{with_past.source.name} shares {matched / total:.0%} of its "
        f"weights with {by_role[Role.DECODER].source.name}; the two decoders come from "
        "different checkpoints"
    )


def _encoder_decoder_apart(
    by_role: dict[Role, Part],
    origin: dict[int, tuple[Role, ir.Value]],
    shared: list[dedup.SharedTensor],
    role_of: dict[str | None, Role],
) -> str | None:
    """Why the encoder and the decoders are not from one checkpoint, if they hold embeddings of
    one shape yet share no weights."""
    # Only real weights count: every file holds the same small shape and axis constants.
    crossing = any(
        (role_of.get(s.kept) == Role.ENCODER) != (role_of.get(s.removed) == Role.ENCODER)
        for s in shared
        if s.nbytes >= dedup.MIN_SHARED_BYTES
    )
    if crossing:
        return None
    matrices = {
        role: {_key(v) for v in _large(origin, role) if len(tensor_of(v).shape) == 2}
        for role in (Role.ENCODER, Role.DECODER, Role.DECODER_WITH_PAST)
    }
    decoder_shapes = matrices[Role.DECODER] | matrices[Role.DECODER_WITH_PAST]
    # An embedding-sized matrix in both, yet nothing shared: they were trained apart.
    embeddings = {k for k in matrices[Role.ENCODER] & decoder_shapes if max(k[1]) >= 4 * min(k[1])}
    if not embeddings:
        return None
    return (
        f"{by_role[Role.ENCODER].source.name} and {by_role[Role.DECODER].source.name} both hold an "
        f"embedding of shape {list(sorted(embeddings)[0][1])} but share no weights; they "
        "come from different checkpoints"
    )


def _key(value: ir.Value) -> tuple:
    tensor = tensor_of(value)
    return tensor.dtype, tuple(tensor.shape)
