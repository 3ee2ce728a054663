"""Write a static translation site: a page, a small module, the generator model and its tokenizer.

The page runs the generator model (the whole decoding loop in one graph) in onnxruntime-web's
wasm backend and tokenizes with a JavaScript tokenizer that reads ``tokenizer.json``; both come
from npm, pinned in the site's ``package.json``. The folder is staged beside the output and
renamed into place, so a failure leaves no half-written site.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import onnx

from onnxmerge import contract, model_io
from onnxmerge.errors import (
    ExportFolderError,
    InvalidArgumentError,
    InvalidMergedModelError,
    RefusedOutputError,
)
from onnxmerge.merge import Source, resolve_source
from onnxmerge.quantization import check_weights

MODEL_FILE = "generator.onnx"
SETTINGS_FILE = "site.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Each page's files: the name in the site, then the asset it is copied from.
ASSETS = {
    "index.html": "index.html",
    "translate.js": "translate.js",
    "page.js": "page.js",
    "page.css": "page.css",
    "package.json": "package.json",
}
AUDIO_ASSETS = {
    "index.html": "transcribe.html",
    "transcribe.js": "transcribe.js",
    "page.js": "page.js",
    "page.css": "page.css",
    "package.json": "package.json",
}
# The text page feeds these inputs; Whisper (input_features) gets the audio page.
TEXT_INPUTS = {"input_ids", "attention_mask"}
AUDIO_INPUTS = ["input_features"]
# Past about 2 GB a model needs external data, which this page does not load.
MAX_MODEL_BYTES = 2**31 - 1
_GENERATOR_KEY = "onnxmerge.generator"


@dataclass(frozen=True)
class SiteResult:
    """What :func:`build_site` wrote: the folder and each file's bytes."""

    path: Path
    files: dict[str, int]
    audio: bool


def build_site(
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    weights: str | None = None,
    tokenizer: str | os.PathLike | None = None,
    examples: Sequence[str] = (),
    language: str | None = None,
    task: str | None = None,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
    dtype: str | None = None,
) -> model_io.WrittenPath[SiteResult]:
    """Write a static site that translates in the browser with one model file; return its folder.

    Args:
        source: an optimum export folder or a Hub repository with its models under ``onnx/``
            (merged first, unless the folder already holds the merge of those very files), a
            merged model file or a generator model file (``onnxmerge.generator.build_generator``).
        output: the site folder; it must not exist, be empty, or ``overwrite`` must be set.
        weights: ``None`` keeps the weights as they are; ``"int8"`` (or another precision
            ``onnxmerge.quantize`` takes) quantizes the merged model before the loop is built.
        tokenizer: the folder holding ``tokenizer.json`` (and ``tokenizer_config.json``); default
            the source folder, or the model file's folder.
        examples: sentences the page's text box starts with.
        language: Whisper: the decoder prompt's language (``"en"``), as ``generate()`` takes
            it; a multilingual model needs one, since the graph does not detect it.
        task: Whisper: ``"transcribe"`` or ``"translate"``, as ``generate()`` takes it.
        overwrite: replace an existing, non-empty output folder.
        progress: called with the name of each step as it starts.
        dtype: which files of a folder with several dtypes (transformers.js's names), fp32 by
            default.

    Returns:
        The site folder's path; its ``report`` is the :class:`SiteResult`.

    Raises:
        OnnxMergeError: or a subclass (``InvalidArgumentError`` for a bad argument), saying what
            is wrong; nothing is written then.
    """
    check_weights(weights)
    found, output = resolve_source(source, dtype), Path(output)
    tokenizer_dir = Path(tokenizer) if tokenizer else found.config_dir
    audio, prompt = _audio_prompt(found, language, task)
    # Whisper's page shows token ids when there is no tokenizer (the test zoo's tiny model).
    tokenizer_files = _tokenizer_files(tokenizer_dir, required=not audio or tokenizer is not None)
    model_io.check_output(output, (found.path, tokenizer_dir), overwrite=overwrite, folder=True)
    step = progress or (lambda _name: None)
    staging = _staging_beside(output)
    try:
        _write_generator(found, staging / MODEL_FILE, weights, step, audio, prompt)
        step("writing the page")
        _write_page(staging, audio, examples, tokenizer_files)
        files = {p.name: p.stat().st_size for p in sorted(staging.iterdir())}
        _publish(staging, output)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return model_io.WrittenPath.of(output, SiteResult(output, files, audio))


