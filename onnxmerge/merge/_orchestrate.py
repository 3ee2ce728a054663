"""Orchestration of a merge: load, identify roles, splice, store once, check, save.

Each step lives in its own module; this one only calls them in order and gathers their numbers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx_ir as ir

from onnxmerge import check, contract, export_layout, model_io, passes
from onnxmerge.errors import (
    ExportFolderError,
    IncompatibleModelsError,
    InvalidArgumentError,
)
from onnxmerge.merge import _compat as compat
from onnxmerge.merge import _first_step
from onnxmerge.merge import _splice as splice
from onnxmerge.merge._cross_attention import CrossAttention, find_cross_attention
from onnxmerge.merge._load import find_checkpoint, load_export
from onnxmerge.merge._parts import Part, dim_sources, parts_of_file
from onnxmerge.merge._roles import Role
from onnxmerge.passes import dedup, dims, per_input, reshape_targets, tied_head, zero_bias
from onnxmerge.passes.base import NoMatch

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_NAME = "model.onnx"
# ``format_version``: 4 is the one-decoder form whose cross-attention cache may hold one row per
# input, 3 the one-decoder form; 1 and 2 name the two-decoder form (version 1, and 2 once
# quantized).
FORMATS = (1, 2, 3, 4)


class _FirstStepDiffers(Exception):
    """Raised by the output check when version 3's first step is not the sources' (internal)."""

    def __init__(self, verdict: _first_step.Verdict):
        super().__init__(verdict.reason)
        self.verdict = verdict


@dataclass(frozen=True)
class InputFile:
    path: Path
    role: str
    bytes: int


@dataclass(frozen=True)
class MergeResult:
    """The merged file and the numbers of the merge."""

    path: Path
    layout: str
    inputs: tuple[InputFile, ...]
    output_bytes: int
    tensors_in: int
    tensors_out: int
    shared: tuple[dedup.SharedTensor, ...]
    checkpoint_bytes: int | None
    # What every rewrite pass did, by its result name (see :mod:`onnxmerge.passes`).
    rewrites: dict[str, int] = field(default_factory=dict)
    # The format version written (docs/format.md), and why that one.
    format_version: str = contract.FormatFacts().version
    format_reason: str = ""
    # The dtype merged (transformers.js's names; None: files with other names), where its files
    # and the configs were, and the other dtypes the folder holds.
    dtype: str | None = None
    model_dir: Path | None = None
    config_dir: Path | None = None
    dtypes_present: tuple[str, ...] = ()

    def _replace_reason(self, reason: str) -> MergeResult:
        return dataclasses.replace(self, format_reason=reason)

    @property
    def constants_lifted(self) -> int:
        """Constant nodes turned into initializers, so that they could be shared."""
        return self.rewrites.get("constants_lifted", 0)

    @property
    def input_bytes(self) -> int:
        """Bytes of every file the merge read."""
        return sum(f.bytes for f in self.inputs)

    @property
    def bytes_saved(self) -> int:
        """Bytes on disk the merged file saves against the files it was made from."""
        return self.input_bytes - self.output_bytes

    @property
    def transposed(self) -> tuple[dedup.SharedTensor, ...]:
        """The shared tensors found as a transposed copy (a tied LM head stored apart)."""
        return tuple(s for s in self.shared if s.transposed)

    @property
    def checkpoint_ratio(self) -> float | None:
        """The merged file's bytes over the PyTorch checkpoint's, where one was found."""
        return self.output_bytes / self.checkpoint_bytes if self.checkpoint_bytes else None


_UNSET: Any = object()


def merge_seq2seq(
    export_dir: str | os.PathLike | export_layout.ExportLayout,
    output: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
    external_data: bool | None = None,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
    format_version: int | None = None,
    dtype: str | None = None,
    format: Any = _UNSET,
) -> model_io.WrittenPath[MergeResult]:
    """Merge an optimum seq2seq export folder into one ONNX model; return its path.

    Args:
        export_dir: the folder ``optimum-cli export onnx`` wrote, or a Hub repository laid out for
            transformers.js (configs at the root, models under ``onnx/``), or its ``onnx/``
            folder; an :class:`onnxmerge.export_layout.ExportLayout` already resolved.
        output: the file to write; ``<export_dir>/model.onnx`` by default
            (``model{suffix}.onnx`` for another dtype).
        overwrite: replace an existing output file.
        external_data: ``None`` writes weights to ``<output>_data`` only past 2 GB; ``True`` always;
            ``False`` never (a model past 2 GB is then refused).
        force: merge even when the compatibility checks find the files do not belong together.
        progress: called with the name of each step as it starts (for progress displays).
        format_version: ``3``, one decoder for every step; ``4``, that with the cross-attention
            rows once per input; ``2`` (or ``1``), the two decoders under an ``If``. ``None``
            writes 4 or 3 where it holds for these files (the merge proves it on sample inputs)
            and 2 otherwise; ``MergeResult.format_reason`` says why.
        dtype: which files of a folder holding several dtypes (transformers.js's names and
            suffixes: ``"fp32"``, ``"q8"`` for ``_quantized``, ``"fp16"``, ...); fp32 by default.
        format: deprecated spelling of ``format_version``.

    Returns:
        The written file's path (a :class:`pathlib.Path`); its ``report`` is the
        :class:`MergeResult`.

    Raises:
        InvalidArgumentError: ``format_version`` is not one of :data:`FORMATS`.
        OnnxMergeError: or one of its subclasses, with what is wrong and what to do. Nothing is
            written and the inputs are never modified.
    """
    format_version = _format_version(format_version, format)
    layout = (
        export_dir
        if isinstance(export_dir, export_layout.ExportLayout)
        else export_layout.resolve(export_dir, dtype)
    )
    output = Path(output) if output is not None else _default_output(layout)
    # Before any model is read; checked again with the data files once they are known. A file
    # at the output's own path is the previous merge, which the loader leaves out (or refuses).
    earlier = output.resolve()
    inputs = [f for f in layout.files if f.resolve() != earlier]
    model_io.check_output(output, inputs, overwrite=overwrite)
    job = _Job(layout, output, overwrite, external_data, force, progress or (lambda _: None))
    result = _merge(job, format_version)
    return model_io.WrittenPath.of(result.path, result)


def merge_seq2seq_with_report(
    export_dir: str | os.PathLike | export_layout.ExportLayout,
    output: str | os.PathLike | None = None,
    **options: Any,
) -> MergeResult:
    """Deprecated: ``merge_seq2seq(...).report``, which this returns.

    Takes :func:`merge_seq2seq`'s arguments.
    """
    warnings.warn(
        "merge_seq2seq_with_report is deprecated; merge_seq2seq returns the path, whose "
        "`report` is the MergeResult",
        DeprecationWarning,
        stacklevel=2,
    )
    return merge_seq2seq(export_dir, output, **options).report


def _format_version(format_version: int | None, format: Any) -> int | None:
    """The version asked for, under its name or the deprecated ``format``; refused if unknown."""
    if format is not _UNSET:
        if format_version is not None:
            raise InvalidArgumentError(
                "format is the deprecated name of format_version: pass format_version only",
                argument="format",
            )
        warnings.warn(
            "merge_seq2seq(format=...) is deprecated; pass format_version=...",
            DeprecationWarning,
            stacklevel=3,
        )
        format_version = format
    if format_version is not None and format_version not in FORMATS:
        raise InvalidArgumentError(
            f"format_version must be one of {', '.join(map(str, FORMATS))} (or None), got "
            f"{format_version!r}",
            argument="format_version",
        )
    return format_version


def _default_output(layout: export_layout.ExportLayout) -> Path:
    return layout.source / export_layout.output_name(layout.dtype)


@dataclass(frozen=True)
class _Job:
    """What one merge writes, and how."""

    layout: export_layout.ExportLayout
    output: Path
    overwrite: bool
    external_data: bool | None
    force: bool
    step: Callable[[str], None]


@dataclass
class _Loaded:
    """The export's files, loaded and judged: what the analysis reads."""

    chosen: dict[Role, Path]
    models: dict[Path, ir.Model]
    data_files: dict[Path, set[Path]]
    files_read: list[Path]
    parts: list[Part]


