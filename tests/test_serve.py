"""The HTTP server over loopback: a real uvicorn serving the merged demo model and the tiny
Whisper, asked with urllib as a client would ask it."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra")
pytest.importorskip("uvicorn", reason="the server needs the serve extra")
pytest.importorskip("prometheus_client", reason="the server needs the serve extra")
pytest.importorskip("transformers", reason="text in, text out needs transformers")

import uvicorn  # noqa: E402

from onnxmerge.demo import english_number, french_number  # noqa: E402
from onnxmerge.errors import InvalidArgumentError  # noqa: E402
from onnxmerge.serve import Server, create_app, models_from_arguments, run  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# Settings that make one request take long enough for others to pile up behind it.
SLOW = {"num_beams": 8, "min_new_tokens": 60, "max_new_tokens": 60}


class Answer:
    def __init__(self, status: int, headers: Any, body: bytes):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


def ask(
    url: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> Answer:
    """One request; JSON ``body`` is POSTed, ``raw`` bytes are POSTed as they are."""
    data = json.dumps(body).encode() if body is not None else raw
    request = urllib.request.Request(url + path, data=data, headers=headers or {})
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Answer(response.status, response.headers, response.read())
    except urllib.error.HTTPError as error:
        return Answer(error.code, error.headers, error.read())


def wait_healthy(url: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if ask(url, "/health", timeout=2).status == 200:
                return
        time.sleep(0.05)
    raise AssertionError(f"{url} was not healthy within {seconds} s")


@contextlib.contextmanager
def serving(models: dict[str, Path], **limits: Any) -> Iterator[str]:
    """A real uvicorn server on a port of 127.0.0.1 the system picks, in a thread."""
    with serving_app(create_app(models, **limits)) as url:
        yield url


@contextlib.contextmanager
def serving_app(app: Any) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = Server(config, drain_s=5)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_healthy(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def merged(demo_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from onnxmerge import merge_seq2seq

    folder = shutil.copytree(demo_export, tmp_path_factory.mktemp("demo") / "export")
    return merge_seq2seq(folder)


@pytest.fixture(scope="module")
def reference(merged: Path) -> Any:
    from onnxmerge import Seq2SeqModel

    return Seq2SeqModel(merged)


@pytest.fixture(scope="module")
def url(merged: Path, process_to_stop: Any) -> Iterator[str]:
    with serving({"fr-en": merged}, max_batch_size=16, batch_wait_ms=50) as served:
        yield served


def metric(text: str, name: str, labels: str | None = None) -> float:
    """The sum of a metric's samples named exactly ``name`` (with exactly ``labels``, or with
    any)."""
    label_part = r"(?:{[^}]*})?" if labels is None else re.escape("{" + labels + "}")
    pattern = re.compile(rf"^{re.escape(name)}{label_part} (\S+)$", re.M)
    return sum(float(value) for value in pattern.findall(text))


def batches_of_more_than_one(url: str) -> float:
    text = ask(url, "/metrics").body.decode()
    one = re.findall(
        r'^onnxmerge_serve_batch_size_bucket{le="1.0",model="fr-en"} (\S+)$', text, re.M
    )
    return metric(text, "onnxmerge_serve_batch_size_count") - float(one[0] if one else 0)


def test_translate_answers_a_string_and_a_list_as_each_text_alone(url, reference):
    answer = ask(url, "/translate", {"q": "vingt et un", "source": "fr", "target": "en"})
    assert answer.status == 200
    assert answer.json() == {"translatedText": "twenty-one"}
    texts = [french_number(n) for n in (243, 1984, 7, 5671)]
    answer = ask(url, "/translate", {"q": [*texts, " "], "source": "fr", "target": "en"})
    assert answer.status == 200
    alone = [reference.translate(text) for text in texts]
    assert alone[0] == english_number(243)
    assert answer.json() == {"translatedText": [*alone, ""]}


def test_translate_takes_a_form_and_leaves_out_the_pair_of_the_only_model(url):
    form = urllib.parse.urlencode({"q": "soixante et onze", "source": "fr", "target": "en"})
    answer = ask(
        url,
        "/translate",
        raw=form.encode(),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert (answer.status, answer.json()) == (200, {"translatedText": "seventy-one"})
    answer = ask(url, "/translate", {"q": "quatre-vingt-dix-sept"})
    assert (answer.status, answer.json()) == (200, {"translatedText": "ninety-seven"})
    answer = ask(url, "/translate", {"q": "dix-sept", "source": "auto", "target": "en"})
    assert (answer.status, answer.json()) == (200, {"translatedText": "seventeen"})


def test_concurrent_requests_are_batched_and_each_answered_as_alone(url, reference):
    numbers = [21 + 397 * i for i in range(16)]
    before = batches_of_more_than_one(url)

    def one(number: int) -> Answer:
        return ask(url, "/translate", {"q": french_number(number), "source": "fr", "target": "en"})

    with ThreadPoolExecutor(len(numbers)) as pool:
        answers = list(pool.map(one, numbers))
    assert [a.status for a in answers] == [200] * len(numbers)
    got = [a.json()["translatedText"] for a in answers]
    assert got == [reference.translate(french_number(n)) for n in numbers]
    assert batches_of_more_than_one(url) > before


def test_generate_gives_generates_tokens_for_text_ids_and_options(url, reference):
    ids = np.asarray([[33, 29, 56, 2, 24, 0]])  # "deux cent quarante-trois" (docs/runtime.md)
    answer = ask(url, "/v1/generate", {"text": "deux cent quarante-trois"})
    assert answer.status == 200, answer.body
    assert answer.json() == {
        "text": "two hundred forty-three",
        "tokens": reference.generate(ids)[0].tolist(),
    }
    four_beams = {"model": "fr-en", "input_ids": ids[0].tolist(), "num_beams": 4}
    answer = ask(url, "/v1/generate", four_beams)
    assert answer.status == 200, answer.body
    assert answer.json()["tokens"] == reference.generate(ids, num_beams=4)[0].tolist()
    answer = ask(url, "/v1/generate", {**four_beams, "num_return_sequences": 2})
    expected = reference.generate(ids, num_beams=4, num_return_sequences=2)
    assert len(answer.json()["text"]) == 2
    assert answer.json()["tokens"][0] == expected[0].tolist()


def streamed(url: str, body: dict) -> tuple[str, list[Any]]:
    """POST a streaming request; its content type and its events' data, parsed."""
    answer = ask(url, "/v1/generate", {**body, "stream": True})
    assert answer.status == 200, answer.body
    events = answer.body.decode().split("\n\n")
    assert events[-1] == ""  # every event ends with a blank line
    data = [e.removeprefix("data: ") for e in events[:-1]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert data[-1] == "[DONE]"
    return answer.headers["Content-Type"], [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize(
    "options", [{}, {"do_sample": True, "top_k": 20, "seed": 3}, {"num_beams": 3}]
)
@pytest.mark.parametrize("number", [7, 243, 9871])
def test_a_stream_s_pieces_joined_are_the_answer_without_streaming(url, number, options):
    body = {"text": french_number(number), **options}
    whole = ask(url, "/v1/generate", body).json()
    content_type, events = streamed(url, body)
    assert content_type.startswith("text/event-stream")
    assert "".join(e["text"] for e in events) == whole["text"] == english_number(number)
    assert [e["token"] for e in events] == whole["tokens"][1 : 1 + len(events)]
    assert len(events) == len(whole["tokens"]) - 1  # an event per new id: each ends on eos
    by_ids = {"input_ids": [33, 29, 56, 2, 24, 0], **options}
    _, events = streamed(url, by_ids)
    tokens = ask(url, "/v1/generate", by_ids).json()["tokens"]
    assert [e["token"] for e in events] == tokens[1 : 1 + len(events)]


def test_a_client_that_leaves_a_stream_stops_its_steps(merged):
    app = create_app({"fr-en": merged})
    with serving_app(app) as served:
        session = app.state.serve.batchers["fr-en"].served.model._session
        steps = [0]
        next_step = session.next_step

        def counted(*args: Any, **kwargs: Any) -> Any:
            steps[0] += 1
            return next_step(*args, **kwargs)

        session.next_step = counted
        host, port = served.removeprefix("http://").split(":")
        body = {"text": french_number(9871), "stream": True, **SLOW, "num_beams": 1}
        payload = json.dumps(body).encode()
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            connection.sendall(
                f"POST /v1/generate HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            received = b""
            while received.count(b"data: ") < 3:
                received += connection.recv(65536)
        time.sleep(0.5)
        after_leaving = steps[0]
        time.sleep(0.5)
        assert steps[0] == after_leaving < 20  # of the 60 the search would run
        assert ask(served, "/v1/generate", {"text": "un"}).json()["text"] == "one"


@pytest.mark.parametrize(
    ("path", "body", "status", "said"),
    [
        ("/translate", b'{"q": "un', 400, "not valid JSON"),
        ("/translate", b'["un"]', 400, "must be a JSON object"),
        ("/translate", b'{"source": "fr"}', 400, "missing q"),
        ("/translate", b'{"q": 5}', 400, "q must be a string or a list of strings"),
        ("/translate", b'{"q": "un", "source": "de", "target": "en"}', 400, "no model translate"),
        ("/translate", b'{"q": "un", "format": "html"}', 400, "format"),
        ("/translate", json.dumps({"q": " ".join(["mille"] * 80)}).encode(), 400, "positions"),
        ("/v1/generate", b"{", 400, "not valid JSON"),
        ("/v1/generate", b'{"text": "un", "beams": 4}', 400, "unknown options ['beams']"),
        ("/v1/generate", b'{"text": "un", "num_beams": "four"}', 400, "invalid generation"),
        ("/v1/generate", b'{"text": "un", "input_ids": [5]}', 400, "either text or input_ids"),
        ("/v1/generate", b'{"input_ids": [5, true]}', 400, "list of integers"),
        ("/v1/generate", b'{"input_ids": [5, 9999]}', 400, "token ids from 0"),
        ("/v1/generate", b'{"text": "un", "model": "/tmp/model.onnx"}', 404, "no model named"),
        ("/v1/generate", b'{"text": "un", "stream": "yes"}', 400, "stream must be true or false"),
        (
            "/v1/generate",
            b'{"text": "un", "stream": true, "num_beams": 2, "num_return_sequences": 2}',
            400,
            "one sequence",
        ),
    ],
)
def test_bad_requests_get_a_json_error_naming_the_problem(url, merged, path, body, status, said):
    answer = ask(url, path, raw=body, headers={"Content-Type": "application/json"})
    assert answer.status == status
    assert said in answer.json()["error"]
    assert str(merged.parent) not in answer.json()["error"]
    assert ask(url, "/health").status == 200


def test_unknown_paths_and_methods_get_a_json_error(url):
    missing = ask(url, "/v2/translate")
    assert (missing.status, missing.json()) == (404, {"error": "Not Found"})
    wrong_method = ask(url, "/translate")
    assert (wrong_method.status, wrong_method.json()) == (405, {"error": "Method Not Allowed"})
    text = ask(url, "/metrics").body.decode()
    assert 'onnxmerge_serve_requests_total{route="other",status="404"} 1.0' in text


def test_health_languages_and_metrics(url):
    health = ask(url, "/health")
    assert (health.status, health.json()) == (200, {"status": "ok", "models": ["fr-en"]})
    languages = ask(url, "/languages")
    assert languages.json() == [{"code": "fr", "name": "French", "targets": ["en"]}]
    assert ask(url, "/translate", {"q": "trois"}).status == 200
    text = ask(url, "/metrics").body.decode()
    for name in (
        "onnxmerge_serve_requests_total",
        "onnxmerge_serve_request_seconds_bucket",
        "onnxmerge_serve_new_tokens_total",
        "onnxmerge_serve_queue_depth",
        "onnxmerge_serve_batch_size_bucket",
    ):
        assert name in text
    assert 'onnxmerge_serve_requests_total{route="/translate",status="200"}' in text
    assert metric(text, "onnxmerge_serve_new_tokens_total") > 0


@pytest.fixture(scope="module")
def limited(merged: Path) -> Iterator[str]:
    limits = {"max_batch_size": 1, "batch_wait_ms": 0, "max_queue": 1, "max_body_bytes": 2000}
    with serving({"fr-en": merged}, api_key="secret", **limits) as served:
        yield served


def test_api_key_is_required_on_both_apis(limited):
    assert ask(limited, "/translate", {"q": "un"}).status == 403
    wrong = ask(limited, "/translate", {"q": "un", "api_key": "guess"})
    assert (wrong.status, wrong.json()) == (403, {"error": "Invalid API key"})
    right = ask(limited, "/translate", {"q": "un", "api_key": "secret"})
    assert (right.status, right.json()) == (200, {"translatedText": "one"})
    assert ask(limited, "/v1/generate", {"text": "un"}).status == 403
    bearer = {"Authorization": "Bearer secret"}
    assert ask(limited, "/v1/generate", {"text": "un"}, headers=bearer).json()["text"] == "one"


def test_a_body_past_the_limit_gets_413(limited):
    answer = ask(limited, "/translate", {"q": "un " * 1000, "api_key": "secret"})
    assert answer.status == 413
    assert "larger than 2000 bytes" in answer.json()["error"]
    assert ask(limited, "/translate", {"q": "un", "api_key": "secret"}).status == 200


def test_past_the_queue_requests_get_429_with_retry_after(limited, reference):
    ids = [33, 29, 56, 2, 24, 0]
    start = threading.Barrier(12)

    def one(_: int) -> Answer:
        start.wait(10)
        return ask(
            limited,
            "/v1/generate",
            {"input_ids": ids, **SLOW},
            headers={"Authorization": "Bearer secret"},
        )

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(one, range(12)))
    refused = [a for a in answers if a.status == 429]
    served = [a for a in answers if a.status == 200]
    assert len(refused) + len(served) == 12
    assert refused and served
    assert all(a.headers["Retry-After"] == "1" and "retry" in a.json()["error"] for a in refused)
    expected = reference.generate(np.asarray([ids]), **SLOW)[0].tolist()
    assert all(a.json()["tokens"] == expected for a in served)
    assert ask(limited, "/health").status == 200


def leave_after_sending(url: str, path: str, body: dict) -> None:
    """POST ``body`` on a raw connection and close it without reading the answer."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        time.sleep(0.2)  # read by the server, waiting for company in a forming batch


def test_requests_past_their_deadline_or_left_by_their_client_leave_their_batch_unrun(merged):
    limits = {"max_batch_size": 4, "batch_wait_ms": 3000, "request_timeout_s": 0.5}
    with serving({"fr-en": merged}, **limits) as served:
        alone = ask(served, "/translate", {"q": "deux"})  # waits for company past its deadline
        assert alone.status == 504
        assert alone.json() == {"error": "no answer within 0.5 s"}
        leave_after_sending(served, "/translate", {"q": "trois"})
        for _ in range(200):
            text = ask(served, "/metrics").body.decode()
            if 'route="/translate",status="499"' in text:
                break
            time.sleep(0.01)
        texts = [french_number(n) for n in (2, 3, 4, 5)]
        full = ask(served, "/translate", {"q": texts})  # a full batch runs at once
        assert full.json() == {"translatedText": ["two", "three", "four", "five"]}
        text = ask(served, "/metrics").body.decode()
        assert metric(text, "onnxmerge_serve_batch_size_count") == 1
        assert 'onnxmerge_serve_requests_total{route="/translate",status="504"} 1.0' in text
        assert 'onnxmerge_serve_requests_total{route="/translate",status="499"} 1.0' in text


def test_a_client_that_leaves_a_running_batch_takes_its_rows_out_at_the_next_step(
    merged, reference
):
    app = create_app({"fr-en": merged}, max_batch_size=2, batch_wait_ms=5000)
    with serving_app(app) as served:
        session = app.state.serve.batchers["fr-en"].served.model._session
        rows: list[int] = []
        stepping, left = threading.Event(), threading.Event()
        next_step = session.next_step

        def held(tokens: Any, *args: Any, **kwargs: Any) -> Any:
            rows.append(len(tokens))
            if len(rows) == 1:  # the batch's first cached step waits for the client to leave
                stepping.set()
                left.wait(10)
            return next_step(tokens, *args, **kwargs)

        session.next_step = held
        ids = [33, 29, 56, 2, 24, 0]  # "deux cent quarante-trois"
        options = {"min_new_tokens": 12, "max_new_tokens": 12}
        host, port = served.removeprefix("http://").split(":")
        payload = json.dumps({"input_ids": ids, **options}).encode()
        with ThreadPoolExecutor(1) as pool:
            with socket.create_connection((host, int(port)), timeout=10) as leaving:
                leaving.sendall(
                    f"POST /v1/generate HTTP/1.1\r\nHost: {host}\r\n"
                    "Content-Type: application/json\r\n"
                    f"Content-Length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                staying = pool.submit(ask, served, "/v1/generate", {"input_ids": ids, **options})
                assert stepping.wait(10)
            for _ in range(500):  # the server sees the client leave
                if 'status="499"' in ask(served, "/metrics").body.decode():
                    break
                time.sleep(0.01)
            left.set()
            answer = staying.result(30)
        expected = reference.generate(np.asarray([ids]), **options)[0].tolist()
        assert answer.status == 200 and answer.json()["tokens"] == expected
        assert rows[0] == 2 and set(rows[1:]) == {1}  # one row from the next step on
        assert len(rows) == len(expected) - 2  # the first step and the last token run none


def test_a_batch_that_fails_answers_500_and_the_worker_goes_on(merged):
    app = create_app({"fr-en": merged})
    with serving_app(app) as served:
        model = app.state.serve.batchers["fr-en"].served.model
        original = model.generate_many

        def fails_once(inputs: Any, **options: Any) -> Any:
            if inputs:  # not the check of the options, which passes no inputs
                model.generate_many = original
                raise RuntimeError("out of memory")
            return original(inputs, **options)

        model.generate_many = fails_once
        failed = ask(served, "/translate", {"q": "six"})
        assert (failed.status, failed.json()) == (
            500,
            {"error": "generation failed (RuntimeError)"},
        )
        assert ask(served, "/translate", {"q": "six"}).json() == {"translatedText": "six"}


def test_a_request_that_fails_its_batch_fails_alone(merged, reference):
    from onnxmerge.errors import GenerationError

    app = create_app({"fr-en": merged}, max_batch_size=2, batch_wait_ms=2000)
    bad_id = 77
    with serving_app(app) as served:
        model = app.state.serve.batchers["fr-en"].served.model
        original = model.generate_many

        def refuses_one_id(inputs: Any, **options: Any) -> Any:
            inputs = list(inputs)
            ids = [i["input_ids"] if isinstance(i, dict) else i for i in inputs]
            if any(bad_id in row for row in ids):
                raise GenerationError(f"id {bad_id} refused")
            return original(inputs, **options)

        model.generate_many = refuses_one_id
        bodies = [{"text": "vingt et un"}, {"input_ids": [5, bad_id, 0]}]
        with ThreadPoolExecutor(2) as pool:
            good, bad = pool.map(lambda body: ask(served, "/v1/generate", body), bodies)
        assert (bad.status, bad.json()) == (400, {"error": f"id {bad_id} refused"})
        assert good.status == 200 and good.json()["text"] == "twenty-one"
        text = ask(served, "/metrics").body.decode()
        # One batch of both, then each alone.
        assert metric(text, "onnxmerge_serve_batch_size_count") == 3
        assert metric(text, "onnxmerge_serve_batch_size_sum") == 4


@pytest.fixture(scope="module")
def process_to_stop(merged: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """``run()`` in a process of its own, on a socket bound here. Started with the module's
    first server, so that its imports overlap the other tests."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    script = (
        "import signal, socket, sys\n"
        "from onnxmerge.serve import run\n"
        "sock = socket.socket(fileno=int(sys.argv[2]))\n"
        "ended = run({'fr-en': sys.argv[1]}, sock=sock, drain_s=20, log_level='warning')\n"
        "sys.exit(0 if ended == signal.SIGTERM else 1)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(merged), str(sock.fileno())],
        pass_fds=[sock.fileno()],
        cwd=REPO,
    )
    sock.close()
    try:
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_sigterm_drains_the_requests_in_flight_and_exits(process_to_stop, reference):
    process, url = process_to_stop
    wait_healthy(url)
    texts = [french_number(n) for n in range(1000, 3000)]
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(ask, url, "/translate", {"q": texts}, timeout=60)
        for _ in range(400):
            if metric(ask(url, "/metrics").body.decode(), "onnxmerge_serve_requests_in_flight"):
                break
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        for _ in range(100):
            health = ask(url, "/health")
            if health.status == 503:
                break
            time.sleep(0.01)
        assert health.json() == {"status": "draining"}
        refused = ask(url, "/translate", {"q": "un"})
        assert refused.status == 503
        assert refused.json() == {"error": "the server is shutting down"}
        answer = in_flight.result(60)
    assert answer.status == 200
    got = answer.json()["translatedText"]
    assert len(got) == len(texts) and got[::400] == reference.translate(texts[::400])
    assert process.wait(30) == 0


def test_a_model_that_does_not_load_stops_run_with_its_error(tmp_path):
    from onnxmerge.errors import InvalidMergedModelError

    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"not a model")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    with sock, pytest.raises(InvalidMergedModelError, match="Protobuf parsing failed"):
        run({"fr-en": bad}, sock=sock, log_level="critical")


