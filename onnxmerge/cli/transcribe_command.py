"""``onnxmerge transcribe FILE.wav -m MODEL``: a recording of any length to timed segments."""

from __future__ import annotations

import argparse
import wave
from pathlib import Path
from typing import Any

from onnxmerge.cli._shared import (
    ExitCode,
    Progress,
    at_least,
    emit,
    need,
    whisper_prompt,
    whisper_prompt_arguments,
)
from onnxmerge.errors import InvalidArgumentError

HELP = "transcribe a WAV recording of any length with a merged Whisper model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("audio", metavar="FILE.wav", help="PCM WAV at the model's rate (16 kHz)")
    p.add_argument("-m", "--model", required=True, help="merged Whisper model")
    whisper_prompt_arguments(p)
    p.add_argument(
        "--condition-on-prev-tokens",
        action="store_true",
        help="give each window the previous window's text as its prompt",
    )
    p.add_argument("--max-new-tokens", type=at_least(1), help="tokens per window at most")
    p.add_argument(
        "--threads",
        type=at_least(1),
        metavar="N",
        help="onnxruntime's threads (default: onnxruntime's choice)",
    )
    p.add_argument(
        "--session-cache",
        metavar="DIR",
        help="keep onnxruntime's optimized graph in DIR, so that later runs load faster",
    )


def read_wav(path: Path) -> tuple[Any, int]:
    """Mono float PCM in [-1, 1] and its rate from an integer PCM WAV file (channels averaged).

    Raises:
        InvalidArgumentError: the file is missing or not an integer PCM WAV file.
    """
    import numpy as np

    try:
        with wave.open(str(path), "rb") as reader:
            width, channels = reader.getsampwidth(), reader.getnchannels()
            rate, raw = reader.getframerate(), reader.readframes(reader.getnframes())
    except (OSError, EOFError, wave.Error) as error:
        raise InvalidArgumentError(
            f"{path} could not be read as a PCM WAV file ({error}); convert it, e.g. "
            "ffmpeg -i IN -ar 16000 -ac 1 OUT.wav",
            argument="audio",
        ) from error
    if width not in (1, 2, 4):
        raise InvalidArgumentError(
            f"{path} has {8 * width}-bit samples; give 8, 16 or 32-bit PCM", argument="audio"
        )
    if width == 1:  # 8-bit WAV is unsigned
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    else:
        kind = np.int16 if width == 2 else np.int32
        samples = np.frombuffer(raw, kind).astype(np.float32) / float(2 ** (8 * width - 1))
    return samples.reshape(-1, channels).mean(axis=1), rate


def run(args: argparse.Namespace) -> int:
    need("onnxruntime", "runtime")
    from onnxmerge.runtime import Seq2SeqModel
    from onnxmerge.runtime.speech import transcribe

    audio, rate = read_wav(Path(args.audio))
    options: dict[str, Any] = dict(whisper_prompt(args) or {})
    if args.condition_on_prev_tokens:
        options["condition_on_prev_tokens"] = True
    if args.max_new_tokens is not None:
        options["max_new_tokens"] = args.max_new_tokens
    with Progress(quiet=args.json) as progress:
        progress("loading the model")
        model = Seq2SeqModel(args.model, session_cache=args.session_cache, threads=args.threads)
        progress(f"transcribing {audio.size / rate:.1f} s")

        def heard(done: float, total: float) -> None:
            progress.show(f"  {done:.1f} / {total:.1f} s ({100 * done / total:.0f} %)")

        result = transcribe(model, audio, rate, progress=heard, **options)
    segments = [
        {"start": s.start, "end": s.end, "text": s.text, "tokens": s.tokens}
        for s in result.segments
    ]
    emit(args, {"text": result.text, "segments": segments}, lambda: _lines(result))
    return ExitCode.OK


def _lines(result: Any) -> str:
    return "\n".join(
        f"[{s.start:8.2f} -> {s.end:8.2f}] "
        + (s.text.strip() if s.text is not None else " ".join(map(str, s.tokens)))
        for s in result.segments
    )
