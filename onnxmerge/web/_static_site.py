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
from importlib import resources
from pathlib import Path

import onnx

from onnxmerge import contract
from onnxmerge.errors import InvalidMergedModelError, OnnxMergeError, RefusedOutputError

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
) -> Path:
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

    Raises:
        OnnxMergeError: or a subclass, saying what is wrong; nothing is written then.
    """
    source, output = Path(source), Path(output)
    step = progress or (lambda _name: None)
    if not source.exists():
        raise InvalidMergedModelError(f"{source} does not exist: give an export folder or a model")
    layout = None
    if source.is_dir():
        from onnxmerge.export_layout import resolve

        layout = resolve(source, dtype)
    default_tokenizer = layout.config_dir if layout else source.parent
    tokenizer_dir = Path(tokenizer) if tokenizer else default_tokenizer
    audio = _is_whisper(layout.config_dir if layout else source)
    prompt = {k: v for k, v in (("language", language), ("task", task)) if v is not None}
    if prompt and not audio:
        raise OnnxMergeError("--language and --task apply to Whisper models only")
    # Whisper's page shows token ids when there is no tokenizer (the test zoo's tiny model).
    tokenizer_files = _tokenizer_files(tokenizer_dir, required=not audio or tokenizer is not None)
    _check_output(output, overwrite, inputs=(source, tokenizer_dir))
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the site from a server's user
        model = staging / MODEL_FILE
        _write_generator(layout or source, model, weights, staging, step, audio, prompt)
        step("writing the page")
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
        _publish(staging, output)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return output


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
        raise OnnxMergeError(
            f"no {TOKENIZER_FILE} in {folder}: the page tokenizes with it. Save the model's fast "
            "tokenizer there (AutoTokenizer.from_pretrained(...).save_pretrained(folder)) or pass "
            "the folder that holds it (--tokenizer)"
        )
    config = folder / TOKENIZER_CONFIG_FILE
    return {TOKENIZER_FILE: found, TOKENIZER_CONFIG_FILE: config if config.is_file() else None}


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def _check_output(output: Path, overwrite: bool, inputs: Sequence[Path]) -> None:
    for path in inputs:
        if _inside(path, output):
            raise RefusedOutputError(
                f"the site folder {output} holds the input {path}; writing the site would replace "
                "it: choose another output folder"
            )
    if output.exists() and not output.is_dir():
        raise RefusedOutputError(f"{output} exists and is not a folder; choose another output")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise RefusedOutputError(
            f"{output} exists and is not empty; pass --overwrite (overwrite=True) to replace it, "
            "or choose another folder"
        )


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
    source,
    model: Path,
    weights: str | None,
    staging: Path,
    step: Callable[[str], None],
    audio: bool = False,
    prompt: dict[str, str] | None = None,
) -> None:
    from onnxmerge.export_layout import ExportLayout
    from onnxmerge.generator import build_generator
    from onnxmerge.generator.audio import META_FEATURES, PREPROCESSOR_CONFIG

    if isinstance(source, ExportLayout):
        source, layout = source.source, source
    else:
        layout = None
    if source.is_file() and _GENERATOR_KEY in _metadata(source):
        if prompt:
            raise OnnxMergeError(
                f"{source} is a generator model, whose prompt is fixed: build the site from the "
                "merged model or the export folder to choose the language or task"
            )
        if audio and META_FEATURES not in _metadata(source):
            raise OnnxMergeError(
                f"{source} is a Whisper generator that reads input_features; the page feeds it "
                "audio: build the site from the merged model or the export folder, or build the "
                "generator with --audio"
            )
        if weights is not None:
            raise OnnxMergeError(
                f"{source} is a generator model; to quantize, build the site from the merged "
                "model or the export folder"
            )
        if any(source.parent.glob(f"{source.name}_data")) or any(
            source.parent.glob(f"{source.name}.data")
        ):
            raise OnnxMergeError(f"{source} keeps its weights in external data; {_TOO_LARGE}")
        shutil.copyfile(source, model)
        return
    with tempfile.TemporaryDirectory(prefix="work-", dir=staging) as tmp:
        merged = source
        if layout is not None:
            merged = _merged_model(layout, Path(tmp), step)
        if weights is not None:
            merged = _quantize(merged, Path(tmp), weights, step)
        # build_generator reads the preprocessor config beside the model it is given.
        config_dir = source if source.is_dir() else source.parent
        if layout is not None:
            config_dir = layout.config_dir
        if audio and (config_dir / PREPROCESSOR_CONFIG).is_file() and merged != source:
            shutil.copyfile(config_dir / PREPROCESSOR_CONFIG, merged.parent / PREPROCESSOR_CONFIG)
        step("building the decoding loop")
        build_generator(merged, model, audio=audio, generation_config=prompt or None)
    if any(p.name != MODEL_FILE for p in staging.iterdir()):
        raise OnnxMergeError(
            f"the generator of {source} was written with external data; {_TOO_LARGE}"
        )


def _merged_model(layout, work: Path, step: Callable[[str], None]) -> Path:
    """The folder's own merged model (``onnxmerge merge`` wrote it) when it is the merge of the
    files there now; else a fresh merge in ``work``, leaving the folder's file alone."""
    import dataclasses

    from onnxmerge import export_layout
    from onnxmerge.merge import merge_seq2seq

    earlier = [
        folder / export_layout.output_name(layout.dtype)
        for folder in dict.fromkeys((layout.source, layout.model_dir, layout.config_dir))
    ]
    for path in earlier:
        if path.is_file():
            recorded = _metadata(path).get(contract.META_SOURCES)
            if export_layout.is_merge_of(recorded, layout):
                step(f"using {path}, the merge of these files")
                return path
    stale = tuple(p for p in earlier if p.is_file())
    step(
        f"merging the export folder (in a temporary folder: {stale[0].name} there is not the "
        "merge of these files)"
        if stale
        else "merging the export folder"
    )
    layout = dataclasses.replace(layout, files=tuple(p for p in layout.files if p not in stale))
    return merge_seq2seq(layout, work / "model.onnx")


_TOO_LARGE = (
    "the page loads one file of at most 2 GB (onnxruntime-web's wasm memory is capped at 4 GB): "
    "quantize it (--weights int8) or use a smaller model"
)


def _quantize(merged: Path, work: Path, weights: str, step: Callable[[str], None]) -> Path:
    from onnxmerge.quantization import quantize

    step(f"quantizing the weights to {weights}")
    return Path(quantize(merged, work / f"model_{weights}.onnx", weights=weights))


def _servable_metadata(model: Path) -> tuple[dict[str, str], dict, dict]:
    """A generator small enough for the page: its metadata, config and generation config."""
    if model.stat().st_size > MAX_MODEL_BYTES:
        raise OnnxMergeError(f"{model.name} is {model.stat().st_size} bytes; {_TOO_LARGE}")
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
        raise OnnxMergeError(
            f"the model's encoder reads {encoder_inputs}; the page feeds text only "
            f"({', '.join(sorted(TEXT_INPUTS))})"
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