def test_without_the_serve_extra_the_import_says_what_to_install():
    hide = "import sys; sys.modules['uvicorn'] = None\n"
    result = subprocess.run(
        [sys.executable, "-c", hide + "import onnxmerge.serve"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "MissingDependencyError" in result.stderr
    assert "pip install 'onnxmerge[serve]'" in result.stderr


def test_model_arguments_take_a_name_or_the_folder_s(tmp_path, merged):
    assert models_from_arguments(["fr-en=a/model.onnx", str(merged)]) == {
        "fr-en": Path("a/model.onnx"),
        merged.parent.name: merged,
    }
    assert models_from_arguments([str(merged.parent)]) == {merged.parent.name: merged.parent}
    with pytest.raises(InvalidArgumentError, match="two models are named 'x'"):
        models_from_arguments(["x=a.onnx", "x=b.onnx"])


def test_bad_arguments_are_refused_before_anything_loads(tmp_path, merged):
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        create_app({"fr-en": tmp_path / "missing.onnx"})
    with pytest.raises(InvalidArgumentError, match="model name"):
        create_app({"fr en": merged})
    with pytest.raises(InvalidArgumentError, match="max_queue"):
        create_app({"fr-en": merged}, max_queue=0)
    with pytest.raises(InvalidArgumentError, match="unknown limits"):
        run({"fr-en": merged}, max_queues=3)
    with pytest.raises(InvalidArgumentError, match="threads must be a whole number"):
        create_app({"fr-en": merged}, threads=0)
    with pytest.raises(InvalidArgumentError, match="is a file; give a folder"):
        create_app({"fr-en": merged}, session_cache=merged)
    with pytest.raises(InvalidArgumentError, match="session_cache must be a folder's path"):
        create_app({"fr-en": merged}, session_cache=3)


def test_the_session_cache_is_kept_as_an_absolute_path(tmp_path, monkeypatch):
    from onnxmerge.serve._limits import Limits

    monkeypatch.chdir(tmp_path)
    assert Limits(session_cache=Path("cache")).session_cache == str(tmp_path / "cache")
    assert Limits().session_cache is None


def test_the_command_serves_a_pair_and_exits_143_on_sigterm(merged):
    with socket.socket() as probe:  # a free port; the command binds it itself
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "onnxmerge", "serve", f"fr-en={merged}", "--port", str(port)]
    process = subprocess.Popen(command + ["--log-level", "warning"], cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        answer = ask(url, "/translate", {"q": "deux", "source": "fr", "target": "en"})
        assert answer.json() == {"translatedText": "two"}
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 143  # the CLI's documented code for SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_the_command_refuses_bad_threads_before_loading_anything(tmp_path, value):
    # A model that does not exist: past the options, the command would refuse it (exit 3).
    missing = tmp_path / "missing.onnx"
    command = [sys.executable, "-m", "onnxmerge", "serve", f"fr-en={missing}", "--threads", value]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2  # the CLI's code for a bad argument
    assert f"--threads: must be at least 1, got {value}" in result.stderr
    assert "Traceback" not in result.stderr


# -- Whisper: OpenAI's POST /v1/audio/transcriptions ---------------------------------------------

RATE = 16_000
# Whisper's timestamp fields for the tiny vocabulary (see tests/test_runtime_longform.py).
WHISPER_TIMESTAMPS = {
    "no_timestamps_token_id": 94,
    "begin_suppress_tokens": [2],
    "suppress_tokens": [1],
}
BEARER = {"Authorization": "Bearer secret"}


def word_tokenizer(size: int) -> Any:
    """A tokenizer of ``size`` made-up words, one per id, so that segments decode to text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w3"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core)


@pytest.fixture(scope="module")
def whisper(tiny_export: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Whisper merged, with the timestamp fields long-form decoding needs and a
    tokenizer beside it."""
    from onnxmerge import merge_seq2seq

    folder = tmp_path_factory.mktemp("whisper")
    export = shutil.copytree(tiny_export("whisper").onnx_dir, folder / "export")
    config_path = export / "generation_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, **WHISPER_TIMESTAMPS}))
    merged = merge_seq2seq(export, folder / "model.onnx")
    vocab = json.loads((export / "config.json").read_text())["vocab_size"]
    word_tokenizer(vocab).save_pretrained(folder)
    return merged


def wav(seconds: float, rate: int = RATE, channels: int = 1) -> tuple[bytes, np.ndarray]:
    """A 16-bit PCM WAV file's bytes, and the mono float PCM ``onnxmerge transcribe`` reads
    from it."""
    rng = np.random.default_rng(2)
    t = np.arange(int(seconds * rate)) / rate
    mono = 0.4 * np.sin(2 * np.pi * 330.0 * t) + 0.05 * rng.standard_normal(t.size)
    pcm = np.round(mono * 32767).astype(np.int16)
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(np.repeat(pcm[:, None], channels, axis=1).tobytes())
    return out.getvalue(), pcm.astype(np.float32) / 32768.0


def transcription(
    url: str,
    fields: dict[str, str],
    audio: bytes | None,
    headers: dict[str, str] | None = BEARER,
) -> Answer:
    """POST a multipart form as OpenAI's clients send it: the text fields, then ``file``."""
    boundary = "onnxmerge-test-boundary"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    ]
    if audio is not None:
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="speech.wav"\r\nContent-Type: audio/wav\r\n\r\n'.encode()
            + audio
            + b"\r\n"
        )
    parts.append(f"--{boundary}--\r\n".encode())
    content_type = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    return ask(
        url,
        "/v1/audio/transcriptions",
        raw=b"".join(parts),
        headers={**content_type, **(headers or {})},
    )


