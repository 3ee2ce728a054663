"""How close quantized logits stay to the float model's: shared by tests and benchmarks."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def mergeable_variant(arch: str) -> str:
    """The zoo export variant that merges: GPT-2 decoders re-read the encoder states every
    cached step, so vision-encoder-decoder merges without past only."""
    return "no-past" if arch == "vision-encoder-decoder" else "default"


def teacher_forced_logits(path: Path, length: int = 8) -> np.ndarray:
    """The first step's logits over a fixed random decoder prompt, one intra-op thread."""
    from onnxmerge._ort import session_options
    from onnxmerge.runtime import Seq2SeqModel
    from onnxmerge.samples import sample_encoder_inputs

    model = Seq2SeqModel(path, session_options=session_options(threads=1))
    rng = np.random.default_rng(0)
    inputs = sample_encoder_inputs(model.session, model.config, batch=2, length=7, rng=rng)
    vocab = int(model.config.get("vocab_size") or model.config["decoder"]["vocab_size"])
    ids = rng.integers(3, vocab, (2, length)).astype(np.int64)
    return model.first_step(inputs, ids).logits


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