@dataclass
class _Analysis:
    """What the merge learnt of the files before rewriting them."""

    cross: CrossAttention | None
    format_reason: str
    origins: dict
    tolerated: frozenset[tuple[str, str]]
    separate_dims: dims.SeparateSymbolicDims


def _merge(job: _Job, format_version: int | None) -> MergeResult:
    """Load, analyse, rewrite, validate, save: the merge in the order its data flows."""
    job.step("loading")
    loaded = _load(job)
    analysis = _analyse(loaded, format_version)
    job.step("splicing")
    model = splice.splice(loaded.parts, loaded.models, analysis.cross)
    job.step("deduplicating")
    rewrites, shared, format_reason = _rewrite(model, analysis, format_version, job.layout.source)
    _validate(model, job, loaded, analysis, shared)
    job.step("saving and checking")
    verdict = _save_checked(
        model,
        job.output,
        loaded.chosen,
        analysis.tolerated,
        prove=analysis.cross is not None,
        external_data=job.external_data,
        protected=frozenset(f.resolve() for f in loaded.files_read),
    )
    if verdict is not None and not verdict.holds:
        return _as_two_decoders(job, format_version, verdict)
    if verdict is not None:
        format_reason += f"; a prompt is fed one token per step ({verdict.reason})"
    result = _report(model, job, loaded, len(analysis.origins), rewrites, shared, format_reason)
    logger.info(
        "merged %d files (%d bytes) into %s (%d bytes); %d tensors shared, %d transposed",
        len(result.inputs),
        result.input_bytes,
        job.output,
        result.output_bytes,
        len(result.shared),
        len(result.transposed),
    )
    return result