@pytest.fixture(scope="module")
def session_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("session-cache")


@pytest.fixture(scope="module")
def speech_app(merged: Path, whisper: Path, session_cache: Path) -> Any:
    return create_app(
        {"fr-en": merged, "tiny-whisper": whisper},
        api_key="secret",
        threads=1,
        max_body_bytes=250_000,
        session_cache=session_cache,
    )


@pytest.fixture(scope="module")
def speech_url(speech_app: Any) -> Iterator[str]:
    with serving_app(speech_app) as served:
        yield served


@pytest.fixture(scope="module")
def spoken(whisper: Path) -> tuple[bytes, str]:
    """A WAV file of 3 s (several windows of the tiny model) and its text as the library's
    ``transcribe`` gives it."""
    from onnxmerge import Seq2SeqModel
    from onnxmerge.runtime.speech import transcribe

    data, audio = wav(3.0, channels=2)  # stereo: channels averaged
    result = transcribe(Seq2SeqModel(whisper), audio, RATE)
    assert len(result.segments) > 1 and result.text
    return data, result.text


def test_a_wav_upload_is_answered_with_the_text_transcribe_gives(speech_url, spoken):
    data, text = spoken
    answer = transcription(speech_url, {"model": "whisper-1"}, data)  # OpenAI's model name
    assert (answer.status, answer.json()) == (200, {"text": text})
    answer = transcription(speech_url, {"model": "tiny-whisper", "language": ""}, data)
    assert (answer.status, answer.json()) == (200, {"text": text})
    plain = transcription(speech_url, {"response_format": "text"}, data)  # the only Whisper
    assert plain.status == 200
    assert plain.headers["Content-Type"].startswith("text/plain")
    assert plain.body.decode() == text
    metrics = ask(speech_url, "/metrics").body.decode()
    route = 'route="/v1/audio/transcriptions",status="200"'
    assert metric(metrics, "onnxmerge_serve_requests_total", route) >= 3
    assert metric(metrics, "onnxmerge_serve_new_tokens_total", 'model="tiny-whisper"') > 0


