"""One onnxruntime session over a merged model, and the step API built on it.

``first_step`` runs the encoder and the decoder on the prompt (``use_cache_branch = false``);
``next_step`` runs the decoder with past on new tokens (``use_cache_branch = true``). The cache
keeps the tensors the model returned, as numpy arrays that share onnxruntime's buffers, so steps
pass them back without copying.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from onnxmerge import _ort as ort
from onnxmerge import contract as c
from onnxmerge._ort import release_free_heap
from onnxmerge._wire import Graph, graph_structure
from onnxmerge.errors import GenerationError, InvalidMergedModelError
from onnxmerge.runtime._accelerations import Accelerations
from onnxmerge.runtime._accelerations import checked as checked_accelerations
from onnxmerge.runtime._graph_reads import (
    gathered_only,
    pasts_read_only_into_presents,
    presents_follow_layers,
)
from onnxmerge.runtime._greedy_head import FLAG, HIDDEN, GreedyHead
from onnxmerge.runtime._memory import (
    GatheredPages,
    changed_files,
    mapped_file_states,
    release_mapped_weights,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: type
    shape: tuple[Any, ...]


@dataclass(frozen=True)
class Cache:
    """What a step hands to the next one.

    With past: ``decoder`` and ``encoder`` hold the key/value tensors per layer (key, value,
    key, value, ...), ``[rows, heads, length, head_dim]``. Without past: ``tokens`` holds the
    decoder prefix so far and ``encoder_inputs`` the inputs the encoder is re-run on.
    Methods return new caches; a cache is never changed in place (beam search in ``generate()``
    moves rows within the arrays of the cache only it holds). ``per_input`` (format version 4):
    ``encoder`` may hold fewer rows, one per input, which ``rows / their rows`` consecutive
    decoder rows read; expanding to beams then leaves them as they are.
    """

    attention_mask: np.ndarray | None
    decoder: tuple[np.ndarray, ...] = ()
    encoder: tuple[np.ndarray, ...] = ()
    tokens: np.ndarray | None = None
    encoder_inputs: Mapping[str, np.ndarray] | None = None
    per_input: bool = False

    @property
    def rows(self) -> int:
        """Rows of the batch the cache holds (inputs times beams)."""
        if self.tokens is not None:
            return self.tokens.shape[0]
        return self.decoder[0].shape[0]

    @property
    def length(self) -> int:
        """Decoder positions already processed."""
        if self.tokens is not None:
            return self.tokens.shape[1]
        return self.decoder[0].shape[2]

    def reorder(self, indices: Sequence[int] | np.ndarray, *, encoder: bool = True) -> Cache:
        """Rows ``indices`` of this cache, in that order (beam search's cache reorder).

        ``encoder=False`` keeps the encoder part as it is; beam search uses it because beams only
        move within an input, whose encoder tensors are the same for all its beams.
        """
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1 or (idx.size and (idx.min() < 0 or idx.max() >= self.rows)):
            raise GenerationError(
                f"reorder indices must be a 1-D list of rows in [0, {self.rows}), "
                f"got {idx.tolist()}"
            )
        if not encoder and idx.size != self.rows:
            raise GenerationError("reorder(encoder=False) must keep the number of rows")
        take = lambda a: np.take(a, idx, axis=0)  # noqa: E731
        mask = (
            None
            if self.attention_mask is None
            else (take(self.attention_mask) if encoder else self.attention_mask)
        )
        if self.tokens is not None:
            inputs = self.encoder_inputs or {}
            return Cache(
                attention_mask=mask,
                tokens=take(self.tokens),
                encoder_inputs={k: take(v) for k, v in inputs.items()} if encoder else inputs,
            )
        return Cache(
            attention_mask=mask,
            decoder=tuple(take(t) for t in self.decoder),
            encoder=self._encoder_rows(idx) if encoder else self.encoder,
            per_input=self.per_input,
        )

    def kept(self, indices: np.ndarray, *, encoder: bool = True) -> Cache:
        """``reorder(indices, encoder=encoder)`` for a cache that only its caller holds, to no
        more rows than it has: the rows move within the same arrays, to their front where fewer
        stay, and only the rows that move are copied. New arrays would hold a second cache
        until the first goes, and onnxruntime's arena keeps what it made."""
        idx = np.asarray(indices, dtype=np.int64)
        moving = self.decoder + (self.encoder if encoder else ())
        picked = self._encoder_indices(idx) if encoder and self.encoder else None
        if (
            self.tokens is not None
            or idx.size > self.rows
            or (not encoder and idx.size != self.rows)
            or (idx.size and (idx.min() < 0 or idx.max() >= self.rows))
            or not all(t.flags.writeable for t in moving)
            or len({t.ctypes.data for t in moving}) < len(moving)
            or (picked is not None and picked.size > self.encoder[0].shape[0])
        ):
            return self.reorder(idx, encoder=encoder)  # which says what is wrong, if anything
        mask = self.attention_mask
        if encoder and mask is not None:
            mask = np.take(mask, idx, axis=0)
        return Cache(
            attention_mask=mask,
            decoder=tuple(_moved_to_front(t, idx) for t in self.decoder),
            encoder=self.encoder
            if picked is None
            else tuple(_moved_to_front(t, picked) for t in self.encoder),
            per_input=self.per_input,
        )

    def _encoder_indices(self, idx: np.ndarray) -> np.ndarray | None:
        """The encoder rows that decoder rows ``idx`` read: one per run of rows that read the
        same input, where the cache may hold them so and the runs are of one length; None where
        those are the rows held, in order."""
        if not self.per_input:
            return idx
        held = self.encoder[0].shape[0]
        inputs = idx // (self.rows // held)
        starts = np.flatnonzero(np.diff(inputs, prepend=-1))
        runs = np.diff(np.append(starts, inputs.size))
        picked = inputs[starts] if runs.size and (runs == runs[0]).all() else inputs
        return None if np.array_equal(picked, np.arange(held)) else picked

    def _encoder_rows(self, idx: np.ndarray) -> tuple[np.ndarray, ...]:
        """The encoder tensors for decoder rows ``idx`` (``_encoder_indices``)."""
        if not self.encoder:
            return self.encoder
        picked = self._encoder_indices(idx)
        if picked is None:
            return self.encoder
        return tuple(np.take(t, picked, axis=0) for t in self.encoder)

    def expand(self, n: int) -> Cache:
        """Every row repeated ``n`` times in place (row r becomes rows r*n ... r*n+n-1)."""
        return self.reorder(np.repeat(np.arange(self.rows), n))


def _moved_to_front(tensor: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``tensor[rows]`` in ``tensor``'s first rows; the rows that move are gathered before any
    is written, so any order is safe."""
    kept = tensor if rows.size == len(tensor) else tensor[: rows.size]
    moved = np.flatnonzero(rows != np.arange(rows.size))
    if moved.size:
        kept[moved] = tensor[rows[moved]]
    return kept


@dataclass(frozen=True)
class StepOutput:
    """``logits``: ``[rows, new_tokens, vocab]`` for the tokens fed; ``cache`` for the next step;
    ``hidden``: the head's input, for a greedy step only."""

    logits: np.ndarray
    cache: Cache
    hidden: np.ndarray | None = None


def _session_options(session_options: Any | None, threads: int | None) -> Any:
    """The session options to open with; refuses a bad ``threads`` before anything is read."""
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
            raise GenerationError(
                f"threads must be a positive integer, got {threads!r}", argument="threads"
            )
        if session_options is not None:
            raise GenerationError(
                "give threads or session_options (with its intra_op_num_threads), not both",
                argument="threads",
            )
        return ort.session_options(threads=int(threads))
    return session_options if session_options is not None else ort.session_options()


def _model_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_file():
        raise InvalidMergedModelError(f"{path} is not a file; pass the merged .onnx file")
    return path


class MergedSession:
    """An onnxruntime session over a merged model, with the step API.

    ``opened`` is the file onnxruntime read: the model, or its entry in ``session_cache``;
    ``wrote_cache_entry`` says whether this load wrote that entry. ``accelerations`` says what
    the runtime does beyond the plain search (``Accelerations``).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        providers: Sequence[Any] | None = None,
        session_options: Any | None = None,
        session_cache: str | os.PathLike | None = None,
        threads: int | None = None,
        accelerations: Accelerations | None = None,
    ):
        self.accelerations = checked_accelerations(accelerations)
        options = _session_options(session_options, threads)
        self.path = _model_file(path)
        if not self.accelerations.session_cache:
            session_cache = None
        mapped = self.accelerations.mapped_open
        try:
            if session_cache is None:
                session = ort.open_session(self.path, options, providers, mapped=mapped)
                opened, wrote = self.path, False
            else:
                from onnxmerge.runtime._session_cache import open_with_cache

                session, opened, wrote = open_with_cache(
                    self.path, session_cache, options, providers, mapped=mapped
                )
        except Exception as error:
            raise InvalidMergedModelError(
                f"onnxruntime cannot load {self.path}: {error}"
            ) from error
        self._adopt(session, opened, wrote, options)

    @classmethod
    def over(
        cls, path: str | os.PathLike, session: Any, *, accelerations: Accelerations | None = None
    ) -> MergedSession:
        """A session over ``session``, already opened on ``path`` by another runtime, which has
        the part of onnxruntime's ``InferenceSession`` that steps use: ``run``, ``get_inputs``,
        ``get_outputs`` and ``get_modelmeta`` (``benchmarks/_openvino_backend.py``)."""
        self = cls.__new__(cls)
        self.accelerations = checked_accelerations(accelerations)
        self.path = _model_file(path)
        self._adopt(session, self.path, False, None)
        return self

    def _adopt(self, session: Any, opened: Path, wrote_cache_entry: bool, options: Any) -> None:
        """Hand the load's memory back, then read the contract, the step names and the greedy
        head of the opened ``session``."""
        self.session, self.opened, self.wrote_cache_entry = session, opened, wrote_cache_entry
        release_mapped_weights(self.opened)
        self._mapped_files = mapped_file_states(self.opened)
        self._read_contract()
        self._true = np.ones(1, dtype=np.bool_)
        self._false = np.zeros(1, dtype=np.bool_)
        self._passed_through: dict[str, str] | None = None
        self._shared_values: dict[str, tuple[np.ndarray, Any]] = {}
        if self.has_past:
            self._check_past()
        # A session-cache entry may hold an int8 head for greedy search under FLAG.
        self._has_flag = self.has_past and FLAG in self.inputs and HIDDEN in self.output_names
        self.greedy_head = (
            GreedyHead.load(self.opened.parent)
            if self._has_flag and self.accelerations.greedy_head
            else None
        )
        if self.greedy_head is not None:
            self._greedy_outputs = self._next_outputs + [HIDDEN]
        self.pasts_die_by_layer, gathered = self._graph_facts(options)
        # After the greedy head, whose rows of the embedding are mapped as well.
        self._gathered = GatheredPages(
            self.opened, gathered, self.accelerations.gathered_pages_kept
        )
        release_free_heap()

    def _read_contract(self) -> None:
        """The contract, inputs and outputs of the session; refuses encoder inputs it lacks."""
        inputs = self.session.get_inputs()
        outputs = self.session.get_outputs()
        metadata = self.session.get_modelmeta().custom_metadata_map
        self.info = c.read_contract(
            metadata, [i.name for i in inputs], [o.name for o in outputs], self.path
        )
        self.inputs = {
            i.name: InputSpec(i.name, ort.ORT_TO_NUMPY.get(i.type, np.float32), tuple(i.shape))
            for i in inputs
        }
        self.output_names = [o.name for o in outputs]
        # A session-cache entry with a greedy head returns [rows * new tokens, vocab].
        self.flat_logits = any(o.name == c.LOGITS and len(o.shape) == 2 for o in outputs)
        self.encoder_input_names = self.info.encoder_inputs or tuple(
            name
            for name in self.inputs
            if name not in (c.DECODER_INPUT_IDS, c.USE_CACHE_BRANCH, FLAG)
            and not c.is_past_name(name)
        )
        missing = [n for n in self.encoder_input_names if n not in self.inputs]
        if missing:
            raise InvalidMergedModelError(
                f"{self.path}: metadata lists encoder inputs {missing} that the graph does not have"
            )
        self.has_attention_mask = c.ATTENTION_MASK in self.inputs
        self.has_past = self.info.has_past
        layers = self.info.num_layers
        self.past_decoder_names = c.past_names(layers, "decoder")
        self.past_encoder_names = c.past_names(layers, "encoder")
        self.present_decoder_names = c.present_names(layers, "decoder")
        self.present_encoder_names = c.present_names(layers, "encoder")

    def _check_past(self) -> None:
        """Refuse a cached branch without its pasts and presents; name each step's outputs."""
        absent = [
            n
            for n in self.past_decoder_names + self.past_encoder_names + [c.USE_CACHE_BRANCH]
            if n not in self.inputs
        ] + [
            n
            for n in self.present_decoder_names + self.present_encoder_names
            if n not in self.output_names
        ]
        if absent:
            raise InvalidMergedModelError(
                f"{self.path} is not a complete merged model: it lacks {absent[:4]}"
            )
        self._first_outputs = [c.LOGITS] + self.present_decoder_names + self.present_encoder_names
        self._next_outputs = [c.LOGITS] + self.present_decoder_names
        # Format 3's cached steps return the past cross-attention tensors as they came in;
        # on another device than the CPU, binding them to numpy arrays would copy them.
        self._passed_through = (
            dict(zip(self.present_encoder_names, self.past_encoder_names, strict=True))
            if self.info.one_decoder and self._on_cpu()
            else None
        )
        self._past_shapes = {
            name: self._past_shape(name)
            for name in self.past_decoder_names + self.past_encoder_names
        }

    def _on_cpu(self) -> bool:
        """Whether the session is onnxruntime's on its CPU provider alone."""
        providers = getattr(self.session, "get_providers", None)
        return providers is not None and providers() == ["CPUExecutionProvider"]

    def _graph_facts(self, options: Any) -> tuple[bool, list[tuple[Path, int, int]]]:
        """What the runtime needs of the graph's structure, which is read once here and not
        kept (a parsed graph is megabytes): whether a step's presents may be written over the
        pasts (``pasts_die_by_layer``), and where the weights lie that steps only gather rows
        of (:class:`GatheredPages`). What outlives the read is built after it is gone: an
        object made while the graph's thousands are alive holds their memory for good."""
        try:
            graph = graph_structure(self.opened)
        except Exception as error:  # the session runs it: a reader's limit, not a bad model
            logger.debug("%s not read: %s", self.opened, error)
            return False, []
        # The graph reads each decoder past only into its own present, and each layer's
        # presents are computed from the layer before's: a node of layer ``i`` writes only
        # once the pasts of the layers before have been read to the end.
        pasts_die = (
            self.has_past
            and pasts_read_only_into_presents(graph, self.past_decoder_names)
            and presents_follow_layers(graph, self.present_decoder_names)
        )
        places = self._gathered_tensors(options, graph)
        del graph
        return bool(pasts_die), [
            (self.opened.parent / location, offset, length) for location, offset, length in places
        ]

    def _gathered_tensors(self, options: Any, graph: Graph) -> list[tuple[str, int, int]]:
        """Where the weights lie that steps only gather rows of, outside the runs' packed copies:
        on onnxruntime's CPU provider, which packs MatMul and Gemm weights unless told not to."""
        if options is None or not self._on_cpu():
            return []
        try:
            if options.get_session_config_entry("session.disable_prepacking") == "1":
                return []
        except Exception:  # onnxruntime raises where the entry was never set
            pass
        found = []
        for tensor in gathered_only(graph):
            where = tensor.external_data
            if "location" in where and "length" in where:
                found.append((where["location"], int(where.get("offset", 0)), int(where["length"])))
        return found

    # -- shapes ---------------------------------------------------------------------------------

    def _past_shape(self, name: str) -> tuple[int, int]:
        """(heads, head_dim) of a past input, from its declared shape or the model config."""
        shape = self.inputs[name].shape
        heads, head_dim = (shape[1], shape[3]) if len(shape) == 4 else (None, None)
        if isinstance(heads, int) and isinstance(head_dim, int):
            return heads, head_dim
        cfg = self.info.config
        heads = cfg.get("decoder_attention_heads") or cfg.get("num_heads") or cfg.get("n_head")
        d_model = cfg.get("d_model") or cfg.get("hidden_size")
        head_dim = cfg.get("d_kv") or (d_model // heads if heads and d_model else None)
        if not heads or not head_dim:
            raise InvalidMergedModelError(
                f"{self.path}: the shape of {name} does not give heads and head_dim, and the "
                "embedded config does not either"
            )
        return int(heads), int(head_dim)

    def _empty_past(self, rows: int) -> dict[str, np.ndarray]:
        dtype = self.inputs[self.past_decoder_names[0]].dtype
        return {
            name: np.zeros((rows, heads, 0, head_dim), dtype=dtype)
            for name, (heads, head_dim) in self._past_shapes.items()
        }

    def placeholders(self, rows: int) -> dict[str, np.ndarray]:
        """Zero-length stand-ins for the encoder inputs a cached step does not read."""
        result: dict[str, np.ndarray] = {}
        for name in self.encoder_input_names:
            if name == c.ATTENTION_MASK:
                continue
            spec = self.inputs[name]
            middle = [d if isinstance(d, int) else 1 for d in spec.shape[1:-1]]
            result[name] = np.zeros((rows, *middle, 0), dtype=spec.dtype)
        return result

    @property
    def writes_into(self) -> bool:
        """Whether ``next_step(into=...)`` writes the presents into the caller's arrays."""
        return bool(self._passed_through)

    # -- steps ----------------------------------------------------------------------------------

    def _run(
        self,
        output_names: list[str],
        feeds: dict[str, np.ndarray],
        passed_through: Mapping[str, str] | None = None,
        into: Mapping[str, np.ndarray] | None = None,
    ) -> list[np.ndarray]:
        """``session.run``; ``passed_through`` maps outputs that return an input unchanged to that
        input. onnxruntime writes such an output into the input's own buffer, which it then skips
        copying: format 3's cross-attention keys and values, every cached step. ``into`` gives
        outputs arrays of their shape to be written into (only with ``passed_through``)."""
        if self._mapped_files and (changed := changed_files(self._mapped_files)):
            # Mapped weights are read from the file as it is now: refuse a half-changed model.
            raise GenerationError(
                f"{changed[0]} was written to since the model was opened, and the session reads "
                "weights from it: open the model again (writers that replace the file by a "
                "rename, as onnxmerge's do, leave an open model as it was)"
            )
        try:
            return self._run_once(output_names, feeds, passed_through, into)
        finally:
            self._gathered.after_step()

    def _run_once(
        self,
        output_names: list[str],
        feeds: dict[str, np.ndarray],
        passed_through: Mapping[str, str] | None,
        into: Mapping[str, np.ndarray] | None,
    ) -> list[np.ndarray]:
        if not passed_through:
            return self.session.run(output_names, feeds)
        import onnxruntime

        session: Any = self.session  # an InferenceSession: the backend is onnxruntime
        binding = session.io_binding()
        into = into or {}
        for name in output_names:
            if name in into:
                ort.bind_output_into(binding, name, into[name])
            else:
                binding.bind_output(name)
        shared, kept = {}, []  # kept: what onnxruntime reads in place lives until the run ends
        for name, array in feeds.items():
            # onnxruntime writes the same values back: only into an array it may write into.
            if (
                name in passed_through.values()
                and array.flags.writeable
                and array.flags.c_contiguous
            ):
                shared[name] = self._shared_value(name, array, onnxruntime)
                binding.bind_ortvalue_input(name, shared[name])
            else:
                kept.append(np.ascontiguousarray(array))
                binding.bind_cpu_input(name, kept[-1])
        for output, source in passed_through.items():
            if source in shared:
                binding.bind_ortvalue_output(output, shared[source])
        session.run_with_iobinding(binding)
        if all(name in into for name in output_names):
            return [into[name] for name in output_names]
        values = binding.get_outputs()
        return [
            into[name] if name in into else values[i].numpy() for i, name in enumerate(output_names)
        ]

    def _shared_value(self, name: str, array: np.ndarray, onnxruntime: Any) -> Any:
        """An ``OrtValue`` over ``array``, the last step's where it was over the same array: a
        window's steps read the same cross-attention tensors, eight or more a step."""
        last = self._shared_values.get(name)
        if last is not None and last[0] is array:
            return last[1]
        value = onnxruntime.OrtValue.ortvalue_from_numpy(array)
        # Replaced whole, never changed: searches at once on one session only miss it.
        self._shared_values[name] = (array, value)
        return value

    def first_step(
        self, encoder_inputs: Mapping[str, np.ndarray], decoder_input_ids: np.ndarray
    ) -> StepOutput:
        """Run the encoder and the decoder on ``decoder_input_ids``; inputs must be validated."""
        feeds = dict(encoder_inputs)
        feeds[c.DECODER_INPUT_IDS] = decoder_input_ids
        mask = encoder_inputs.get(c.ATTENTION_MASK)
        if not self.has_past:
            logits = self._run([c.LOGITS], feeds)[0]
            return StepOutput(
                logits,
                Cache(
                    attention_mask=mask,
                    tokens=decoder_input_ids,
                    encoder_inputs=dict(encoder_inputs),
                ),
            )
        per_step = self.info.prompt_tokens_per_step
        if per_step and decoder_input_ids.shape[1] > per_step:
            # The decoder with past is exact only for this many new tokens at a time.
            step = self.first_step(encoder_inputs, decoder_input_ids[:, :per_step])
            pieces = [step.logits]
            for start in range(per_step, decoder_input_ids.shape[1], per_step):
                step = self.next_step(decoder_input_ids[:, start : start + per_step], step.cache)
                pieces.append(step.logits)
            return StepOutput(np.concatenate(pieces, axis=1), step.cache)
        rows = decoder_input_ids.shape[0]
        feeds[c.USE_CACHE_BRANCH] = self._false
        if self._has_flag:
            feeds[FLAG] = self._false
        feeds.update(self._empty_past(rows))
        results = self._run(self._first_outputs, feeds)
        n = len(self.present_decoder_names)
        cache = Cache(
            attention_mask=mask,
            decoder=tuple(results[1 : 1 + n]),
            encoder=tuple(results[1 + n :]),
            per_input=self.info.cross_attention_per_input,
        )
        return StepOutput(self._logits(results[0], rows), cache)

    def _logits(self, logits: np.ndarray, rows: int) -> np.ndarray:
        """``[rows, new tokens, vocab]``, a view of ``logits`` where the graph returns them flat."""
        return logits.reshape(rows, -1, logits.shape[-1]) if self.flat_logits else logits

    def next_step(
        self,
        decoder_input_ids: np.ndarray,
        cache: Cache,
        attention_mask: np.ndarray | None = None,
        *,
        greedy: bool = False,
        into: Sequence[np.ndarray] | None = None,
        logits_into: np.ndarray | None = None,
    ) -> StepOutput:
        """Feed new tokens ``[rows, n]`` after the cached prefix.

        ``greedy=True`` (only where ``greedy_head`` is not None) returns the int8 head's logits
        and the head's input as ``hidden``, for :class:`GreedyHead`. ``into`` (where
        ``writes_into`` is True): an array per ``present.*.decoder.*``, of its shape, written
        with it and returned as the new cache's; ``logits_into`` (with ``into``): an array of
        the logits' shape (``[rows * n, vocab]`` where ``flat_logits``), written with them.
        """
        if greedy and self.greedy_head is None:
            raise GenerationError(f"{self.path}: this session has no greedy head")
        mask = attention_mask if attention_mask is not None else cache.attention_mask
        if not self.has_past:
            return self._next_without_past(decoder_input_ids, cache, mask)
        rows = decoder_input_ids.shape[0]
        feeds = self.placeholders(rows)
        if mask is not None and self.has_attention_mask:
            feeds[c.ATTENTION_MASK] = mask
        feeds[c.DECODER_INPUT_IDS] = decoder_input_ids
        feeds[c.USE_CACHE_BRANCH] = self._true
        feeds.update(zip(self.past_decoder_names, cache.decoder, strict=True))
        feeds.update(zip(self.past_encoder_names, cache.encoder, strict=True))
        if self._has_flag:
            feeds[FLAG] = self._true if greedy else self._false
        written = dict(zip(self.present_decoder_names, into, strict=True)) if into else None
        if written is not None and logits_into is not None:
            written[c.LOGITS] = logits_into
            if greedy and self.greedy_head is not None:
                # Every output bound: onnxruntime's own list of them is never built.
                rows_out = int(np.prod(logits_into.shape[:-1]))
                width = self.greedy_head.weight.shape[1]
                written[HIDDEN] = np.empty((rows_out, width), self.greedy_head.weight.dtype)
        results = self._run(
            self._greedy_outputs if greedy else self._next_outputs,
            feeds,
            self._passed_through,
            written,
        )
        layers = len(self.present_decoder_names)
        new_cache = Cache(
            attention_mask=mask,
            decoder=tuple(results[1 : 1 + layers]),
            encoder=cache.encoder,
            per_input=cache.per_input,
        )
        return StepOutput(
            self._logits(results[0], rows), new_cache, results[-1] if greedy else None
        )

    def _next_without_past(
        self, decoder_input_ids: np.ndarray, cache: Cache, mask: np.ndarray | None
    ) -> StepOutput:
        """A step of a model merged without past: the encoder and the whole prefix again."""
        tokens = np.concatenate([cache.tokens, decoder_input_ids], axis=1)
        feeds = dict(cache.encoder_inputs or {})
        if mask is not None:
            feeds[c.ATTENTION_MASK] = mask
        feeds[c.DECODER_INPUT_IDS] = tokens
        logits = self._run([c.LOGITS], feeds)[0]
        new_cache = Cache(attention_mask=mask, tokens=tokens, encoder_inputs=cache.encoder_inputs)
        return StepOutput(logits[:, -decoder_input_ids.shape[1] :], new_cache)
