"""``onnxmerge transcribe FILE.wav -m MODEL``: a recording of any length to timed segments."""

from __future__ import annotations

import argparse
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
        help="keep onnxruntime's optimized graph in DIR, so that later runs load faster; a "
        "float32 model's greedy windows then screen tokens with an int8 copy of its head "
        "(same tokens, faster)",
    )


def run(args: argparse.Namespace) -> int:
    need("onnxruntime", "runtime")
    from onnxmerge.runtime import Seq2SeqModel
    from onnxmerge.runtime.speech import read_wav, transcribe

    audio, rate = read_wav(args.audio)
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
