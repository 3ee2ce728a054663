"""The ASGI app: models loaded in the background, LibreTranslate's ``/translate`` and
``/languages``, ``/v1/generate``, OpenAI's ``/v1/audio/transcriptions``, ``/health`` and
``/metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import io
import json
import logging
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from onnxmerge.errors import InvalidArgumentError
from onnxmerge.runtime.speech import read_wav
from onnxmerge.serve._batcher import Answer, Batcher
from onnxmerge.serve._http import Gate
from onnxmerge.serve._languages import language_name
from onnxmerge.serve._limits import Limits
from onnxmerge.serve._metrics import CONTENT_TYPE, Metrics
from onnxmerge.serve._models import RequestError, ServedModel, check_models
from onnxmerge.serve._stream import stream_response
from onnxmerge.serve._transcriber import Transcriber

logger = logging.getLogger(__name__)

# The form fields of /v1/audio/transcriptions, and the model name OpenAI's clients send.
SPEECH_FIELDS = ("file", "model", "language", "response_format")
OPENAI_WHISPER = "whisper-1"


class ServerState:
    """What the routes share: the limits, the models once loaded, and whether the server is
    loading, serving or draining."""

    def __init__(self, paths: dict[str, Path], limits: Limits):
        self.paths = paths
        self.limits = limits
        self.metrics = Metrics()
        self.batchers: dict[str, Batcher] = {}
        self.transcribers: dict[str, Transcriber] = {}  # the Whisper models
        self.loaded = False
        self.load_error: BaseException | None = None
        self.draining = False
        self.in_flight = 0

    async def load(self) -> None:
        """Open every model (merging export folders first) off the event loop, then start a
        batching worker for each, and a transcribing one for each Whisper model."""
        try:
            for name, path in self.paths.items():
                served = await asyncio.to_thread(
                    ServedModel.load,
                    name,
                    path,
                    self.limits.threads,
                    self.limits.session_cache,
                )
                self.batchers[name] = Batcher(
                    served,
                    self.metrics,
                    max_batch_size=self.limits.max_batch_size,
                    batch_wait_s=self.limits.batch_wait_ms / 1000,
                    max_queue=self.limits.max_queue,
                )
                self.batchers[name].start()
                if served.speech:
                    self.transcribers[name] = Transcriber(
                        served, self.metrics, max_queue=self.limits.max_queue
                    )
                    self.transcribers[name].start()
        except Exception as error:  # reported by /health and ends Server.run
            logger.error("loading the models failed: %s", error)
            self.load_error = error
            return
        self.loaded = True

    async def close(self) -> None:
        for transcriber in self.transcribers.values():
            await transcriber.stop()
        for batcher in self.batchers.values():
            await batcher.stop()
            batcher.served.close()


def create_app(
    models: Mapping[str, str | os.PathLike],
    *,
    max_batch_size: int = Limits.max_batch_size,
    batch_wait_ms: float = Limits.batch_wait_ms,
    max_queue: int = Limits.max_queue,
    max_body_bytes: int = Limits.max_body_bytes,
    request_timeout_s: float = Limits.request_timeout_s,
    api_key: str | None = None,
    threads: int | None = None,
    session_cache: str | os.PathLike | None = None,
) -> FastAPI:
    """An ASGI app (FastAPI) serving ``models``; the limits are :class:`Limits`' (docs/serve.md).

    Args:
        models: served name -> a merged ``.onnx`` file or an export folder (merged first into a
            temporary folder); the tokenizer is read from the file's folder or the export
            folder. A name ``SRC-TGT`` (``fr-en``) is the language pair ``/translate`` serves.
            A Whisper model is served on ``/v1/audio/transcriptions``.
        threads: onnxruntime's intra-op threads of each model's session (default:
            onnxruntime's choice), as ``Seq2SeqModel(threads=)``.
        session_cache: a folder keeping onnxruntime's optimized graph of each merged file, as
            ``Seq2SeqModel(session_cache=)`` (:class:`Limits`).

    Returns:
        The app. The models load in the background once it starts: ``/health`` answers 503
        until they are loaded.

    Raises:
        InvalidArgumentError: a bad name, a missing path or a bad limit; nothing is read.
    """
    limits = Limits(
        max_batch_size=max_batch_size,
        batch_wait_ms=batch_wait_ms,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        request_timeout_s=request_timeout_s,
        api_key=api_key,
        threads=threads,
        session_cache=session_cache,
    )
    state = ServerState(check_models(models), limits)

    app = FastAPI(
        title="onnxmerge",
        lifespan=lambda _: _lifespan(state),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.serve = state
    app.add_exception_handler(RequestError, _request_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_middleware(Gate, state=state, metrics=state.metrics, max_body_bytes=max_body_bytes)
    _add_probes(app, state)
    _add_translate(app, state)
    _add_generate(app, state)
    _add_transcriptions(app, state)
    return app


@contextlib.asynccontextmanager
async def _lifespan(state: ServerState) -> AsyncIterator[None]:
    """The models load in the background while the server runs; closed when it stops."""
    loading = asyncio.get_running_loop().create_task(state.load())
    try:
        yield
    finally:
        loading.cancel()
        await asyncio.gather(loading, return_exceptions=True)
        await state.close()


async def _request_error(request: Request, error: RequestError) -> JSONResponse:
    return JSONResponse({"error": str(error)}, error.status, headers=error.headers)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    """An unknown path (404) or method (405) answered like every other error."""
    return JSONResponse({"error": str(error.detail)}, error.status_code, headers=error.headers)


def _add_probes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "draining"}, 503)
        if state.load_error is not None:
            return JSONResponse({"status": "failed"}, 503)
        if not state.loaded:
            return JSONResponse({"status": "loading"}, 503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok", "models": list(state.batchers)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.text(), media_type=CONTENT_TYPE)


async def answer(
    state: ServerState,
    request: Request,
    batcher: Batcher,
    inputs: list[Any],
    options: dict,
    want_text: bool,
) -> Answer:
    """Queue the inputs on the model's batcher and wait for them (:func:`wait_for`).

    Raises:
        RequestError: 429 past the queue, 504 past the deadline, 499 when the client left, 400
            for inputs the model refuses.
    """
    return await wait_for(state, request, batcher.submit(inputs, options, want_text))


async def wait_for(state: ServerState, request: Request, future: asyncio.Future) -> Any:
    """The queued request's answer, waited for at most the request timeout and only while the
    client is there; otherwise the future is cancelled, which takes the request out.

    Raises:
        RequestError: 504 past the deadline, 499 when the client left, or the request's own.
    """
    left = asyncio.get_running_loop().create_task(_disconnected(request))
    timeout = state.limits.request_timeout_s
    try:
        done, _ = await asyncio.wait(
            {future, left}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        left.cancel()
    if future in done:
        return future.result()
    future.cancel()  # a request still waiting leaves the queue unrun
    if left in done:
        raise RequestError("the client closed the connection", 499)
    raise RequestError(f"no answer within {timeout:g} s", 504)


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _ready(state: ServerState) -> None:
    if not state.loaded:
        raise RequestError("the models are still loading", 503, {"Retry-After": "1"})


def _check_key(state: ServerState, given: Any) -> None:
    expected = state.limits.api_key
    if expected is None:
        return
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), expected.encode()):
        raise RequestError("Invalid API key", 403)


async def json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object, or a 400 naming what is wrong with it."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
    return body


async def _translate_fields(request: Request) -> dict[str, Any]:
    """LibreTranslate's fields from a JSON body or a form (``q`` may repeat in a form)."""
    content_type = request.headers.get("content-type", "")
    if "form" not in content_type:
        return await json_object(request)
    try:
        form = await request.form()
    except Exception as error:  # python-multipart's parse errors have no common base
        raise RequestError(f"the form could not be read: {error}") from None
    fields: dict[str, Any] = {key: form.get(key) for key in form}
    texts = form.getlist("q")
    if len(texts) > 1:
        fields["q"] = texts
    return fields


def _texts(q: Any) -> tuple[list[str], bool]:
    """``q`` as a list of texts, and whether it was one string."""
    if isinstance(q, str):
        return [q], True
    if isinstance(q, list) and all(isinstance(t, str) for t in q):
        return q, False
    if q is None:
        raise RequestError("Invalid request: missing q parameter")
    raise RequestError("q must be a string or a list of strings")


def _pair_model(state: ServerState, source: Any, target: Any) -> Batcher:
    """The model that translates ``source`` (or ``auto``) into ``target``."""
    for name, value in (("source", source), ("target", target)):
        if value is not None and not isinstance(value, str):
            raise RequestError(f"{name} must be a language code (a string)")
    batchers = _text_models(state)
    if not batchers:
        raise RequestError(_NO_TEXT_MODEL)
    if len(batchers) == 1:
        pair = batchers[0].served.pair
        # One model: source and target may be left out; a model without a pair takes any.
        if pair is None or (source is None and target is None):
            return batchers[0]
    if source in (None, "auto") and target is None:
        raise RequestError(f"give source and target; served pairs: {_pairs(state)}")
    found = [
        b
        for b in batchers
        if b.served.pair is not None
        and source in (None, "auto", b.served.pair[0])
        and target in (None, b.served.pair[1])
    ]
    if len(found) != 1:
        problem = "several models" if found else "no model"
        raise RequestError(
            f"{problem} translate {source or 'auto'} to {target or 'any language'}; "
            f"served pairs: {_pairs(state)}"
        )
    return found[0]


_NO_TEXT_MODEL = (
    "no model for text is served; Whisper models take audio on POST /v1/audio/transcriptions"
)


def _text_models(state: ServerState) -> list[Batcher]:
    """The models served for text: every one but the Whisper models."""
    return [b for name, b in state.batchers.items() if name not in state.transcribers]


def _pairs(state: ServerState) -> str:
    return ", ".join(n for n, b in state.batchers.items() if b.served.pair) or "none"


def _add_translate(app: FastAPI, state: ServerState) -> None:
    @app.post("/translate")
    async def translate(request: Request) -> JSONResponse:
        fields = await _translate_fields(request)
        _check_key(state, fields.get("api_key"))
        texts, single = _texts(fields.get("q"))
        if fields.get("format", "text") not in ("text", None):
            raise RequestError(f"format {fields['format']!r} is not served; give format text")
        _ready(state)
        batcher = _pair_model(state, fields.get("source"), fields.get("target"))
        # Blank texts are answered blank, as LibreTranslate does, without a model run.
        to_run = [i for i, text in enumerate(texts) if text.strip()]
        translated = [""] * len(texts)
        if to_run:
            inputs = await run_in_threadpool(batcher.served.encode, [texts[i] for i in to_run])
            result = await answer(state, request, batcher, inputs, {}, want_text=True)
            for i, own in zip(to_run, result.texts or [], strict=True):
                translated[i] = own[0]
        return JSONResponse({"translatedText": translated[0] if single else translated})

    @app.get("/languages")
    async def languages() -> JSONResponse:
        targets: dict[str, list[str]] = {}
        for batcher in state.batchers.values():
            if batcher.served.pair is not None:
                source, target = batcher.served.pair
                targets.setdefault(source, []).append(target)
        return JSONResponse(
            [
                {"code": code, "name": language_name(code), "targets": sorted(to)}
                for code, to in sorted(targets.items())
            ]
        )


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _named_model(state: ServerState, name: Any) -> Batcher:
    if name is None:
        # Left out: the only model for text (a Whisper model is named to be asked).
        text_models = _text_models(state)
        if len(text_models) == 1:
            return text_models[0]
        if not text_models:
            raise RequestError(_NO_TEXT_MODEL)
        raise RequestError(f"name a model; served: {', '.join(state.batchers)}")
    if not isinstance(name, str) or name not in state.batchers:
        raise RequestError(
            f"no model named {name!r}; served: {', '.join(state.batchers)}", status=404
        )
    return state.batchers[name]


def _add_generate(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _check_key(state, _bearer(request))
        listed = [{"id": name, "object": "model", "owned_by": "onnxmerge"} for name in state.paths]
        return JSONResponse({"object": "list", "data": listed})

    @app.post("/v1/generate")
    async def generate(request: Request) -> Response:
        _check_key(state, _bearer(request))
        body = await json_object(request)
        stream = body.pop("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be true or false")
        _ready(state)
        batcher = _named_model(state, body.pop("model", None))
        served = batcher.served
        text, ids = body.pop("text", None), body.pop("input_ids", None)
        if (text is None) == (ids is None):
            raise RequestError("give either text or input_ids")
        served.check_options(body)
        inputs: list[Any]
        if ids is not None:
            inputs = [served.check_ids(ids)]
        elif isinstance(text, str) and text:
            inputs = await run_in_threadpool(served.encode, [text])
        else:
            raise RequestError("text must be a non-empty string")
        if stream:
            return await stream_response(served, inputs[0], body, state.metrics)
        result = await answer(
            state, request, batcher, inputs, body, want_text=served.tokenizer is not None
        )
        rows = result.rows[0]
        texts: list[str | None] = (
            list(result.texts[0]) if result.texts is not None else [None] * len(rows)
        )
        if len(rows) == 1:
            return JSONResponse({"text": texts[0], "tokens": rows[0].tolist()})
        return JSONResponse({"text": texts, "tokens": [r.tolist() for r in rows]})


async def _speech_form(request: Request) -> tuple[dict[str, str], bytes]:
    """The transcription form's text fields and the uploaded file's bytes, or a 400 naming
    what is wrong with the form."""
    if "multipart/form-data" not in request.headers.get("content-type", ""):
        raise RequestError("send a multipart/form-data body with the audio in its file field")
    try:
        form = await request.form()
    except Exception as error:  # python-multipart's parse errors have no common base
        raise RequestError(f"the form could not be read: {error}") from None
    try:
        unknown = sorted(set(form) - set(SPEECH_FIELDS))
        if unknown:
            raise RequestError(f"fields {unknown} are not served; give {', '.join(SPEECH_FIELDS)}")
        upload = form.get("file")
        if upload is None:
            raise RequestError("missing file: send the audio in the form's file field")
        if not isinstance(upload, UploadFile):
            raise RequestError("file must be an uploaded file (a form part with a filename)")
        fields: dict[str, str] = {}
        for name in SPEECH_FIELDS[1:]:
            value = form.get(name)
            if isinstance(value, UploadFile):
                raise RequestError(f"{name} must be a text field, not a file")
            if value:  # an empty field is one left out
                fields[name] = value
        return fields, await upload.read()
    finally:
        await form.close()


def _decoded(data: bytes) -> tuple[np.ndarray, int]:
    """The upload as mono float PCM and its rate, as ``onnxmerge transcribe`` reads a file."""
    try:
        return read_wav(io.BytesIO(data), name="the uploaded file")
    except InvalidArgumentError as error:
        raise RequestError(str(error)) from None
    except Exception as error:  # whatever malformed bytes make the reader raise
        raise RequestError(
            f"the uploaded file could not be decoded as a PCM WAV file ({type(error).__name__})"
        ) from None


def _speech_model(state: ServerState, name: str | None) -> Transcriber:
    """The Whisper model a request names; left out, or OpenAI's ``whisper-1``, the only one."""
    speech = state.transcribers
    served = ", ".join(speech) or "none"
    if name is not None and name in state.batchers:
        if name not in speech:
            raise RequestError(f"model {name!r} is not a Whisper model; Whisper models: {served}")
        return speech[name]
    if name is not None and name != OPENAI_WHISPER:
        raise RequestError(f"no model named {name!r}; Whisper models: {served}", status=404)
    if len(speech) == 1:
        return next(iter(speech.values()))
    if not speech:
        raise RequestError("no Whisper model is served", status=404)
    raise RequestError(f"name a Whisper model; served: {served}")


def _add_transcriptions(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        _check_key(state, _bearer(request))
        fields, data = await _speech_form(request)
        response_format = fields.get("response_format", "json")
        if response_format not in ("json", "text"):
            raise RequestError(
                f"response_format {response_format!r} is not served; give json or text"
            )
        _ready(state)
        transcriber = _speech_model(state, fields.get("model"))
        if transcriber.served.tokenizer is None:
            raise RequestError(
                f"model {transcriber.served.name!r} has no tokenizer beside it to write its "
                "text with; save the Whisper tokenizer in the model's folder"
            )
        audio, rate = await run_in_threadpool(_decoded, data)
        options = {"language": fields["language"]} if "language" in fields else {}
        future = transcriber.submit(audio, rate, options)
        result = await wait_for(state, request, future)
        if response_format == "text":
            return PlainTextResponse(result.text)
        return JSONResponse({"text": result.text})
