"""The HTTP server a user would write over CTranslate2, for ``bench_serve.py`` to load.

FastAPI and uvicorn, one ``ctranslate2.Translator`` with ``intra_threads`` threads, and a
batching worker like the one ``onnxmerge serve`` runs: concurrent requests wait at most
``--batch-wait-ms`` for company and run as one ``translate_batch`` of at most
``--max-batch-size`` inputs (off the event loop). It answers ``POST /v1/generate`` as
``onnxmerge serve`` does for ``input_ids`` (``{"tokens": [...]}``) and ``GET /health``.

``--probe-out FILE``: before serving, run the anchor check's work in this process
(``bench_ctranslate2.anchor_probe``) and write its times to FILE, so the benchmark can check
this process against CTranslate2's plain one-liner (``benchmarks/_anchor.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def token_id(name: str, config: dict) -> int:
    if name == "</s>":
        return int(config["eos_token_id"])
    if name == "<pad>":
        return int(config["pad_token_id"])
    return 1 if name == "<unk>" else int(name[1:])


def create_app(translator: Any, config: dict, max_batch_size: int, batch_wait_s: float) -> Any:
    from benchmarks.bench_ctranslate2 import token_name

    queue: asyncio.Queue = asyncio.Queue()

    def run_batch(batch: list[tuple[list[str], int]]) -> list[list[int]]:
        # CTranslate2 takes one decoding length per call: the batch's longest request.
        length = max(n for _, n in batch)
        results = translator.translate_batch(
            [tokens for tokens, _ in batch],
            beam_size=1,
            max_batch_size=max_batch_size,
            max_decoding_length=length,
            min_decoding_length=length,
        )
        return [[token_id(t, config) for t in r.hypotheses[0]] for r in results]

    async def worker() -> None:
        while True:
            batch = [await queue.get()]
            deadline = time.monotonic() + batch_wait_s
            while len(batch) < max_batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(queue.get(), left))
                except asyncio.TimeoutError:
                    break
            try:
                rows = await asyncio.to_thread(run_batch, [(t, n) for t, n, _ in batch])
            except Exception as error:  # answer every waiting request, keep serving
                for _, _, future in batch:
                    future.set_exception(error)
                continue
            for (_, _, future), row in zip(batch, rows, strict=True):
                future.set_result(row)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(worker())
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        tokens = [token_name(int(i), config) for i in body["input_ids"]]
        future = asyncio.get_running_loop().create_future()
        await queue.put((tokens, int(body.get("max_new_tokens", 32)), future))
        return JSONResponse({"tokens": await future})

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True, help="the converted CTranslate2 model folder")
    parser.add_argument("--config", required=True, help="JSON: vocab_size, pad and eos ids")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--probe-out", type=Path)
    parser.add_argument("--probe-repeats", type=int, default=5)
    args = parser.parse_args(argv)
    config = json.loads(args.config)
    if args.probe_out is not None:
        from benchmarks.bench_ctranslate2 import anchor_probe

        times = anchor_probe(args.path, config, args.probe_repeats, args.threads)
        args.probe_out.write_text(json.dumps(times), encoding="utf-8")
    import ctranslate2
    import uvicorn

    translator = ctranslate2.Translator(args.path, device="cpu", intra_threads=args.threads)
    app = create_app(translator, config, args.max_batch_size, args.batch_wait_ms / 1000)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
