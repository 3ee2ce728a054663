"""``Seq2SeqModel``: generate with a merged model, the tokens transformers' ``generate()`` gives."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnxmerge import _ort as ort
from onnxmerge import contract as c
from onnxmerge.errors import GenerationError
from onnxmerge.runtime import _corpus as corpus
from onnxmerge.runtime._accelerations import Accelerations
from onnxmerge.runtime._runners import GreedyHeadRunner, Runner
from onnxmerge.runtime._search import (
    Departed,
    GreedyRunner,
    NewIds,
    beam_search,
    beam_search_steps,
    greedy_or_sample,
    greedy_or_sample_steps,
)
from onnxmerge.runtime._session import Cache, MergedSession, StepOutput
from onnxmerge.runtime.processors import build_processors
from onnxmerge.settings import (
    GENERATE_KEYWORDS,
    SCHEMA,
    GenerationSettings,
    encoder_positions,
    resolve_settings,
)

logger = logging.getLogger(__name__)


# A batch of generate_many: its window's size (or 0), its inputs' places in the window, its
# encoder inputs and each input's own ids.
# A batch: its window's size (or 0 before the window's last batch), the window's first input's
# index, its inputs' places in the window, its encoder inputs and each input's own ids.
_Job = tuple[int, int, list[int], dict[str, np.ndarray], list[np.ndarray] | None]


@dataclass(frozen=True)
class _Search:
    """A search ready to run: beam search or not, and the search loop's arguments."""

    beams: bool
    arguments: tuple[Any, ...]  # runner, prompt, settings, processors, rng
    accelerations: Accelerations
    departed: Departed | None = None

    def run(self) -> np.ndarray:
        search = beam_search if self.beams else greedy_or_sample
        return search(*self.arguments, accelerations=self.accelerations, departed=self.departed)

    def greedy_steps(self) -> Generator[NewIds, None, np.ndarray]:
        return greedy_or_sample_steps(*self.arguments, accelerations=self.accelerations)

    def beam_steps(self) -> Generator[NewIds, None, np.ndarray]:
        return beam_search_steps(*self.arguments, accelerations=self.accelerations)


