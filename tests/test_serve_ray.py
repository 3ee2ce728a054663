"""The server as a Ray Serve deployment: two replicas on a local Ray, asked over HTTP."""

from __future__ import annotations

import faulthandler
import shutil
import socket

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra")
pytest.importorskip("transformers", reason="text in, text out needs transformers")
pytest.importorskip("ray.serve", reason="serving on Ray needs Ray Serve")

from onnxmerge._ray_session import ray_session  # noqa: E402
from onnxmerge.demo import english_number, french_number  # noqa: E402
from onnxmerge.errors import InvalidArgumentError  # noqa: E402
from onnxmerge.serve import build_ray_app, deploy_on_ray, ray_application  # noqa: E402
from tests.test_serve import ask  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_bad_arguments_are_refused_before_ray_starts(tmp_path):
    with pytest.raises(InvalidArgumentError, match="replicas") as caught:
        ray_application({"fr-en": tmp_path}, replicas=0)
    assert caught.value.argument == "replicas"
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        ray_application({"fr-en": tmp_path / "missing.onnx"})
    with pytest.raises(InvalidArgumentError, match="unknown limits"):
        ray_application({"fr-en": tmp_path}, max_batch=4)
    with pytest.raises(InvalidArgumentError, match="max_queue"):
        ray_application({"fr-en": tmp_path}, max_queue=0)
    with pytest.raises(InvalidArgumentError, match="args.models"):
        build_ray_app({"replicas": 2})


def test_the_application_builder_takes_a_config_files_args(tmp_path):
    from ray import serve

    app = build_ray_app({"models": {"fr-en": str(tmp_path)}, "replicas": 3, "max_queue": 8})
    assert isinstance(app, serve.Application)
    with pytest.raises(InvalidArgumentError, match="batch_wait_ms"):
        build_ray_app({"models": {"fr-en": str(tmp_path)}, "batch_wait_ms": -1})


@pytest.mark.slow
def test_two_replicas_on_ray_answer_as_the_model_alone(demo_export, tmp_path):
    from ray import serve

    from onnxmerge import Seq2SeqModel, merge_seq2seq

    merged = merge_seq2seq(shutil.copytree(demo_export, tmp_path / "export"))
    texts = [french_number(n) for n in (21, 1984, 7, 5671)]
    alone = [Seq2SeqModel(merged).translate(text) for text in texts]
    assert alone[0] == english_number(21)
    # Ray Serve waits for replicas without a time limit: past 120 s, fail with the stacks.
    faulthandler.dump_traceback_later(120, exit=True)
    with ray_session(None, num_cpus=2, include_dashboard=False, log_to_driver=False):
        try:
            url = deploy_on_ray(
                {"fr-en": merged}, replicas=2, port=free_port(), num_cpus=1, batch_wait_ms=20
            )
            status = serve.status().applications["onnxmerge"]
            assert status.status == "RUNNING"
            assert status.deployments["onnxmerge"].replica_states == {"RUNNING": 2}
            assert ask(url, "/health").status == 200
            for text, expected in zip(texts, alone, strict=True):
                answer = ask(url, "/translate", {"q": text, "source": "fr", "target": "en"})
                assert (answer.status, answer.json()) == (200, {"translatedText": expected})
            answer = ask(url, "/translate", {"q": texts, "source": "fr", "target": "en"})
            assert answer.json() == {"translatedText": alone}
            answer = ask(url, "/translate", {"q": 5})
            assert answer.status == 400 and "error" in answer.json()
        finally:
            serve.shutdown()
            faulthandler.cancel_dump_traceback_later()


def test_cli_refuses_a_bad_replica_count_before_ray_starts(tmp_path, capsys):
    from onnxmerge.cli import ExitCode, main

    model = tmp_path / "model.onnx"
    model.write_bytes(b"")
    code = main(["serve", "--ray", "--replicas", "0", f"fr-en={model}"])
    assert code == ExitCode.ERROR
    assert "replicas must be a whole number of at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_serves_on_ray_until_sigterm(demo_export, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from onnxmerge import merge_seq2seq

    merged = merge_seq2seq(shutil.copytree(demo_export, tmp_path / "export"))
    port = free_port()
    env = {**os.environ, "RAY_ADDRESS": "local"}  # a Ray of its own, not one running here
    command = [sys.executable, "-m", "onnxmerge", "serve", "--ray", "--replicas", "1"]
    process = subprocess.Popen(
        [*command, "--port", str(port), f"fr-en={merged}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        url, deadline, answer = f"http://127.0.0.1:{port}", time.monotonic() + 80, None
        while time.monotonic() < deadline and process.poll() is None:
            try:
                answer = ask(url, "/translate", {"q": "vingt et un"}, timeout=5)
            except OSError:
                answer = None
            # Ray's proxy answers 404 until the application's route is up.
            if answer is not None and answer.status != 404:
                break
            time.sleep(0.5)
        assert answer is not None, process.stderr.read().decode()[-3000:] if process.stderr else ""
        assert (answer.status, answer.json()) == (200, {"translatedText": "twenty-one"})
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 143
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
