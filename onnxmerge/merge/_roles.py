"""Which file of an export folder plays which part, judged from its inputs and outputs."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir

from onnxmerge import contract
from onnxmerge.errors import ExportFolderError
from onnxmerge.passes.base import name_of

logger = logging.getLogger(__name__)


class Role(enum.Enum):
    """What a file of an export is, judged from its inputs and outputs, not its name."""

    ENCODER = "encoder"
    DECODER = "decoder"
    DECODER_WITH_PAST = "decoder_with_past"
    MERGED_DECODER = "merged_decoder"
    MERGED_MODEL = "merged_model"  # a file onnxmerge wrote


# The names optimum gives each role; used to break ties and in messages.
CONVENTIONAL_NAMES = {
    Role.ENCODER: "encoder_model.onnx",
    Role.DECODER: "decoder_model.onnx",
    Role.DECODER_WITH_PAST: "decoder_with_past_model.onnx",
    Role.MERGED_DECODER: "decoder_model_merged.onnx",
}


@dataclass(frozen=True)
class Judgement:
    """A file's role, or None with the reason it fits none."""

    role: Role | None
    reason: str


def judge(model: ir.Model) -> Judgement:
    """Recognise a model's role from its interface."""
    graph = model.graph
    inputs = {name_of(v) for v in graph.inputs}
    outputs = {name_of(v) for v in graph.outputs}
    has_past = any(contract.is_past_name(n) for n in inputs)
    if contract.is_merged(model.metadata_props):
        return Judgement(Role.MERGED_MODEL, "it carries onnxmerge metadata")
    if contract.LOGITS in outputs:
        if contract.USE_CACHE_BRANCH in inputs:
            if contract.DECODER_INPUT_IDS in inputs:
                return Judgement(
                    Role.MERGED_MODEL, "it takes decoder_input_ids and use_cache_branch"
                )
            return Judgement(Role.MERGED_DECODER, "it takes use_cache_branch and returns logits")
        if contract.DECODER_INPUT_IDS in inputs:
            return Judgement(Role.MERGED_MODEL, "it takes decoder_input_ids and returns logits")
        if has_past:
            return Judgement(Role.DECODER_WITH_PAST, "it takes past_key_values and returns logits")
        if contract.OPTIMUM_ENCODER_HIDDEN_STATES in inputs:
            return Judgement(Role.DECODER, "it takes encoder_hidden_states and returns logits")
        return Judgement(None, "it returns logits but takes neither encoder_hidden_states nor past")
    if contract.OPTIMUM_ENCODER_OUTPUT in outputs and not has_past:
        return Judgement(Role.ENCODER, "it returns last_hidden_state")
    return Judgement(
        None,
        f"its outputs {sorted(outputs)[:4]} are neither an encoder's (last_hidden_state) "
        "nor a decoder's (logits)",
    )


def assign_roles(judged: dict[Path, Judgement]) -> dict[Role, Path]:
    """Pick one file per role; prefer optimum's file name when several fit.

    Raises:
        ExportFolderError: a role is claimed by several files none of which has the usual name.
    """
    by_role: dict[Role, list[Path]] = {}
    for path, judgement in sorted(judged.items()):
        if judgement.role is not None:
            by_role.setdefault(judgement.role, []).append(path)
    chosen: dict[Role, Path] = {}
    for role, paths in by_role.items():
        if len(paths) == 1:
            chosen[role] = paths[0]
            continue
        usual = [p for p in paths if p.name == CONVENTIONAL_NAMES.get(role)]
        if len(usual) != 1:
            names = ", ".join(p.name for p in paths)
            raise ExportFolderError(
                f"{len(paths)} files in {paths[0].parent} look like the {role.value}: {names}; "
                "keep one export per folder (quantized or optimized copies in a folder of "
                "their own)"
            )
        logger.info("several %s candidates; using %s", role.value, usual[0].name)
        chosen[role] = usual[0]
    return chosen