class Seq2SeqModel:
    """A merged encoder-decoder model (see ``docs/format.md``) ready to generate.

    Args:
        path: the merged ``.onnx`` file.
        providers: onnxruntime execution providers (default: CPU).
        session_options: an ``onnxruntime.SessionOptions``; the default enables all graph
            optimizations.
        session_cache: a folder where the first load saves onnxruntime's optimized graph, so
            that later loads skip the graph optimizations (``docs/runtime.md``); default: none.
        threads: onnxruntime's intra-op threads (default: every core), with the default
            session options; with your own, set their ``intra_op_num_threads`` instead.
        accelerations: what the runtime does beyond the plain search, with its thresholds
            (:class:`onnxmerge.runtime.Accelerations`; default: all on, ``docs/runtime.md``);
            ``Accelerations.off()`` runs the plain search. Tokens are the same either way.

    Raises:
        InvalidMergedModelError: the file is not a merged seq2seq model.
        GenerationError: ``threads`` is not a positive integer, or comes with session options
            (an ``InvalidArgumentError``, raised before the file is read).
        InvalidArgumentError: ``accelerations`` is not an ``Accelerations``.
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
        self._adopt(
            MergedSession(
                path,
                providers=providers,
                session_options=session_options,
                session_cache=session_cache,
                threads=threads,
                accelerations=accelerations,
            )
        )

    @classmethod
    def _on(cls, session: MergedSession) -> Seq2SeqModel:
        """A model over an opened session: the benchmarks run OpenVINO through it
        (``benchmarks/_openvino_backend.py``), which is measured slower and heavier than
        onnxruntime and therefore not offered (docs/runtime.md, "Accelerations")."""
        model = cls.__new__(cls)
        model._adopt(session)
        return model

    def _adopt(self, session: MergedSession) -> None:
        self._session = session
        self.path = self._session.path
        self.info = self._session.info
        self.config: dict = dict(self.info.config)
        self.generation_config: dict = dict(self.info.generation_config)
        self._tokenizer = None

    # -- facts ----------------------------------------------------------------------------------

    @property
    def session(self) -> Any:
        """The underlying ``onnxruntime.InferenceSession``."""
        return self._session.session

    @property
    def accelerations(self) -> Accelerations:
        """What this model runs beyond the plain search (given when it was opened)."""
        return self._session.accelerations

    @property
    def encoder_input_names(self) -> tuple[str, ...]:
        """The encoder's inputs, as the file names them (``input_ids``, ``attention_mask``...)."""
        return tuple(self._session.encoder_input_names)

    @property
    def main_input(self) -> str:
        """The encoder input a bare array is (``input_ids``, ``input_features``,
        ``pixel_values``): the first that is not the attention mask."""
        return next(n for n in self.encoder_input_names if n != c.ATTENTION_MASK)

    @property
    def num_layers(self) -> int:
        """Decoder layers: the cache holds a key and a value per layer."""
        return self.info.num_layers

    @property
    def has_past(self) -> bool:
        """Whether the file caches keys and values between steps (exported with past)."""
        return self._session.has_past

    @property
    def precision(self) -> dict[str, str]:
        """The precision of the loaded weights per part, e.g. ``{"encoder": "fp32", "decoder":
        "int8"}``; a file that was not quantized reports its float type for both."""
        if self.info.precision:
            return dict(self.info.precision)
        logits = next(o for o in self.session.get_outputs() if o.name == c.LOGITS)
        as_stored = "fp16" if logits.type == "tensor(float16)" else "fp32"
        return {"encoder": as_stored, "decoder": as_stored}

    @property
    def activation_scale(self) -> str | None:
        """How the int8 and uint8 weights' products scale their input: ``"tensor"`` (one scale
        for the batch) or ``"row"`` (one per row, docs/quantization.md); None where the file has
        no such products (or was quantized before onnxmerge recorded it)."""
        return self.info.activation_scale

    @property
    def model_type(self) -> str | None:
        """The config's ``model_type`` (``"marian"``, ``"t5"``, ``"whisper"``...), if it has one."""
        return self.config.get("model_type")

    # -- inputs ---------------------------------------------------------------------------------

    def _given_inputs(
        self, encoder_inputs: Mapping[str, Any] | np.ndarray | None, named: dict[str, Any]
    ) -> dict[str, Any]:
        """``generate()``'s encoder inputs, given as one mapping, a bare main input or by
        name, in one mapping."""
        if isinstance(encoder_inputs, Mapping) or encoder_inputs is None:
            given = dict(encoder_inputs or {})
        else:
            given = {self.main_input: encoder_inputs}
        overlap = set(given) & set(named)
        if overlap:
            raise GenerationError(f"inputs {sorted(overlap)} passed twice")
        given.update(named)
        if not given:
            raise GenerationError(
                f"no encoder inputs given; this model takes {list(self.encoder_input_names)}"
            )
        return given

    def _check_encoder_inputs(self, given: Mapping[str, Any]) -> dict[str, np.ndarray]:
        names = self.encoder_input_names
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise GenerationError(
                f"unknown inputs {unknown}: this model's encoder takes {list(names)} (and "
                "decoder_input_ids); generation settings are keyword arguments of generate()"
            )
        missing = [n for n in names if n not in given and n != c.ATTENTION_MASK]
        if missing:
            raise GenerationError(
                f"missing encoder inputs {missing}; the model takes {list(names)}"
            )
        checked: dict[str, np.ndarray] = {}
        batch = None
        for name in names:
            if name not in given:
                continue
            value = given[name]
            if not isinstance(value, np.ndarray):
                raise GenerationError(
                    f"{name} must be a numpy array, got {type(value).__name__}; convert it "
                    "with numpy.asarray() (or tokenize with return_tensors='np')"
                )
            spec = self._session.inputs[name]
            checked[name] = _cast(name, value, spec.dtype, len(spec.shape))
            vocab = self.config.get("vocab_size")
            if name == "input_ids" and isinstance(vocab, int) and checked[name].size:
                outside = checked[name][(checked[name] < 0) | (checked[name] >= vocab)]
                if outside.size:
                    raise GenerationError(
                        f"input_ids holds {int(outside[0])}, outside the vocabulary 0..{vocab - 1}"
                    )
            rows = value.shape[0]
            if batch is not None and rows != batch:
                raise GenerationError(
                    f"encoder inputs disagree on the batch size: {name} has {rows} rows, "
                    f"others {batch}"
                )
            batch = rows
        if batch == 0:
            raise GenerationError("encoder inputs have no rows")
        self._check_lengths(checked)
        return checked

    def _check_lengths(self, inputs: dict[str, np.ndarray]) -> None:
        """Refuse lengths the graph cannot run, before onnxruntime fails on them."""
        ids, mask = inputs.get("input_ids"), inputs.get(c.ATTENTION_MASK)
        if ids is not None and ids.shape[1] == 0:
            raise GenerationError(
                f"input_ids is empty (shape {tuple(ids.shape)}); give every row at least one "
                "token, e.g. the eos token"
            )
        positions = encoder_positions(self.config)
        if ids is not None and positions is not None and ids.shape[1] > positions:
            raise GenerationError(
                f"input_ids has {ids.shape[1]} tokens, more than the model's {positions} "
                "positions; shorten or split the input"
            )
        if ids is not None and mask is not None and mask.shape != ids.shape:
            raise GenerationError(
                f"attention_mask has shape {tuple(mask.shape)} but input_ids has "
                f"{tuple(ids.shape)}; give one mask value per token"
            )
        features = inputs.get("input_features")
        if features is not None and self.model_type == "whisper":
            expected = (
                self.config.get("num_mel_bins"),
                2 * self.config["max_source_positions"]
                if "max_source_positions" in self.config
                else None,
            )
            if any(
                e is not None and e != got
                for e, got in zip(expected, features.shape[1:], strict=True)
            ):
                raise GenerationError(
                    f"input_features has shape {tuple(features.shape)}, but this model takes "
                    f"[batch, {expected[0]}, {expected[1]}] (mel bins, frames); compute them "
                    "with the model's feature extractor, padded to its frame count"
                )

    def _default_attention_mask(
        self, inputs: dict[str, np.ndarray], settings_pad: int | None, eos: list[int] | None
    ) -> None:
        if not self._session.has_attention_mask or c.ATTENTION_MASK in inputs:
            return
        ids = inputs.get("input_ids")
        if ids is None:
            first = next(iter(inputs.values()))
            inputs[c.ATTENTION_MASK] = np.ones(first.shape[:2], dtype=np.int64)
            return
        # transformers infers the mask from padding when pad is in the inputs and is not eos.
        infer = (
            settings_pad is not None
            and bool((ids == settings_pad).any())
            and (eos is None or settings_pad not in eos)
        )
        inputs[c.ATTENTION_MASK] = (
            (ids != settings_pad).astype(np.int64) if infer else np.ones(ids.shape, np.int64)
        )

    def _prompt(self, decoder_input_ids: Any, batch: int, start: int) -> np.ndarray:
        if decoder_input_ids is None:
            return np.full((batch, 1), start, dtype=np.int64)
        if not isinstance(decoder_input_ids, np.ndarray):
            raise GenerationError(
                f"decoder_input_ids must be a numpy array, got {type(decoder_input_ids).__name__}"
            )
        ids = _decoder_ids(decoder_input_ids, batch)
        if self.model_type != "whisper" and bool((ids[:, 0] != start).all()):
            ids = np.concatenate([np.full((batch, 1), start, dtype=np.int64), ids], axis=1)
        return ids

    # -- generation -----------------------------------------------------------------------------

    def resolve_settings(self, prompt_length: int = 1, **overrides: Any) -> GenerationSettings:
        """The settings ``generate()`` would use, with the model's defaults filled in."""
        return resolve_settings(self.config, self.generation_config, overrides, prompt_length)

    def generate(
        self,
        encoder_inputs: Mapping[str, np.ndarray] | np.ndarray | None = None,
        /,
        *,
        decoder_input_ids: np.ndarray | None = None,
        seed: int | None = None,
        **keywords: Any,
    ) -> np.ndarray:
        """Generate token ids, as transformers' ``generate()`` does for encoder-decoder models.

        Encoder inputs are numpy arrays passed by name (``input_ids=..., attention_mask=...``,
        or ``input_features=...`` for Whisper), or as one mapping; the main one (``input_ids``,
        ``input_features``) may also come alone as the first argument, as transformers takes it.
        Other keywords are the settings of ``onnxmerge.settings.GENERATE_KEYWORDS``
        (``max_new_tokens``, ``num_beams``, ``do_sample``, ...); those left at None take the
        model's generation config, then transformers' defaults. Returns an int64 array
        ``[batch * num_return_sequences, length]`` starting with the decoder start token; rows
        that finished early are padded like transformers pads them.

        Whisper features longer than one window (3,000 frames), or ``return_timestamps=True``,
        are decoded in windows as transformers' Whisper ``generate()`` does it, and return what
        it returns (``docs/runtime.md``, "Long-form speech").

        Raises:
            GenerationError: invalid inputs or settings.
        """
        if self.model_type == "whisper":  # imported for speech alone
            from onnxmerge.runtime import _longform

            if _longform.applies(self, encoder_inputs, keywords):
                # A dict only with return_segments=True: the contract most callers rely on
                # stays.
                return _longform.generate(  # type: ignore[return-value]
                    self, encoder_inputs, decoder_input_ids, seed, keywords
                )
        return self._generate(encoder_inputs, decoder_input_ids, seed, keywords)

    def stream(
        self,
        encoder_inputs: Mapping[str, np.ndarray] | np.ndarray | None = None,
        /,
        *,
        decoder_input_ids: np.ndarray | None = None,
        seed: int | None = None,
        **keywords: Any,
    ) -> Generator[dict[int, np.ndarray], None, None]:
        """``generate()`` one step at a time: yields the new ids of each step as it ends.

        Takes ``generate()``'s arguments. Each yield maps output rows (as ``generate()``
        numbers them) to their new ids, a 1-D int64 array: in greedy search and sampling one
        id per row still running, after every step, before the next runs; in beam search a
        row's whole generated hypothesis once it is final (hypotheses change until then), the
        rows of an input together. A row's ids joined are ``generate()``'s row after the
        prompt, up to its padding. Nothing runs until the first id is asked for; leaving the
        loop (``break``, ``close()``) runs no further step.

        Raises:
            GenerationError: invalid inputs or settings, when the first id is asked for.
        """
        search = self._search(encoder_inputs, decoder_input_ids, seed, keywords)
        steps = search.beam_steps() if search.beams else search.greedy_steps()
        try:
            for rows, ids in steps:
                yield {int(row): row_ids for row, row_ids in zip(rows, ids, strict=True)}
        finally:
            steps.close()  # at its last yield: no step runs after it

    def _generate(
        self,
        encoder_inputs: Mapping[str, np.ndarray] | np.ndarray | None,
        decoder_input_ids: np.ndarray | None,
        seed: int | None,
        keywords: dict[str, Any],
        stop: threading.Event | None = None,
        encoder_rows: list[np.ndarray] | None = None,
        departed: Departed | None = None,
    ) -> np.ndarray:
        """``generate()``, ending between steps with ``corpus.Stopped`` once ``stop`` is set.
        ``encoder_rows``: each row's ``input_ids`` as the encoder-side processors see them (a
        padded batch's rows without the padding); by default the ``input_ids`` given.
        ``departed``: which inputs nobody waits for any more, a bool each, asked between
        steps; their rows end there."""
        search = self._search(encoder_inputs, decoder_input_ids, seed, keywords, stop, encoder_rows)
        rows = departed
        repeat = search.arguments[2].num_return_sequences
        if departed is not None and not search.beams and repeat > 1:
            # Greedy search and sampling run num_return_sequences rows per input.
            rows = lambda: np.repeat(departed(), repeat)  # noqa: E731
        return dataclasses.replace(search, departed=rows).run()

    def _search(
        self,
        encoder_inputs: Mapping[str, np.ndarray] | np.ndarray | None,
        decoder_input_ids: np.ndarray | None,
        seed: int | None,
        keywords: dict[str, Any],
        stop: threading.Event | None = None,
        encoder_rows: list[np.ndarray] | None = None,
    ) -> _Search:
        """The search ``generate()`` runs: checked inputs, settings, processors, runner."""
        overrides = {k: v for k, v in keywords.items() if k in GENERATE_KEYWORDS}
        named_inputs = {k: v for k, v in keywords.items() if k not in GENERATE_KEYWORDS}
        inputs = self._check_encoder_inputs(self._given_inputs(encoder_inputs, named_inputs))
        batch = next(iter(inputs.values())).shape[0]
        # The prompt's length decides max_length; resolve the start token first.
        try:
            start = resolve_settings(self.config, self.generation_config, overrides, 1)
        except GenerationError:
            if decoder_input_ids is None:
                raise
            # The configs name no start token: the prompt's first token is the one asked for.
            first = int(np.asarray(decoder_input_ids).flat[0])
            overrides = {**overrides, "decoder_start_token_id": first}
            start = resolve_settings(self.config, self.generation_config, overrides, 1)
        prompt = self._prompt(decoder_input_ids, batch, start.decoder_start_token_id)
        settings = resolve_settings(self.config, self.generation_config, overrides, prompt.shape[1])
        self._default_attention_mask(inputs, settings.pad_token_id, settings.eos_token_id)
        processors = build_processors(
            settings, encoder_rows if encoder_rows is not None else inputs.get("input_ids")
        )
        rng = np.random.default_rng(seed)
        if settings.num_beams > 1:
            runner = Runner(self._session, inputs, prompt, settings.max_length, stop)
            return _Search(True, (runner, prompt, settings, processors, rng), self.accelerations)
        if settings.num_return_sequences > 1:
            repeat = settings.num_return_sequences
            inputs = {k: np.repeat(v, repeat, axis=0) for k, v in inputs.items()}
            prompt = np.repeat(prompt, repeat, axis=0)
        # Greedy search needs only each row's largest score: the session's int8 head bounds
        # the rest, where the processors keep bounds bounds.
        greedy = self._greedy_runner(
            inputs,
            prompt,
            settings.max_length,
            bounded=not settings.do_sample and processors.keeps_bounds,
            stop=stop,
        )
        return _Search(False, (greedy, prompt, settings, processors, rng), self.accelerations)

    def _greedy_runner(
        self,
        inputs: dict[str, np.ndarray],
        prompt: np.ndarray,
        max_length: int,
        *,
        bounded: bool,
        stop: threading.Event | None = None,
    ) -> GreedyRunner:
        """A runner over checked encoder ``inputs`` whose cached steps go through the session's
        int8 head where there is one and the caller's processors allow it (``bounded``)."""
        head = self._session.greedy_head if bounded else None
        if head is not None:
            return GreedyHeadRunner(self._session, inputs, prompt, max_length, head, stop)
        return Runner(self._session, inputs, prompt, max_length, stop)

    def generate_many(
        self,
        inputs: Iterable[np.ndarray | Sequence[int] | Mapping[str, np.ndarray]],
        *,
        max_batch_size: int = 32,
        batch_type: str = "examples",
        parallel_batches: int = 1,
        abandoned: Callable[[int], bool] | None = None,
        **generate_kwargs: Any,
    ) -> Generator[np.ndarray, None, None]:
        """Generate for many inputs in length-sorted batches; one result per input, in order.

        Each input is one example: a 1-D array of ids (the main encoder input), or a mapping of
        encoder input names to arrays without the batch axis (``input_features`` for Whisper,
        ``pixel_values`` for vision; an ``attention_mask`` may come with ``input_ids``). A
        window of inputs is read ahead, sorted by length and cut into batches of at most
        ``max_batch_size`` inputs (``batch_type="examples"``) or of at most ``max_batch_size``
        source tokens counting padding (``"tokens"``; an input longer than that goes alone), as
        CTranslate2's ``translate_batch`` does. Ids are padded on the right with the pad token;
        a model without an attention mask only batches inputs of one shape. Each result is what
        ``generate()`` returns for that input alone (``[num_return_sequences, length]``), up to
        the float rounding of a padded batch (``docs/runtime.md``); sampling draws depend on the
        batch. ``generate_kwargs`` are ``generate()``'s settings.

        ``parallel_batches`` batches run at once, each on a thread of its own over this
        model's session, as with CTranslate2's ``inter_threads``; by ``"examples"`` a window
        is cut into a multiple of ``parallel_batches`` batches of even sizes, so that none runs
        alone at its end. They share the session's
        intra-op pool, which has ``threads - 1`` threads besides each caller: open the model
        with ``threads`` at the cores minus ``parallel_batches``, plus one, or the threads
        compete for the cores (a warning is logged). Leaving the loop early (an error,
        ``close()``, Ctrl-C) ends the batches already running at their next step.

        ``abandoned(index)`` is asked between steps for each input of a running batch (its
        index in ``inputs``): an input nobody waits for any more (a server's client that left)
        ends there, and its rows leave the batch at the next step, as rows that reached eos
        do; its result is what it had generated by then, padded. Under sampling, or where a
        processor keeps state by row, they run on until every input of the batch is abandoned.

        Raises:
            GenerationError: invalid options, at the call; or an invalid input, as its window
                is read (its index is in the message; the results of the inputs before its
                window have been yielded by then).
        """
        corpus.check_batching(max_batch_size, batch_type, parallel_batches)
        unknown = sorted(set(generate_kwargs) - set(GENERATE_KEYWORDS) - {"seed"})
        if unknown:
            raise GenerationError(
                f"generate_many() takes generate()'s settings, not {unknown}: give encoder "
                "inputs as the items of `inputs`; a decoder prompt per input is not supported",
                argument=unknown[0],
            )
        settings = self.resolve_settings(
            **{k: v for k, v in generate_kwargs.items() if k in GENERATE_KEYWORDS}
        )
        if parallel_batches > 1:
            self._warn_unless_threads_divided(parallel_batches)
        if abandoned is not None and not callable(abandoned):
            raise GenerationError(
                f"abandoned must be a function of an input's index, got {type(abandoned).__name__}",
                argument="abandoned",
            )
        batching = (max_batch_size, batch_type, parallel_batches)
        return self._many(inputs, settings, batching, generate_kwargs, abandoned)

    def _many(
        self,
        inputs: Iterable[Any],
        settings: GenerationSettings,
        batching: tuple[int, str, int],
        generate_kwargs: dict[str, Any],
        abandoned: Callable[[int], bool] | None,
    ) -> Generator[np.ndarray, None, None]:
        """``generate_many`` once its options are checked: a generator, so nothing runs until
        the first result is asked for."""
        examples = (self._one_example(index, item, settings) for index, item in enumerate(inputs))
        jobs_in = self._batches(examples, settings, *batching)
        stop = threading.Event()
        seed = generate_kwargs.get("seed")
        keywords = {k: v for k, v in generate_kwargs.items() if k != "seed"}

        def run(job: _Job) -> tuple[int, list[int], np.ndarray]:
            window_size, start, batch, fed, own_ids = job
            departed = None
            if abandoned is not None:
                indices = [start + i for i in batch]
                departed = lambda: np.array([abandoned(i) for i in indices], dtype=bool)  # noqa: E731
            out = self._generate(fed, None, seed, keywords, stop, own_ids, departed)
            return window_size, batch, out

        results: dict[int, np.ndarray] = {}
        jobs = corpus.ordered_map(run, jobs_in, batching[2], stop)
        try:
            for window_size, batch, out in jobs:
                per_input = out.shape[0] // len(batch)
                for row, i in enumerate(batch):
                    group = out[row * per_input : (row + 1) * per_input]
                    length = corpus.own_length(group, 1, settings.eos_token_id)
                    results[i] = np.ascontiguousarray(group[:, :length])
                if window_size:
                    yield from (results.pop(i) for i in range(window_size))
        finally:  # leaving early stops the batches running now, not when jobs is collected
            jobs.close()

    def _batches(
        self,
        examples: Iterator[dict[str, np.ndarray]],
        settings: GenerationSettings,
        max_batch_size: int,
        batch_type: str,
        parallel_batches: int,
    ) -> Iterator[_Job]:
        """Each batch as (its window's size, or 0 before the window's last, the index of the
        window's first input, its inputs' places in the window, its encoder inputs, each
        input's own ids for the encoder-side processors, which would count the padding as
        tokens)."""
        pad = settings.pad_token_id if settings.pad_token_id is not None else 0
        main = self.main_input
        start = 0
        for window in corpus.windows(
            examples, lambda ex: ex[main].shape[-1], max_batch_size, batch_type
        ):
            lengths = [ex[main].shape[-1] for ex in window]
            keys = [self._batch_key(ex) for ex in window]
            cut = corpus.cut_batches(lengths, keys, max_batch_size, batch_type, parallel_batches)
            for number, batch in enumerate(cut):
                rows = [window[i] for i in batch]
                fed = {
                    name: corpus.pad_right(
                        [r[name] for r in rows], 0 if name == c.ATTENTION_MASK else pad
                    )
                    if self._paddable(name)
                    else np.concatenate([r[name] for r in rows])
                    for name in rows[0]
                }
                own_ids = [r["input_ids"][0] for r in rows] if "input_ids" in fed else None
                yield (len(window) if number == len(cut) - 1 else 0), start, batch, fed, own_ids
            start += len(window)

    def _warn_unless_threads_divided(self, parallel_batches: int) -> None:
        """Batches at once with more threads than cores run slower than one batch at a time
        (``docs/runtime.md``): each runs on its caller's thread, and all of them share the
        session's pool of ``intra_op_num_threads - 1`` threads (0: one per core)."""
        try:
            threads = self.session.get_session_options().intra_op_num_threads
        except AttributeError:  # not onnxruntime's session
            return
        cores = ort.cores()
        used = parallel_batches + (threads or cores) - 1
        if used > cores:
            advice = (
                f"run at most {cores} batches at once"
                if parallel_batches > cores
                else f"open the model with threads={ort.shared_pool_threads(parallel_batches)}"
            )
            logger.warning(
                "%s: %d batches at once and a pool of %d intra-op threads make %d threads on "
                "%d cores: they compete; %s",
                self.path,
                parallel_batches,
                (threads or cores) - 1,
                used,
                cores,
                advice,
            )

    def _paddable(self, name: str) -> bool:
        """Whether inputs of different lengths may share a batch through padding."""
        return self._session.has_attention_mask and name in ("input_ids", c.ATTENTION_MASK)

    def _batch_key(self, example: dict[str, np.ndarray]) -> tuple:
        """Examples with equal keys can share a batch: the shapes padding cannot even out."""
        return tuple(
            (name, value.shape) for name, value in example.items() if not self._paddable(name)
        )

    def _one_example(
        self, index: int, item: Any, settings: GenerationSettings
    ) -> dict[str, np.ndarray]:
        """One input of ``generate_many`` as a checked batch of one, with the attention mask
        ``generate()`` would give it alone."""
        try:
            if isinstance(item, Mapping):
                given = dict(item)
            elif isinstance(item, (str, bytes)):
                raise GenerationError(
                    f"got text ({type(item).__name__}); tokenize it first, or call translate()"
                )
            else:
                given = {self.main_input: item}
            batched = {}
            for name, value in given.items():
                spec = self._session.inputs.get(name)
                given_array = isinstance(value, np.ndarray)
                # A copy: the window runs later, and a caller may refill its array meanwhile.
                value = np.array(value)
                if not given_array and not value.size and spec is not None:  # [] is float64
                    value = value.astype(spec.dtype)
                rank = len(spec.shape) if spec is not None else value.ndim + 1
                if value.ndim == rank - 1:
                    value = value[None]
                elif value.ndim != rank or value.shape[0] != 1:
                    raise GenerationError(
                        f"{name} has shape {tuple(value.shape)}; give one example, "
                        f"{rank - 1} dimensions without the batch axis"
                    )
                batched[name] = value
            example = self._check_encoder_inputs(batched)
            self._default_attention_mask(example, settings.pad_token_id, settings.eos_token_id)
            return example
        except GenerationError as error:
            raise GenerationError(f"input {index}: {error}") from error

    # -- step API -------------------------------------------------------------------------------

    def first_step(
        self,
        encoder_inputs: Mapping[str, np.ndarray],
        decoder_input_ids: np.ndarray,
    ) -> StepOutput:
        """Run encoder and decoder on a prompt; ``logits`` is ``[rows, prompt_len, vocab]``."""
        inputs = self._step_inputs(encoder_inputs)
        batch = next(iter(inputs.values())).shape[0]
        ids = _decoder_ids(np.asarray(decoder_input_ids), batch)
        return self._session.first_step(inputs, ids)

    def _step_inputs(self, encoder_inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Checked encoder inputs, with an attention mask of ones where the session takes one
        and none is given."""
        inputs = self._check_encoder_inputs(dict(encoder_inputs))
        if self._session.has_attention_mask and c.ATTENTION_MASK not in inputs:
            first = next(iter(inputs.values()))
            inputs[c.ATTENTION_MASK] = np.ones(first.shape[:2], dtype=np.int64)
        return inputs

    def next_step(
        self,
        decoder_input_ids: np.ndarray,
        cache: Cache,
        attention_mask: np.ndarray | None = None,
    ) -> StepOutput:
        """Feed ``decoder_input_ids`` ``[rows, n]`` after the prefix held by ``cache``.

        ``attention_mask`` is the encoder's mask, by default the one the cache carries.
        """
        if not isinstance(cache, Cache):
            raise GenerationError("next_step() needs the cache of a previous step")
        ids = _cast(c.DECODER_INPUT_IDS, np.asarray(decoder_input_ids), np.int64, 2)
        if ids.shape[0] != cache.rows:
            raise GenerationError(
                f"decoder_input_ids has {ids.shape[0]} rows but the cache has {cache.rows}"
            )
        if attention_mask is not None:
            attention_mask = _cast(c.ATTENTION_MASK, np.asarray(attention_mask), np.int64, 2)
        return self._session.next_step(ids, cache, attention_mask)

    # -- text -----------------------------------------------------------------------------------

    def translate(
        self,
        texts: str | Sequence[str],
        tokenizer: Any | None = None,
        **generate_kwargs: Any,
    ) -> list[str] | str:
        """Tokenize ``texts``, generate in length-sorted batches (``max_batch_size=``,
        ``batch_type=`` as for :meth:`generate_many`), decode; see
        :class:`onnxmerge.runtime.TextGenerator`."""
        from onnxmerge.runtime._text import TextGenerator

        if tokenizer is None and self._tokenizer is None:
            self._tokenizer = TextGenerator.load_tokenizer(self.path.parent)
        generator = TextGenerator(self, tokenizer if tokenizer is not None else self._tokenizer)
        return generator(texts, **generate_kwargs)

    def __repr__(self) -> str:
        return (
            f"Seq2SeqModel({str(self.path)!r}, model_type={self.model_type!r}, "
            f"layers={self.num_layers}, layout={self.info.layout!r})"
        )


def _generate_signature() -> inspect.Signature:
    """generate()'s signature as callers see it: every setting of the schema by name (help(),
    editors and the docs' signature check read it), encoder inputs by name after them."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    written = inspect.signature(Seq2SeqModel.generate).parameters
    names = [name for name in SCHEMA if name in GENERATE_KEYWORDS]
    settings = [inspect.Parameter(name, keyword, default=None) for name in names]
    return inspect.Signature(
        [*(p for p in written.values() if p.kind != p.VAR_KEYWORD), *settings, written["keywords"]]
    )


Seq2SeqModel.generate.__signature__ = _generate_signature()  # type: ignore[attr-defined]


def _decoder_ids(value: np.ndarray, batch: int) -> np.ndarray:
    """``decoder_input_ids`` as int64 ``[batch, length]``; refuses another kind of number, rank
    or row count, and a prompt without a token."""
    ids = _cast(c.DECODER_INPUT_IDS, value, np.int64, 2)
    if ids.shape[0] != batch:
        raise GenerationError(
            f"decoder_input_ids has {ids.shape[0]} rows but the encoder inputs have {batch}"
        )
    if ids.shape[1] == 0:
        raise GenerationError(
            "decoder_input_ids is empty; give at least the decoder start token (generate() "
            "starts from it where no decoder_input_ids is given)"
        )
    return ids


def _cast(name: str, value: np.ndarray, dtype: type, rank: int) -> np.ndarray:
    """``value`` as a contiguous array of ``dtype``; refuse a wrong kind of number or rank."""
    if value.ndim != rank:
        raise GenerationError(f"{name} must have {rank} dimensions, got shape {tuple(value.shape)}")
    want_int = np.issubdtype(dtype, np.integer)
    if want_int and not np.issubdtype(value.dtype, np.integer):
        raise GenerationError(f"{name} must hold integers (int64), got {value.dtype}")
    if not want_int and not np.issubdtype(value.dtype, np.floating):
        raise GenerationError(
            f"{name} must hold floats ({np.dtype(dtype).name}), got {value.dtype}"
        )
    return np.ascontiguousarray(value, dtype=dtype)


__all__ = ["Seq2SeqModel", "Cache", "StepOutput"]