def _load(job: _Job) -> _Loaded:
    chosen, models, data_files = load_export(
        job.layout.model_dir, job.output, files=job.layout.files
    )
    files_read = [f for p in chosen.values() for f in (p, *data_files[p])]
    model_io.check_output(job.output, files_read, overwrite=job.overwrite)
    parts = [
        part
        for role in (Role.ENCODER, Role.MERGED_DECODER, Role.DECODER, Role.DECODER_WITH_PAST)
        if role in chosen
        for part in parts_of_file(models[chosen[role]], role, chosen[role])
    ]
    return _Loaded(chosen, models, data_files, files_read, parts)


def _analyse(loaded: _Loaded, format_version: int | None) -> _Analysis:
    cross, format_reason = _one_decoder_part(loaded.parts, format_version)
    return _Analysis(
        cross=cross,
        format_reason=format_reason,
        origins=compat.origins(loaded.parts),
        # Operators the checker does not know, which the merged model may hold too.
        tolerated=check.unknown_operators(loaded.models.values()),
        # Made before the splice, which moves the parts' nodes into one graph.
        separate_dims=dims.SeparateSymbolicDims(dim_sources(loaded.parts)),
    )


def _rewrite(
    model: ir.Model, analysis: _Analysis, format_version: int | None, source: Path
) -> tuple[tuple[passes.StepResult, ...], tuple[dedup.SharedTensor, ...], str]:
    """Run the rewrite passes; their results, the tensors stored once and the format's reason."""
    cross, format_reason = analysis.cross, analysis.format_reason
    rewrites = passes.run(model, (analysis.separate_dims, *rewrite_steps(cross is not None)))
    shared = passes.records(rewrites)
    if cross is not None and format_version != 3:
        rewrites += passes.run(model, (per_input.CrossAttentionPerInput(),))
        format_reason = _per_input(model, rewrites[-1], format_version, source, format_reason)
    return rewrites, shared, format_reason


