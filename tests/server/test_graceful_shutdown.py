"""`forklift serve` on SIGTERM: 503 for new requests, running ones finish within
--shutdown-timeout, the rest are aborted, exit 0; a second signal exits at once."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import httpx
import pytest
from server_harness import forklift_command, free_port
from tiny_models import make_tiny_model

BODY = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-shutdown")
    make_tiny_model("llama", directory)
    return directory


class Served:
    """A `forklift serve` subprocess on the tiny model, trainer routes on (loopback)."""

    def __init__(self, model: str, shutdown_timeout: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [
                *forklift_command(),
                "serve",
                "--model",
                model,
                "--served-model-name",
                "tiny",
                "--port",
                str(self.port),
                "--dtype",
                "float32",
                "--max-model-len",
                "128",
                "--kv-cache-memory-bytes",
                str(2**20),
                "--enable-trainer-routes",
                "--shutdown-timeout",
                str(shutdown_timeout),
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert "ready at" in self.process.stdout.readline()
        self.held: dict[str, httpx.Response] = {}

    def hold_a_request(self) -> threading.Thread:
        """Pause the engine and send a request, which then waits inside the server."""
        assert httpx.post(self.url + "/pause").status_code == 200

        def send() -> None:
            try:
                self.held["r"] = httpx.post(self.url + "/v1/completions", json=BODY, timeout=60)
            except httpx.HTTPError:  # the server was told to exit at once
                pass

        worker = threading.Thread(target=send)
        worker.start()
        time.sleep(0.5)
        assert worker.is_alive()
        return worker

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        self.process.stdout.close()
        self.process.stderr.close()


@pytest.fixture
def served(tiny_dir, request):
    server = Served(str(tiny_dir), request.param)
    yield server
    server.close()


def _until_status(url: str, method: str, status: int, **kwargs) -> httpx.Response:
    deadline = time.monotonic() + 10
    while True:
        response = httpx.request(method, url, timeout=10, **kwargs)
        if response.status_code == status or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


@pytest.mark.parametrize("served", [30.0], indirect=True)
def test_sigterm_refuses_new_requests_and_lets_running_ones_finish(served):
    worker = served.hold_a_request()
    served.process.send_signal(signal.SIGTERM)
    refused = _until_status(served.url + "/v1/completions", "POST", 503, json=BODY)
    assert refused.status_code == 503
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    assert "shutting down" in refused.json()["error"]["message"]
    assert httpx.get(served.url + "/health").status_code == 503
    assert served.process.poll() is None  # still draining
    assert httpx.post(served.url + "/resume").status_code == 200
    worker.join(timeout=30)
    finished = served.held["r"].json()["choices"][0]
    assert finished["finish_reason"] == "length"
    assert served.held["r"].json()["usage"]["completion_tokens"] == 8
    assert served.process.wait(timeout=30) == 0


@pytest.mark.parametrize("served", [1.0], indirect=True)
def test_requests_left_at_the_timeout_are_aborted_and_the_exit_is_clean(served):
    worker = served.hold_a_request()
    started = time.monotonic()
    served.process.send_signal(signal.SIGTERM)
    worker.join(timeout=30)
    assert time.monotonic() - started >= 0.9
    response = served.held["r"]
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "abort"
    assert served.process.wait(timeout=30) == 0


@pytest.mark.parametrize("served", [30.0], indirect=True)
def test_a_second_signal_exits_at_once(served):
    served.hold_a_request()
    served.process.send_signal(signal.SIGTERM)
    _until_status(served.url + "/health", "GET", 503)
    started = time.monotonic()
    served.process.send_signal(signal.SIGINT)
    code = served.process.wait(timeout=10)
    assert time.monotonic() - started < 5
    assert code == 128 + signal.SIGINT


class FakeTarget:
    """Stands in for an AsyncEngine or the data-parallel front end."""

    def __init__(self) -> None:
        self.accepting = True
        self.busy = True
        self.aborted = 0
        self.error: BaseException | None = None

    def stop_accepting(self) -> None:
        self.accepting = False

    def is_idle(self) -> bool:
        return not self.busy

    def abort_all(self) -> int:
        self.aborted += 1
        return 1

    def failure(self) -> BaseException | None:
        return self.error


def test_draining_server_waits_then_aborts_then_exits(monkeypatch):
    import asyncio
    import io

    import uvicorn

    from forklift.server import shutdown

    target = FakeTarget()
    server = shutdown.DrainingServer(uvicorn.Config(app=None), "ready", io.StringIO(), target, 0.2)
    tick = asyncio.run
    assert tick(server.on_tick(1)) is False  # serving as usual
    server.handle_exit(signal.SIGTERM, None)
    assert not target.accepting and not server.should_exit
    assert tick(server.on_tick(2)) is False and target.aborted == 0  # draining
    time.sleep(0.25)
    assert tick(server.on_tick(3)) is False and target.aborted == 1  # timeout: abort once
    assert tick(server.on_tick(4)) is False and target.aborted == 1
    target.busy = False
    assert tick(server.on_tick(5)) is True  # idle: uvicorn may close
    exits = []
    monkeypatch.setattr(shutdown.os, "_exit", exits.append)
    server.handle_exit(signal.SIGINT, None)
    assert exits == [128 + signal.SIGINT]


def test_a_dead_engine_makes_the_server_exit_non_zero():
    import asyncio
    import io

    import uvicorn

    from forklift.server import shutdown

    target = FakeTarget()
    server = shutdown.DrainingServer(uvicorn.Config(app=None), "ready", io.StringIO(), target, 5)
    assert asyncio.run(server.on_tick(1)) is False and not server.failed
    target.error = RuntimeError("tensor-parallel rank 1 exited with code -9")
    assert asyncio.run(server.on_tick(2)) is True  # uvicorn stops serving
    assert server.failed and not target.accepting