def test_threads_and_the_session_cache_reach_every_model_and_text_requests_need_no_model_name(
    speech_app, speech_url, session_cache
):
    batchers = speech_app.state.serve.batchers
    assert set(batchers) == {"fr-en", "tiny-whisper"}
    for batcher in batchers.values():
        options = batcher.served.model.session.get_session_options()
        assert options.intra_op_num_threads == 1
        # Each opened from its own entry of the one cache folder (the transcription tests
        # compare its answers with the text the model gives opened without it).
        assert batcher.served.model._session.opened.parent.parent == session_cache
    assert len(list(session_cache.iterdir())) == 2
    # The model for text is the only one: a request for text may leave it out.
    answer = ask(speech_url, "/translate", {"q": "deux", "api_key": "secret"})
    assert answer.json() == {"translatedText": "two"}
    answer = ask(speech_url, "/v1/generate", {"text": "un"}, headers=BEARER)
    assert answer.json()["text"] == "one"


def test_transcriptions_need_the_api_key_as_a_bearer_header(speech_url, spoken):
    data, text = spoken
    assert transcription(speech_url, {}, data, headers=None).status == 403
    wrong = transcription(speech_url, {}, data, headers={"Authorization": "Bearer guess"})
    assert (wrong.status, wrong.json()) == (403, {"error": "Invalid API key"})
    assert transcription(speech_url, {}, data).json() == {"text": text}


