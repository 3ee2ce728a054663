"""transformers models over a merged file: ``generate()``, ``pipeline()`` and the rest of
``GenerationMixin`` drive the merged file's steps.

The merged file runs the encoder inside its first step, so there is no encoder to run before
the decoder. ``get_encoder()`` returns :class:`_InputsEncoder`, which only keeps the encoder's
inputs and numbers the rows; ``GenerationMixin`` repeats those numbers for beams and returned
sequences, and the first ``forward`` reads from them how the inputs were repeated: it runs
``first_step`` once per input and expands its cache, as ``Seq2SeqModel.generate`` does. Later
``forward`` calls run ``next_step`` with the :class:`MergedCache` of the step before.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import transformers
from transformers.modeling_outputs import Seq2SeqLMOutput
from transformers.utils import ModelOutput

from onnxmerge import contract as c
from onnxmerge.errors import InvalidArgumentError
from onnxmerge.runtime import Seq2SeqModel, StepOutput
from onnxmerge.settings import GENERATE_KEYWORDS, UNSUPPORTED_OFF_VALUES
from onnxmerge.transformers._cache import MergedCache


@dataclass
class MergedEncoderOutput(ModelOutput):
    """What the light encoder returns: ``rows`` (int64 ``[rows]``) numbers the inputs, and
    ``GenerationMixin`` repeats it with every tensor of the encoder's output; ``inputs`` (numpy,
    one row per input) is not a tensor, so it stays as it was given."""

    rows: torch.Tensor | None = None
    inputs: dict[str, np.ndarray] | None = None


class _InputsEncoder(torch.nn.Module):
    """The encoder ``GenerationMixin`` calls before the first step: it keeps the inputs for the
    merged file's first step, which runs the real encoder."""

    def __init__(self, names: Sequence[str], main_input_name: str):
        super().__init__()
        self.names = tuple(names)
        self.main_input_name = main_input_name

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        input_features: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> MergedEncoderOutput:
        # Named, so that generate() knows them as inputs of this model.
        kwargs.update(
            input_ids=input_ids,
            attention_mask=attention_mask,
            input_features=input_features,
            pixel_values=pixel_values,
        )
        inputs = {
            name: kwargs[name].detach().cpu().numpy()
            for name in self.names
            if isinstance(kwargs.get(name), torch.Tensor)
        }
        if self.main_input_name not in inputs:
            raise InvalidArgumentError(
                f"the merged model's encoder needs {self.main_input_name}",
                argument=self.main_input_name,
            )
        rows = len(inputs[self.main_input_name])
        return MergedEncoderOutput(rows=torch.arange(rows), inputs=inputs)


