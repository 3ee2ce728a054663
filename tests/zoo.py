"""A zoo of tiny seq2seq models exported with optimum, cached on disk.

Every model is built from a transformers config with seeded random weights, saved with
``save_pretrained`` and exported with optimum's ``main_export``, so each export folder looks exactly
like what a user has after ``optimum-cli export onnx``. Exports are cached under a key that covers
the architecture, the variant, the config and the versions of the libraries that shape the files.

Variants of one architecture:

- ``default``: what ``main_export`` writes with the installed packages.
- ``head-copy``: the tied LM head stored as its own initializer, a copy of ``embedding^T``
  (optimum's tied-weight pass switched off; what users without ``accelerate`` get).
- ``head-tied``: the tied LM head as a ``Transpose`` node reading the embedding initializer
  (optimum's tied-weight pass, which needs ``accelerate``).
- ``no-past``: exported without past (encoder + decoder only).
- ``no-merged``: ``default`` without ``decoder_model_merged.onnx``.
- ``merged-only``: ``encoder_model.onnx`` + ``decoder_model_merged.onnx`` only.
- ``fp16``: exported from the float16 PyTorch model.
- ``int8``: ``default`` with every file dynamically quantized (``QInt8`` weights).
- ``external-data``: ``default`` with every file's tensors in ``<name>.onnx_data`` beside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.exports import export_onnx, package_versions, staging

logger = logging.getLogger(__name__)

# Bump to invalidate every cached export after a change in how models are built or exported.
ZOO_VERSION = "1"

ARCHITECTURES: tuple[str, ...] = (
    "marian",
    "bart",
    "mbart",
    "m2m100",
    "pegasus",
    "blenderbot",
    "blenderbot-small",
    "t5",
    "t5-untied",
    "mt5",
    "longt5",
    "whisper",
    "vision-encoder-decoder",
)

VARIANTS: tuple[str, ...] = (
    "default",
    "head-copy",
    "head-tied",
    "no-past",
    "no-merged",
    "merged-only",
    "fp16",
    "int8",
    "external-data",
)

# Architectures whose LM head is tied to the input embedding.
TIED_HEAD_ARCHITECTURES: tuple[str, ...] = tuple(
    a for a in ARCHITECTURES if a not in ("t5-untied", "mt5", "vision-encoder-decoder")
)

ENCODER_FILE = "encoder_model.onnx"
DECODER_FILE = "decoder_model.onnx"
DECODER_WITH_PAST_FILE = "decoder_with_past_model.onnx"
DECODER_MERGED_FILE = "decoder_model_merged.onnx"

VOCAB = 128
D_MODEL = 32
FFN = 64
HEADS = 4
LAYERS = 2
MAX_POSITIONS = 64
# Wider than transformers' default init (0.02) so logits differ clearly between tokens and greedy
# or beam search follow one well-defined path.
INIT_STD = 0.5
WHISPER_MEL_BINS = 16
WHISPER_SOURCE_POSITIONS = 32  # encoder frames = 2 * this
IMAGE_SIZE = 32
IMAGE_CHANNELS = 3

# Special tokens: pad, eos, bos and decoder start distinct wherever the architecture allows it.
_BART_TOKENS = {
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "decoder_start_token_id": 3,
}
_BLENDERBOT_TOKENS = {
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 3,
}
_T5_TOKENS = {"pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}


@dataclass(frozen=True)
class TinyExport:
    arch: str
    variant: str
    pytorch_dir: Path
    onnx_dir: Path


def cache_root() -> Path:
    env = os.environ.get("ONNXMERGE_TEST_CACHE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / ".cache" / "tiny-models"


# ---------------------------------------------------------------------------------------------
# configs


def _encoder_decoder_dims() -> dict[str, Any]:
    """The sizes BART's config names, shared by its family and Whisper."""
    return {
        "vocab_size": VOCAB,
        "d_model": D_MODEL,
        "encoder_layers": LAYERS,
        "decoder_layers": LAYERS,
        "encoder_attention_heads": HEADS,
        "decoder_attention_heads": HEADS,
        "encoder_ffn_dim": FFN,
        "decoder_ffn_dim": FFN,
        "init_std": INIT_STD,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
    }


def _bart_family_common() -> dict[str, Any]:
    return {**_encoder_decoder_dims(), "max_position_embeddings": MAX_POSITIONS}


