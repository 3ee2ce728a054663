"""A Ray session started for one operation ends with the process's signal handlers as they were:
``ray.init`` installs its own SIGTERM handler and ``ray.shutdown`` leaves it (a stand-in module
does what Ray does; tests/test_batch.py and tests/test_serve_ray.py start the real one)."""

from __future__ import annotations

import signal
import sys
import types

import pytest

from onnxmerge._ray_session import ray_session


def fake_ray(monkeypatch: pytest.MonkeyPatch, *, initialized: bool) -> list[tuple]:
    """A ``ray`` module whose ``init`` replaces SIGTERM's handler, as Ray's does; its calls."""
    calls: list[tuple] = []
    state = {"up": initialized}

    def init(address=None, **options):
        calls.append(("init", address, options))
        state["up"] = True
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))

    def shutdown():
        calls.append(("shutdown",))
        state["up"] = False

    module = types.ModuleType("ray")
    module.init = init
    module.shutdown = shutdown
    module.is_initialized = lambda: state["up"]
    monkeypatch.setitem(sys.modules, "ray", module)
    return calls


def test_a_session_it_started_ends_with_the_handlers_it_found(monkeypatch):
    calls = fake_ray(monkeypatch, initialized=False)
    before = signal.getsignal(signal.SIGTERM)
    with ray_session("auto", num_cpus=2) as started:
        assert started
        assert signal.getsignal(signal.SIGTERM) is not before  # Ray's, while it runs
    assert signal.getsignal(signal.SIGTERM) is before
    assert calls == [("init", "auto", {"num_cpus": 2}), ("shutdown",)]


def test_a_failure_inside_still_ends_the_session_and_restores(monkeypatch):
    calls = fake_ray(monkeypatch, initialized=False)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="conversion failed"):
        with ray_session(None):
            raise RuntimeError("conversion failed")
    assert signal.getsignal(signal.SIGTERM) is before
    assert calls[-1] == ("shutdown",)


def test_the_process_s_own_session_is_used_and_left_running(monkeypatch):
    calls = fake_ray(monkeypatch, initialized=True)
    with ray_session(None) as started:
        assert not started
    assert calls == []