def _staging_beside(output: Path) -> Path:
    """A new folder beside ``output`` where the site is written before it is renamed."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide the site from a server's user
    return staging


def _audio_prompt(
    found: Source, language: str | None, task: str | None
) -> tuple[bool, dict[str, str]]:
    """Whether the page is the audio one, and the Whisper prompt's keywords given."""
    audio = _is_whisper(found.config_dir if found.layout else found.path)
    prompt = {k: v for k, v in (("language", language), ("task", task)) if v is not None}
    if prompt and not audio:
        raise InvalidArgumentError(
            "--language and --task apply to Whisper models only", argument="language"
        )
    return audio, prompt


def _write_page(
    staging: Path, audio: bool, examples: Sequence[str], tokenizer_files: dict[str, Path | None]
) -> None:
    """The page's settings, the tokenizer and the page's own files, beside the model."""
    model = staging / MODEL_FILE
    settings = _audio_page_settings(model) if audio else _page_settings(model)
    settings["examples"] = list(examples)
    if audio:
        settings["tokenizer"] = bool(tokenizer_files)
    (staging / SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n", "utf-8")
    for name, path in tokenizer_files.items():
        if path is None:
            (staging / name).write_text("{}\n", "utf-8")
        else:
            shutil.copyfile(path, staging / name)
    assets = resources.files("onnxmerge.web") / "assets"
    for name, asset in (AUDIO_ASSETS if audio else ASSETS).items():
        (staging / name).write_bytes((assets / asset).read_bytes())


def _is_whisper(source: Path) -> bool:
    """Whether the page is the audio one: a Whisper export, merged model or generator."""
    if source.is_dir():
        try:
            config = json.loads((source / "config.json").read_text("utf-8"))
        except (OSError, ValueError):
            return False
        return config.get("model_type") == "whisper"
    try:
        metadata = _metadata(source)
    except InvalidMergedModelError:
        return False  # refused, with the reason, when the generator is written
    return json.loads(metadata.get(contract.META_ENCODER_INPUTS, "[]")) == AUDIO_INPUTS


def _tokenizer_files(folder: Path, required: bool = True) -> dict[str, Path | None]:
    found = folder / TOKENIZER_FILE
    if not found.is_file() and not required:
        return {}
    if not found.is_file():
        raise ExportFolderError(
            f"no {TOKENIZER_FILE} in {folder}: the page tokenizes with it. Save the model's fast "
            "tokenizer there (AutoTokenizer.from_pretrained(...).save_pretrained(folder)) or pass "
            "the folder that holds it (--tokenizer)"
        )
    config = folder / TOKENIZER_CONFIG_FILE
    return {TOKENIZER_FILE: found, TOKENIZER_CONFIG_FILE: config if config.is_file() else None}


def _publish(staging: Path, output: Path) -> None:
    """Rename the finished folder into place; an old one is moved aside first, then deleted."""
    old = None
    if output.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{output.name}-old-", dir=output.parent))
        old.rmdir()
        output.rename(old)
    try:
        staging.rename(output)
    except OSError as e:
        if old is not None:
            old.rename(output)
        raise RefusedOutputError(f"could not write the site to {output}: {e}") from e
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _metadata(path: Path) -> dict[str, str]:
    try:
        model = onnx.load(os.fspath(path), load_external_data=False)
    except Exception as e:  # onnx raises several types for a file that is not a model
        raise InvalidMergedModelError(f"{path} is not a readable ONNX model: {e}") from e
    return {p.key: p.value for p in model.metadata_props}


def _write_generator(
    found: Source,
    model: Path,
    weights: str | None,
    step: Callable[[str], None],
    audio: bool = False,
    prompt: dict[str, str] | None = None,
) -> None:
    """The generator the page runs, at ``model``: copied, or built from the merged model."""
    from onnxmerge.generator import build_generator
    from onnxmerge.generator.audio import PREPROCESSOR_CONFIG

    if found.layout is None and _GENERATOR_KEY in _metadata(found.path):
        _copy_generator(found.path, model, weights, audio, prompt)
        return
    generation_config = prompt or None
    if weights is None:
        build_generator(
            found, model, audio=audio, generation_config=generation_config, progress=step
        )
    else:
        from onnxmerge.quantization import quantize

        with tempfile.TemporaryDirectory(prefix="work-", dir=model.parent) as work:
            quantized = quantize(
                found, Path(work) / f"model_{weights}.onnx", weights=weights, progress=step
            )
            # build_generator reads the preprocessor config beside the model it is given.
            preprocessor = found.config_dir / PREPROCESSOR_CONFIG
            if audio and preprocessor.is_file():
                shutil.copyfile(preprocessor, Path(work) / PREPROCESSOR_CONFIG)
            step("building the decoding loop")
            build_generator(quantized, model, audio=audio, generation_config=generation_config)
    if any(p.name != MODEL_FILE for p in model.parent.iterdir()):
        raise RefusedOutputError(
            f"the generator of {found.path} was written with external data; {_TOO_LARGE}"
        )


def _copy_generator(
    source: Path, model: Path, weights: str | None, audio: bool, prompt: dict[str, str] | None
) -> None:
    """A generator model given as the source, as it is, where the page can run it."""
    from onnxmerge.generator.audio import META_FEATURES

    if prompt:
        raise InvalidArgumentError(
            f"{source} is a generator model, whose prompt is fixed: build the site from the "
            "merged model or the export folder to choose the language or task",
            argument="language",
        )
    if audio and META_FEATURES not in _metadata(source):
        raise InvalidArgumentError(
            f"{source} is a Whisper generator that reads input_features; the page feeds it "
            "audio: build the site from the merged model or the export folder, or build the "
            "generator with --audio",
            argument="source",
        )
    if weights is not None:
        raise InvalidArgumentError(
            f"{source} is a generator model; to quantize, build the site from the merged "
            "model or the export folder",
            argument="weights",
        )
    if any(source.parent.glob(f"{source.name}_data")) or any(
        source.parent.glob(f"{source.name}.data")
    ):
        raise RefusedOutputError(f"{source} keeps its weights in external data; {_TOO_LARGE}")
    shutil.copyfile(source, model)


_TOO_LARGE = (
    "the page loads one file of at most 2 GB (onnxruntime-web's wasm memory is capped at 4 GB): "
    "quantize it (--weights int8) or use a smaller model"
)


def _servable_metadata(model: Path) -> tuple[dict[str, str], dict, dict]:
    """A generator small enough for the page: its metadata, config and generation config."""
    if model.stat().st_size > MAX_MODEL_BYTES:
        raise RefusedOutputError(f"{model.name} is {model.stat().st_size} bytes; {_TOO_LARGE}")
    metadata = _metadata(model)
    try:
        config = json.loads(metadata.get(contract.META_CONFIG, "{}"))
        generation_config = json.loads(metadata.get(contract.META_GENERATION_CONFIG, "{}"))
    except ValueError as e:
        raise InvalidMergedModelError(f"the onnxmerge metadata of {model} is not JSON: {e}") from e
    return metadata, config, generation_config


def _page_settings(model: Path) -> dict:
    """What the page needs to know: the model file, the encoder inputs and how long to generate."""
    from onnxmerge.settings import resolve_settings

    metadata, config, generation_config = _servable_metadata(model)
    try:
        encoder_inputs = json.loads(metadata.get(contract.META_ENCODER_INPUTS, "[]"))
    except ValueError as e:
        raise InvalidMergedModelError(f"the onnxmerge metadata of {model} is not JSON: {e}") from e
    if not set(encoder_inputs) <= TEXT_INPUTS or "input_ids" not in encoder_inputs:
        raise InvalidArgumentError(
            f"the model's encoder reads {encoder_inputs}; the page feeds text only "
            f"({', '.join(sorted(TEXT_INPUTS))})",
            argument="source",
        )
    # The defaults Seq2SeqModel.generate uses, so the page generates the same tokens.
    settings = resolve_settings(config, generation_config, {}, 1)
    return {
        "model": MODEL_FILE,
        "encoder_inputs": encoder_inputs,
        "max_new_tokens": settings.max_length - 1,
        "pad_token_id": settings.pad_token_id,
    }


def _audio_page_settings(model: Path) -> dict:
    """The audio page's settings: the feature spec, the prompt's length, how long to generate."""
    from onnxmerge.generator.audio import META_FEATURES
    from onnxmerge.settings import resolve_settings

    metadata, config, generation_config = _servable_metadata(model)
    try:
        generator = json.loads(metadata[_GENERATOR_KEY])
        spec = json.loads(metadata[META_FEATURES])
    except (KeyError, ValueError) as e:
        raise InvalidMergedModelError(
            f"the onnxmerge metadata of {model} is incomplete: {e}"
        ) from e
    prompt_length = len(generator.get("decoder_prompt") or [0])
    generation_config.pop("forced_decoder_ids", None)  # the prompt stands for it
    settings = resolve_settings(config, generation_config, {}, prompt_length)
    return {
        "model": MODEL_FILE,
        "audio": spec,
        "prompt_length": prompt_length,
        "max_new_tokens": settings.max_length - prompt_length,
        "pad_token_id": settings.pad_token_id,
    }
