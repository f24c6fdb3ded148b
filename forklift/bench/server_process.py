"""Start `forklift serve` as a child process on a free loopback port, and stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def forklift_server(extra_args: list[str], startup_timeout_s: float = 300.0) -> Iterator[str]:
    """Yields the base URL once /health answers; the server's log is shown if it fails."""
    with forklift_server_process(extra_args, startup_timeout_s) as (base_url, _):
        yield base_url


@contextmanager
def forklift_server_process(
    extra_args: list[str], startup_timeout_s: float = 300.0
) -> Iterator[tuple[str, int]]:
    """Like `forklift_server`, also yielding the server's process id (to watch its memory)."""
    port = free_loopback_port()
    command = [sys.executable, "-m", "forklift.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), *extra_args]
    with _running(
        command, f"http://127.0.0.1:{port}", startup_timeout_s, "forklift serve"
    ) as started:
        yield started


@contextmanager
def llama_server_process(
    binary: str,
    gguf: Path,
    threads: int,
    slots: int = 8,
    startup_timeout_s: float = 300.0,
    extra_args: list[str] | None = None,
    slot_tokens: int = 1024,
) -> Iterator[tuple[str, int]]:
    """llama.cpp's server on the same GGUF file, with the settings that are fair to it on a
    small CPU: `slots` continuous-batching slots of `slot_tokens` tokens each, no prompt cache
    in RAM, no flash attention (slower at depth on these CPUs), no web UI."""
    port = free_loopback_port()
    command = [
        binary, "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
        "-c", str(slot_tokens * slots), "-np", str(slots), "--cache-ram", "0", "-fa", "off",
        "--no-webui", "--host", "127.0.0.1", "--port", str(port), *(extra_args or []),
    ]  # fmt: skip
    with _running(
        command, f"http://127.0.0.1:{port}", startup_timeout_s, "llama-server"
    ) as started:
        yield started


@contextmanager
def shell_server_process(
    command: str, base_url: str, startup_timeout_s: float = 600.0
) -> Iterator[tuple[str, int]]:
    """A server that a shell command starts (a peer such as vLLM's, with its own engine
    processes), answering /health at `base_url`; stopped with every process it started."""
    with _running(
        command, base_url.rstrip("/"), startup_timeout_s, "the peer command", shell=True
    ) as started:
        yield started


@contextmanager
def _running(
    command: list[str] | str,
    base_url: str,
    startup_timeout_s: float,
    name: str,
    shell: bool = False,
) -> Iterator[tuple[str, int]]:
    with tempfile.TemporaryFile(mode="w+") as log:
        # Its own process group: stopping it stops what it started too.
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, shell=shell, start_new_session=True
        )
        try:
            _wait_healthy(process, base_url, startup_timeout_s, log, name)
            yield base_url, process.pid
        finally:
            _stop_group(process)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the group, 30 s for its leader to exit, then SIGKILL to whatever is left."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _wait_healthy(
    process: subprocess.Popen, base_url: str, timeout_s: float, log, name: str = "forklift serve"
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{log.read()}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} was not healthy after {timeout_s:.0f} s")