# type: ignore: the two bases type generation_config differently, in transformers itself.
class _MergedModel(transformers.PreTrainedModel, transformers.GenerationMixin):  # type: ignore[misc]
    """A merged file (``docs/format.md``) as a transformers model that generates."""

    config_class = transformers.PretrainedConfig
    base_model_prefix = "merged"
    main_input_name = "input_ids"
    _is_stateful = False

    def __init__(self, merged: Seq2SeqModel, *, runtime_search: bool = True):
        super().__init__(_config(merged))
        self.merged = merged
        self.runtime_search = runtime_search
        if merged.generation_config:
            generation = transformers.GenerationConfig.from_dict(dict(merged.generation_config))
            # As GenerationConfig.from_pretrained marks it: generate() then tells the settings
            # of the file from those changed on the model since.
            generation._original_object_hash = hash(generation)  # type: ignore[attr-defined]
            self.generation_config = generation
        names = merged.encoder_input_names
        main = self.main_input_name if self.main_input_name in names else names[0]
        self.encoder = _InputsEncoder(names, main)
        self.eval()

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        providers: Sequence[Any] | None = None,
        session_options: Any | None = None,
        session_cache: str | os.PathLike | None = None,
        threads: int | None = None,
        runtime_search: bool = True,
    ) -> _MergedModel:
        """Load a merged file, or the folder holding it as ``model.onnx``.

        Args:
            pretrained_model_name_or_path: the merged ``.onnx`` file, or its folder.
            providers, session_options, session_cache, threads: as for
                :class:`onnxmerge.runtime.Seq2SeqModel`.
            runtime_search: a text model's ``generate()`` runs the runtime's own search where
                the call asks for nothing beyond it (the same ids; see ``docs/transformers.md``);
                False: ``GenerationMixin`` always drives the steps.

        Returns:
            The model, in eval mode, its ``config`` and ``generation_config`` those of the file.

        Raises:
            InvalidArgumentError: the path is neither a file nor a folder with ``model.onnx``.
            InvalidMergedModelError: the file is not a merged seq2seq model.
        """
        path = Path(pretrained_model_name_or_path)
        if path.is_dir():
            path = path / "model.onnx"
        if not path.is_file():
            raise InvalidArgumentError(
                f"{pretrained_model_name_or_path}: no merged model there; give the merged .onnx "
                "file or the folder holding it as model.onnx",
                argument="pretrained_model_name_or_path",
            )
        merged = Seq2SeqModel(
            path,
            providers=providers,
            session_options=session_options,
            session_cache=session_cache,
            threads=threads,
        )
        return cls(merged, runtime_search=runtime_search)

    # No parameters: the weights are in the merged file, run on the CPU by onnxruntime's
    # providers, and the logits come back as float32 or float16 arrays.
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def save_pretrained(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the model is the merged file, which a copy saves whole; transformers' saving
        would write a config and no weights."""
        raise NotImplementedError(
            f"a merged model is saved by copying its file, {self.merged.path}, with the "
            "tokenizer's files beside it"
        )

    def get_encoder(self) -> torch.nn.Module:
        return self.encoder

    def _prepare_cache_for_generation(
        self,
        generation_config: Any,
        model_kwargs: dict,
        generation_mode: Any,
        batch_size: int,
        max_cache_length: int,
    ) -> bool:
        """The first step makes the cache; there is none to prepare."""
        return False

    def forward(
        self,
        decoder_input_ids: torch.Tensor | None = None,
        encoder_outputs: MergedEncoderOutput | None = None,
        past_key_values: MergedCache | None = None,
        **kwargs: Any,
    ) -> Seq2SeqLMOutput:
        """One step of the merged file: the first without ``past_key_values``, else the next."""
        if decoder_input_ids is None:
            raise InvalidArgumentError(
                "forward() needs decoder_input_ids", argument="decoder_input_ids"
            )
        ids = decoder_input_ids.detach().cpu().numpy().astype(np.int64, copy=False)
        if isinstance(past_key_values, MergedCache):
            step = self.merged.next_step(ids, past_key_values.merged)
        else:
            step = self._first_step(ids, encoder_outputs, kwargs)
        cache = None
        if kwargs.get("use_cache", True):
            cache = MergedCache(step.cache, self.merged.num_layers)
        logits: Any = torch.from_numpy(step.logits)
        return Seq2SeqLMOutput(logits=logits, past_key_values=cast(Any, cache))

    def _first_step(
        self, ids: np.ndarray, encoder_outputs: Any, kwargs: Mapping[str, Any]
    ) -> StepOutput:
        """``first_step`` once per input, its rows then repeated as ``encoder_outputs.rows``
        says (beams, returned sequences)."""
        if encoder_outputs is None:
            encoder_outputs = self.encoder(**kwargs)
        if (
            not isinstance(encoder_outputs, MergedEncoderOutput)
            or encoder_outputs.inputs is None
            or encoder_outputs.rows is None
        ):
            raise InvalidArgumentError(
                "encoder_outputs must come from this model's get_encoder(); the merged file "
                "runs its own encoder",
                argument="encoder_outputs",
            )
        rows = encoder_outputs.rows.cpu().numpy()
        inputs = encoder_outputs.inputs
        repeats = len(rows) // max(1, len(next(iter(inputs.values()))))
        if repeats and np.array_equal(rows, np.repeat(np.arange(len(rows) // repeats), repeats)):
            step = self.merged.first_step(inputs, ids[::repeats])
            if repeats == 1:
                return step
            logits = np.repeat(step.logits, repeats, axis=0)
            return StepOutput(logits=logits, cache=step.cache.expand(repeats))
        taken = {name: np.take(value, rows, axis=0) for name, value in inputs.items()}
        return self.merged.first_step(taken, ids)


class MergedModelForSeq2SeqLM(_MergedModel):
    """A merged text-to-text model (marian, bart, t5, m2m100, ...) for ``generate()`` and
    ``pipeline("translation" | "summarization" | "text2text-generation")``.

    ``generate()`` runs the runtime's own search (:meth:`Seq2SeqModel.generate`, the same ids)
    when the call asks for nothing beyond it: ids in, ids out, settings the runtime has, no
    sampling (whose draws are torch's here), no processor, criterion, streamer or scores of the
    caller's. Anything else, or ``runtime_search=False``, goes through ``GenerationMixin``.

    Example:
        >>> model = MergedModelForSeq2SeqLM.from_pretrained("opus-mt-fr-en-onnx/")  # doctest: +SKIP
    """

    main_input_name = "input_ids"

    def generate(  # type: ignore[override]
        self,
        inputs: torch.Tensor | None = None,
        generation_config: transformers.GenerationConfig | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers' ``generate()``; see the class for when the runtime's search runs it."""
        ids = (
            self._runtime_generate(inputs, generation_config, kwargs)
            if self.runtime_search
            else None
        )
        if ids is not None:
            return ids
        return super().generate(inputs, generation_config, **kwargs)

    def _runtime_generate(
        self,
        inputs: torch.Tensor | None,
        generation_config: transformers.GenerationConfig | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor | None:
        """The ids of the runtime's search for this call, or None where only
        ``GenerationMixin`` does what it asks."""
        if any(_given(kwargs.get(name)) for name in _MIXIN_ONLY):
            return None
        settings = {
            k: v for k, v in kwargs.items() if k not in _MIXIN_ONLY and k != "use_model_defaults"
        }
        try:
            config, model_kwargs = self._prepare_generation_config(
                generation_config, kwargs.get("use_model_defaults"), **settings
            )
        except (TypeError, ValueError, AttributeError):  # another transformers: its own loop
            return None
        if inputs is not None:
            if "input_ids" in model_kwargs:
                return None
            model_kwargs["input_ids"] = inputs
        overrides = _runtime_settings(config)
        if overrides is None or not set(model_kwargs) <= {"input_ids", "attention_mask"}:
            return None
        if "max_length" not in kwargs and config.max_length == _DEFAULTS["max_length"]:
            # transformers' default length, 20 new tokens after the prompt: the runtime's too.
            overrides.pop("max_length", None)
        given = {name: model_kwargs.get(name) for name in ("input_ids", "attention_mask")}
        if not isinstance(given["input_ids"], torch.Tensor) or any(
            value is not None and not isinstance(value, torch.Tensor) for value in given.values()
        ):
            return None
        arrays = {k: v.detach().cpu().numpy() for k, v in given.items() if v is not None}
        return torch.from_numpy(self.merged.generate(**arrays, **overrides))


class MergedModelForSpeechSeq2Seq(_MergedModel):
    """A merged speech-to-text model (whisper) for ``generate(input_features=...)`` and
    ``pipeline("automatic-speech-recognition")``: transformers' generic ``generate()``, up to 30 s
    of audio (no long-form decoding, no timestamps)."""

    main_input_name = "input_features"


# generate()'s arguments that only GenerationMixin takes (a caller's objects, other loops).
_MIXIN_ONLY = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "assistant_tokenizer",
    "tokenizer",
    "trust_remote_code",
)
# transformers' defaults, and the settings the runtime reads as transformers does.
_DEFAULTS = transformers.GenerationConfig().to_dict()
_RUNTIME_SETTINGS = GENERATE_KEYWORDS - set(UNSUPPORTED_OFF_VALUES)
# GenerationConfig fields that change no id and are not the runtime's settings.
_NEUTRAL = frozenset({"transformers_version", "bos_token_id", "use_cache"})


def _given(value: Any) -> bool:
    """Whether a ``generate()`` argument was given: not None, nor an empty list."""
    return value is not None and not (isinstance(value, (list, tuple)) and not value)


def _runtime_settings(config: transformers.GenerationConfig) -> dict[str, Any] | None:
    """``generate()``'s keywords of the runtime for transformers' final ``config``; None where
    the config asks for something the runtime does not do as transformers does: a setting it
    lacks, a field off its default that it does not read, or sampling (torch's draws)."""
    if config.do_sample:
        return None
    overrides = {}
    for name, value in config.to_dict().items():
        if name in _RUNTIME_SETTINGS:
            if value is not None:
                overrides[name] = value
        elif name in UNSUPPORTED_OFF_VALUES:
            if value not in UNSUPPORTED_OFF_VALUES[name]:
                return None
        elif not name.startswith("_") and value != _DEFAULTS.get(name) and name not in _NEUTRAL:
            return None
    if config.use_cache is False:  # transformers reruns the whole prefix: other float sums
        return None
    return overrides


def _config(merged: Seq2SeqModel) -> transformers.PretrainedConfig:
    """The transformers config kept in the file's metadata (``contract.META_CONFIG``)."""
    values = dict(merged.config)
    model_type = values.pop("model_type", None)
    if model_type not in transformers.CONFIG_MAPPING:
        raise InvalidArgumentError(
            f"{merged.path}: its config (metadata {c.META_CONFIG}) names model type "
            f"{model_type!r}, which this transformers does not know",
            argument="pretrained_model_name_or_path",
        )
    return transformers.CONFIG_MAPPING[model_type].from_dict(values)