@pytest.mark.parametrize(
    ("fields", "audio", "status", "said"),
    [
        ({"model": "whisper-1"}, None, 400, "missing file"),
        ({}, b"RIFF, but not a wave", 400, "could not be read as a PCM WAV file"),
        ({}, b"", 400, "could not be read as a PCM WAV file"),
        ({}, wav(0.5, rate=8000)[0], 400, "sampled at 8000 Hz"),
        ({"model": "whisper-large-v3"}, wav(0.5)[0], 404, "no model named 'whisper-large-v3'"),
        ({"model": "fr-en"}, wav(0.5)[0], 400, "not a Whisper model"),
        ({"response_format": "srt"}, wav(0.5)[0], 400, "response_format 'srt' is not served"),
        ({"prompt": "Hello"}, wav(0.5)[0], 400, "fields ['prompt'] are not served"),
        ({"language": "xx"}, wav(0.5)[0], 400, "language 'xx'"),
    ],
)
def test_bad_transcription_requests_get_a_json_error_and_the_server_goes_on(
    speech_url, whisper, spoken, fields, audio, status, said
):
    answer = transcription(speech_url, fields, audio)
    assert answer.status == status, answer.body
    assert said in answer.json()["error"]
    assert str(whisper.parent) not in answer.json()["error"]
    data, text = spoken
    assert transcription(speech_url, {}, data).json() == {"text": text}