def _t5_common() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "d_model": D_MODEL,
        "d_kv": D_MODEL // HEADS,
        "d_ff": FFN,
        "num_layers": LAYERS,
        "num_decoder_layers": LAYERS,
        "num_heads": HEADS,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 16,
        "dropout_rate": 0.0,
        **_T5_TOKENS,
    }


def build_config(arch: str) -> Any:
    """The transformers config of one tiny architecture."""
    import transformers as tf

    if arch == "marian":
        # Marian's decoder starts from pad in real checkpoints; it is kept distinct here.
        return tf.MarianConfig(
            **_bart_family_common(),
            **_BART_TOKENS,
            decoder_vocab_size=VOCAB,
            share_encoder_decoder_embeddings=True,
            tie_word_embeddings=True,
        )
    if arch == "bart":
        return tf.BartConfig(**_bart_family_common(), **_BART_TOKENS, forced_bos_token_id=None)
    if arch == "mbart":
        return tf.MBartConfig(**_bart_family_common(), **_BART_TOKENS)
    if arch == "m2m100":
        return tf.M2M100Config(**_bart_family_common(), **_BART_TOKENS)
    if arch == "pegasus":
        return tf.PegasusConfig(
            **_bart_family_common(),
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
            decoder_start_token_id=3,
        )
    if arch == "blenderbot":
        return tf.BlenderbotConfig(**_bart_family_common(), **_BLENDERBOT_TOKENS)
    if arch == "blenderbot-small":
        return tf.BlenderbotSmallConfig(**_bart_family_common(), **_BLENDERBOT_TOKENS)
    if arch == "t5":
        return tf.T5Config(**_t5_common(), tie_word_embeddings=True, initializer_factor=1.0)
    if arch == "t5-untied":
        return tf.T5Config(**_t5_common(), tie_word_embeddings=False, initializer_factor=1.0)
    if arch == "mt5":
        return tf.MT5Config(
            **_t5_common(),
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            initializer_factor=1.0,
        )
    if arch == "longt5":
        return tf.LongT5Config(
            **_t5_common(),
            local_radius=4,
            global_block_size=4,
            encoder_attention_type="local",
            tie_word_embeddings=True,
            initializer_factor=1.0,
        )
    if arch == "whisper":
        return tf.WhisperConfig(
            **_encoder_decoder_dims(),
            **_BART_TOKENS,
            num_mel_bins=WHISPER_MEL_BINS,
            max_source_positions=WHISPER_SOURCE_POSITIONS,
            max_target_positions=MAX_POSITIONS,
            suppress_tokens=None,
            begin_suppress_tokens=None,
        )
    if arch == "vision-encoder-decoder":
        encoder = tf.ViTConfig(
            image_size=IMAGE_SIZE,
            patch_size=8,
            num_channels=IMAGE_CHANNELS,
            hidden_size=D_MODEL,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=FFN,
            initializer_range=INIT_STD,
        )
        decoder = tf.GPT2Config(
            vocab_size=VOCAB,
            n_embd=D_MODEL,
            n_layer=LAYERS,
            n_head=HEADS,
            n_positions=MAX_POSITIONS,
            n_inner=FFN,
            initializer_range=INIT_STD,
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=1,
            add_cross_attention=True,
            is_decoder=True,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        config = tf.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
        config.pad_token_id = 1
        config.eos_token_id = 2
        config.decoder_start_token_id = 3
        return config
    raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")


def export_task(arch: str, variant: str = "default") -> str:
    with_past = variant != "no-past"
    if arch == "whisper":
        task = "automatic-speech-recognition"
    elif arch == "vision-encoder-decoder":
        task = "image-to-text"
    else:
        task = "text2text-generation"
    return f"{task}-with-past" if with_past else task


def _model_class(arch: str) -> Any:
    import transformers as tf

    return {
        "marian": tf.MarianMTModel,
        "bart": tf.BartForConditionalGeneration,
        "mbart": tf.MBartForConditionalGeneration,
        "m2m100": tf.M2M100ForConditionalGeneration,
        "pegasus": tf.PegasusForConditionalGeneration,
        "blenderbot": tf.BlenderbotForConditionalGeneration,
        "blenderbot-small": tf.BlenderbotSmallForConditionalGeneration,
        "t5": tf.T5ForConditionalGeneration,
        "t5-untied": tf.T5ForConditionalGeneration,
        "mt5": tf.MT5ForConditionalGeneration,
        "longt5": tf.LongT5ForConditionalGeneration,
        "whisper": tf.WhisperForConditionalGeneration,
        "vision-encoder-decoder": tf.VisionEncoderDecoderModel,
    }[arch]


# ---------------------------------------------------------------------------------------------
# cache


_VERSIONED = (
    "torch",
    "transformers",
    "optimum",
    "optimum-onnx",
    "onnx",
    "onnxruntime",
    "accelerate",
)


def cache_key(arch: str, variant: str) -> str:
    config = build_config(arch).to_dict()
    config.pop("transformers_version", None)
    payload = json.dumps(
        {
            "zoo": ZOO_VERSION,
            "arch": arch,
            "variant": variant,
            "config": config,
            "versions": package_versions(_VERSIONED),
        },
        sort_keys=True,
        default=str,
    )
    return f"{arch}--{variant}--{hashlib.sha256(payload.encode()).hexdigest()[:16]}"


# ---------------------------------------------------------------------------------------------
# building and exporting


def build_pytorch(arch: str, out_dir: Path) -> None:
    """Build the tiny model with seeded random weights and save it with ``save_pretrained``."""
    import torch
    from transformers import GenerationConfig

    config = build_config(arch)
    torch.manual_seed(0)
    model = _model_class(arch)(config).eval()
    generation = GenerationConfig.from_model_config(config)
    generation.max_length = 20
    model.generation_config = generation
    model.save_pretrained(out_dir)


def _module_kind(model: Any, param_name: str) -> str:
    import torch

    module = model.get_submodule(param_name.rpartition(".")[0])
    if isinstance(module, torch.nn.Embedding):
        return "Embedding"
    if isinstance(module, torch.nn.Linear):
        return "Linear"
    return type(module).__name__


def _weights_to_tie_any_embedding(
    tied_params: list[list[str]], model: Any
) -> tuple[list[dict[str, str]], list[list[str]], list[list[str]]]:
    """optimum's grouping of tied parameters, accepting subclasses of Embedding and Linear.

    optimum matches module class names exactly, so the scaled embeddings of BART, mBART, M2M100
    and Blenderbot are never tied; with this grouping they get the same Transpose form as Marian.
    """
    with_kind: list[dict[str, str]] = []
    to_tie: list[list[str]] = []
    ignored: list[list[str]] = []
    for group in tied_params:
        kinds = {name: _module_kind(model, name) for name in group}
        with_kind.append(kinds)
        supported = all(kind in ("Embedding", "Linear") for kind in kinds.values())
        (to_tie if supported else ignored).append(group)
    return with_kind, to_tie, ignored


def _run_main_export(pytorch_dir: Path, out_dir: Path, arch: str, variant: str) -> None:
    kwargs: dict[str, Any] = {}
    if arch == "whisper":
        kwargs["nb_max_frames"] = 2 * WHISPER_SOURCE_POSITIONS
    if variant == "fp16":
        kwargs["dtype"] = "fp16"
    tied = {"head-copy": False, "head-tied": True}.get(variant)
    export_onnx(
        pytorch_dir,
        out_dir,
        export_task(arch, variant),
        tied=tied,
        weights_to_tie=_weights_to_tie_any_embedding,
        **kwargs,
    )


def _quantize_int8(onnx_dir: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    for path in sorted(onnx_dir.glob("*.onnx")):
        quantized = path.with_name(path.stem + ".int8.tmp.onnx")
        quantize_dynamic(path, quantized, weight_type=QuantType.QInt8)
        os.replace(quantized, path)


def _externalize(onnx_dir: Path) -> None:
    import onnx

    for path in sorted(onnx_dir.glob("*.onnx")):
        model = onnx.load(str(path))
        onnx.save(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=f"{path.name}_data",
            size_threshold=0,
        )


def _keep_merged_only(onnx_dir: Path) -> None:
    for name in (DECODER_FILE, DECODER_WITH_PAST_FILE):
        (onnx_dir / name).unlink()


_POST_EXPORT: dict[str, Callable[[Path], None]] = {
    "no-merged": lambda d: (d / DECODER_MERGED_FILE).unlink(),
    "merged-only": _keep_merged_only,
    "int8": _quantize_int8,
    "external-data": _externalize,
}


def tiny_export(arch: str, variant: str = "default") -> TinyExport:
    """The cached export of a tiny ``arch`` model in the given variant, built on first use."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    entry = cache_root() / cache_key(arch, variant)
    export = TinyExport(arch, variant, entry / "pytorch", entry / "onnx")
    if entry.is_dir():
        return export
    logger.info("building tiny %s export (%s) in %s", arch, variant, entry)
    with staging(entry) as folder:
        pytorch_dir = folder / "pytorch"
        onnx_dir = folder / "onnx"
        build_pytorch(arch, pytorch_dir)
        _run_main_export(pytorch_dir, onnx_dir, arch, variant)
        post = _POST_EXPORT.get(variant)
        if post is not None:
            post(onnx_dir)
    return export


def _demo_export_key() -> str:
    from onnxmerge.demo import DEMO_MODEL_DIR

    digest = hashlib.sha256()
    for path in sorted(DEMO_MODEL_DIR.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    versions = package_versions(("torch", "transformers", "optimum", "optimum-onnx", "onnx"))
    for name, version in versions.items():
        digest.update(f"{name}={version}".encode())
    return digest.hexdigest()[:16]


def demo_export() -> Path:
    """An optimum export of the shipped demo model, with its tokenizer, cached like the zoo."""
    from onnxmerge.demo import DEMO_MODEL_DIR

    entry = cache_root() / f"demo--{_demo_export_key()}"
    if entry.is_dir():
        return entry
    with staging(entry) as folder:
        export_onnx(DEMO_MODEL_DIR, folder, "text2text-generation-with-past")
        for path in DEMO_MODEL_DIR.iterdir():
            if path.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy2(path, folder / path.name)
    return entry


# ---------------------------------------------------------------------------------------------
# using an export


def load_pytorch(export: TinyExport) -> Any:
    """The transformers model the export was made from, in eval mode."""
    model = _model_class(export.arch).from_pretrained(export.pytorch_dir)
    if export.variant == "fp16":
        model = model.half()
    return model.eval()


def special_tokens(export: TinyExport) -> set[int]:
    config = json.loads((export.pytorch_dir / "config.json").read_text())
    names = ("pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id")
    found = set()
    for source in (config, config.get("decoder", {})):
        for name in names:
            value = source.get(name)
            if isinstance(value, int):
                found.add(value)
            elif isinstance(value, list):
                found.update(v for v in value if isinstance(v, int))
    return found


def sample_encoder_inputs(
    export: TinyExport, batch: int = 2, seq: int = 7, seed: int = 0
) -> dict[str, np.ndarray]:
    """Encoder inputs under the merged contract's names, with random but valid content.

    Text models get ``input_ids`` and ``attention_mask`` (int64); every row after the first is
    right-padded by one more position than the one before, and real tokens avoid special ids,
    then end with eos. Whisper gets ``input_features`` of the fixed frame count it was built with
    (``seq`` is ignored); the vision model gets ``pixel_values`` (``seq`` is ignored).
    """
    rng = np.random.default_rng(seed)
    dtype = np.float16 if export.variant == "fp16" else np.float32
    if export.arch == "whisper":
        shape: tuple[int, ...] = (batch, WHISPER_MEL_BINS, 2 * WHISPER_SOURCE_POSITIONS)
        return {"input_features": rng.uniform(-1.0, 1.0, size=shape).astype(dtype)}
    if export.arch == "vision-encoder-decoder":
        shape = (batch, IMAGE_CHANNELS, IMAGE_SIZE, IMAGE_SIZE)
        return {"pixel_values": rng.uniform(-1.0, 1.0, size=shape).astype(dtype)}

    config = json.loads((export.pytorch_dir / "config.json").read_text())
    eos = config["eos_token_id"]
    pad = config["pad_token_id"]
    ordinary = np.array(sorted(set(range(VOCAB)) - special_tokens(export)), dtype=np.int64)
    input_ids = np.full((batch, seq), pad, dtype=np.int64)
    attention_mask = np.zeros((batch, seq), dtype=np.int64)
    for row in range(batch):
        length = max(2, seq - row)
        input_ids[row, : length - 1] = rng.choice(ordinary, size=length - 1)
        input_ids[row, length - 1] = eos
        attention_mask[row, :length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}