def _validate(
    model: ir.Model,
    job: _Job,
    loaded: _Loaded,
    analysis: _Analysis,
    shared: tuple[dedup.SharedTensor, ...],
) -> None:
    """Judge that the files come from one checkpoint; record the configs the merge read."""
    configs = _configs(job.layout, loaded.files_read)
    config = configs[contract.META_CONFIG]
    problems = compat.checkpoint_problems(
        loaded.parts,
        analysis.origins,
        list(shared),
        json.loads(config) if config else None,
    )
    _judge(problems, job.force)
    model.metadata_props.update({key: text for key, text in configs.items() if text is not None})


def _as_two_decoders(
    job: _Job, format_version: int | None, verdict: _first_step.Verdict
) -> MergeResult:
    """Merge again as format 2 where version 3's first step is not proven (unless asked for)."""
    if format_version in (3, 4):
        raise IncompatibleModelsError(
            f"{job.layout.source} cannot be merged as format {format_version}: {verdict.reason}; "
            "merge with format 2 (--format 2)"
        )
    logger.info("writing format 2: %s", verdict.reason)
    return _merge(job, 2)._replace_reason(
        f"the first step of version 3 is not proven: {verdict.reason}"
    )


def _configs(layout: export_layout.ExportLayout, files_read: list[Path]) -> dict[str, str | None]:
    """The metadata a merged file carries from its folder: the configs and the files read."""
    return {
        contract.META_CONFIG: _read_json(layout.config_dir / "config.json"),
        contract.META_GENERATION_CONFIG: _read_json(layout.config_dir / "generation_config.json"),
        contract.META_SOURCES: export_layout.sources_record(layout, files_read),
    }


def _judge(problems: list[str], force: bool) -> None:
    """Refuse files that do not come from one model, unless forced (then say so in the log)."""
    if problems and not force:
        raise IncompatibleModelsError(
            "the files do not come from one model (pass force=True / --force to merge anyway):",
            problems,
        )
    for problem in problems:
        logger.warning("merging anyway: %s", problem)


def _report(
    model: ir.Model,
    job: _Job,
    loaded: _Loaded,
    tensors_in: int,
    rewrites: tuple[passes.StepResult, ...],
    shared: tuple[dedup.SharedTensor, ...],
    format_reason: str,
) -> MergeResult:
    """The numbers of a merge whose file is written."""
    layout, output = job.layout, job.output
    inputs = tuple(
        InputFile(path, role.value, model_io.file_bytes(path, loaded.data_files[path]))
        for role, path in loaded.chosen.items()
    )
    checkpoint = find_checkpoint(layout.config_dir)
    return MergeResult(
        path=output,
        layout=model.metadata_props[contract.META_LAYOUT],
        inputs=inputs,
        output_bytes=model_io.file_bytes(output, model_io.data_files_of(output)),
        tensors_in=tensors_in,
        tensors_out=len(model.graph.initializers),
        shared=shared,
        checkpoint_bytes=checkpoint.stat().st_size if checkpoint else None,
        rewrites=passes.counts(rewrites),
        format_version=contract.format_of(model.metadata_props).version,
        format_reason=format_reason,
        dtype=layout.dtype,
        model_dir=layout.model_dir,
        config_dir=layout.config_dir,
        dtypes_present=layout.present,
    )


def _save_checked(
    model: ir.Model,
    output: Path,
    chosen: dict[Role, Path],
    tolerated: frozenset[tuple[str, str]],
    *,
    prove: bool,
    external_data: bool | None,
    protected: frozenset[Path],
) -> _first_step.Verdict | None:
    """Save through the output check and, for format 3, the first step's proof.

    Returns None when the file was written as it is; the proof's verdict otherwise. Where only
    a first step of several tokens differs, the file is written again recording that a prompt
    is fed one token per step; where one token differs, nothing is written.
    """

    def validate(path: Path) -> None:
        check.check_written_model(path, tolerated=tolerated, sources=list(chosen.values()))
        if prove and contract.META_PROMPT_TOKENS_PER_STEP not in model.metadata_props:
            verdict = _first_step.prove_first_step(path, chosen)
            if verdict.tokens_per_step is not None:
                raise _FirstStepDiffers(verdict)

    def save() -> None:
        model_io.save_model_atomically(
            model, output, external_data=external_data, validate=validate, protected=protected
        )

    try:
        save()
    except _FirstStepDiffers as differs:
        if differs.verdict.holds:
            tokens = str(differs.verdict.tokens_per_step)
            model.metadata_props[contract.META_PROMPT_TOKENS_PER_STEP] = tokens
            save()
        return differs.verdict
    return None