def test_transcription_bodies_other_than_a_small_form_are_refused(speech_url):
    big, _ = wav(8.0)  # 256,000 bytes of PCM, past the server's 250,000
    answer = transcription(speech_url, {}, big)
    assert answer.status == 413
    assert "larger than 250000 bytes" in answer.json()["error"]
    as_json = ask(speech_url, "/v1/audio/transcriptions", {"file": "a.wav"}, headers=BEARER)
    assert as_json.status == 400
    assert "multipart/form-data" in as_json.json()["error"]
    text = ask(speech_url, "/v1/generate", {"text": "un", "model": "tiny-whisper"}, headers=BEARER)
    assert text.status == 400
    assert "POST /v1/audio/transcriptions" in text.json()["error"]


def held(transcriber: Any) -> tuple[threading.Event, threading.Event]:
    """Make ``transcriber``'s worker wait, before each recording, until the second event is
    set; the first is set once it holds one."""
    holding, release = threading.Event(), threading.Event()
    run_one = transcriber._run

    def after_release(recording: Any) -> Any:
        holding.set()
        release.wait(30)
        return run_one(recording)

    transcriber._run = after_release
    return holding, release


def test_past_the_queue_transcriptions_get_429_and_past_the_deadline_504(whisper, spoken):
    data, text = spoken
    app = create_app({"w": whisper}, max_queue=1)
    with serving_app(app) as served, ThreadPoolExecutor(2) as pool:
        holding, release = held(app.state.serve.transcribers["w"])
        running = pool.submit(transcription, served, {}, data, None)
        assert holding.wait(30)
        waiting = pool.submit(transcription, served, {}, data, None)
        for _ in range(1000):  # until the second waits in the queue
            if metric(ask(served, "/metrics").body.decode(), "onnxmerge_serve_queue_depth"):
                break
            time.sleep(0.01)
        refused = transcription(served, {}, data, None)
        release.set()
        assert refused.status == 429 and refused.headers["Retry-After"] == "1"
        assert "retry later" in refused.json()["error"]
        assert running.result(60).json() == waiting.result(60).json() == {"text": text}
    app = create_app({"w": whisper}, request_timeout_s=0.5)
    with serving_app(app) as served:
        _, release = held(app.state.serve.transcribers["w"])
        late = transcription(served, {}, data, None)
        assert (late.status, late.json()) == (504, {"error": "no answer within 0.5 s"})
        release.set()  # the recording left: the worker drops it at its first window
        assert transcription(served, {}, data, None).json() == {"text": text}