def _one_decoder_part(
    parts: list[Part], format_version: int | None
) -> tuple[CrossAttention | None, str]:
    """The decoder's cross-attention part where version 3 is to be written, and why (not)."""
    by_role = {p.role: p for p in parts}
    decoder, with_past = by_role.get(Role.DECODER), by_role.get(Role.DECODER_WITH_PAST)
    if format_version in (1, 2):
        return None, f"format {format_version} was asked for"
    if with_past is None or decoder is None:
        return None, "exported without past: one decoder is the whole model"
    names = [n for n in decoder.outputs if contract.is_encoder_present(n)]
    found = (
        find_cross_attention(
            decoder.graph,
            [decoder.outputs[n] for n in names],
            [
                value
                for name, value in decoder.inputs.items()
                if name
                not in (
                    contract.OPTIMUM_ENCODER_HIDDEN_STATES,
                    contract.OPTIMUM_ENCODER_ATTENTION_MASK,
                )
            ],
        )
        if names
        else NoMatch(f"{decoder.source.name} returns no cross-attention keys and values")
    )
    if isinstance(found, NoMatch):
        if format_version in (3, 4):
            raise IncompatibleModelsError(
                f"the export cannot be merged as format {format_version}: {found.reason}; merge "
                "with format 2 (--format 2)"
            )
        return None, f"format 2, since {found.reason}"
    return found, "one decoder for every step"


def _per_input(
    model: ir.Model,
    result: passes.StepResult,
    format_version: int | None,
    export_dir: Path,
    reason: str,
) -> str:
    """Version 4 where every cross-attention product reads one row per input; the reason."""
    if result.count:
        contract.record_format(model.metadata_props, cross_attention_per_input=True)
        return f"{reason}, its cross-attention keys and values once per input"
    why = result.records[0] if result.records else "nothing to rewrite"
    if format_version == 4:
        raise IncompatibleModelsError(
            f"{export_dir} cannot be merged as format 4: {why}; merge with format 3 (--format 3)"
        )
    return f"{reason}; its cross-attention keys and values once per row (not format 4: {why})"


def rewrite_steps(one_decoder: bool = False) -> tuple[ir.passes.InPlacePass, ...]:
    """The rewrite passes of a merge after the splice, in the order they run.

    In version 3 the decoder without past keeps only its cross-attention part, so the weights it
    no longer reads are unused; they are compared with the decoder with past's (the check that
    both come from one checkpoint) before anything removes unused tensors.
    """
    store_once = dedup.store_once_steps()
    fold = reshape_targets.FoldReshapeTargets()
    ordered = (*store_once[:2], fold, *store_once[2:]) if one_decoder else (fold, *store_once)
    # Dropping zero biases leaves their tensors unread: before the unread ones are removed.
    *rewrites, remove_unused = ordered
    return (
        *rewrites,
        zero_bias.DropZeroBias(),
        remove_unused,
        tied_head.GemmForTransposedWeights(),
    )


def _read_json(path: Path) -> str | None:
    if not path.is_file():
        return None
    try:
        # Normalised so the file bytes do not depend on the JSON's formatting.
        return json.dumps(json.loads(path.read_text(encoding="utf-8")), sort_keys=True)
    except (OSError, ValueError) as e:
        raise ExportFolderError(f"{path} is not valid JSON: {e}") from e


__all__ = ["merge_seq2seq", "merge_seq2seq_with_report", "MergeResult", "InputFile"]
