"""AsyncEngine: one background thread steps the engine; asyncio callers get per-request streams.

The engine is not thread-safe, so only the engine thread touches it: callers enqueue "add"
and "abort" commands, which the thread applies between steps. Outputs travel back to each
caller's asyncio queue through its event loop. Torch releases the GIL inside its kernels, so
the HTTP event loop stays responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from forklift.config import EngineConfig
from forklift.core.input_processor import ProcessedPrompt, PromptType
from forklift.engine.engine import LLMEngine
from forklift.engine.lora_registry import LoRARegistry
from forklift.engine.timelines import FirstTokenTimelines
from forklift.lora_request import LoRARequest
from forklift.outputs import RequestOutput
from forklift.sampling_params import SamplingParams
from forklift.tokenizer import Tokenizer

T = TypeVar("T")

logger = logging.getLogger("forklift")


class EngineOverloadedError(Exception):
    """The waiting queue is full; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error."""


class EngineDrainingError(Exception):
    """The server is shutting down: it finishes what it has and takes nothing new."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Add:
    request_id: str
    prompt: ProcessedPrompt
    arrival_time: float | None
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_id: str


StepObserver = Callable[[LLMEngine, list[RequestOutput]], None]


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int | None = None,
        on_step: StepObserver | None = None,
        start_thread: bool = True,
    ) -> None:
        """`start_thread=False`: the caller runs the loop itself with `run_here()`."""
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.timelines = FirstTokenTimelines()
        self._on_step = on_step
        self._commands: deque[_Add | _Abort] = deque()
        self._calls: deque[tuple[Callable[[LLMEngine], Any], Future]] = deque()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._stopped = False
        self._accepting = True
        self._error: BaseException | None = None
        self._counter = 0
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="forklift-engine", daemon=True)
            self._thread.start()

    # ---- caller side (event loop) -----------------------------------------------------
    # What the engine was set up with: these objects stay the same while it runs (the
    # adapters' registry's contents change, on the engine thread).
    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> Tokenizer | None:
        """None for an engine started without a tokenizer."""
        return self.engine.tokenizer

    @property
    def loras(self) -> LoRARegistry | None:
        """The adapters' registry (None: LoRA is off)."""
        return self.engine.loras

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def new_request_id(self, prefix: str) -> str:
        with self._lock:
            self._counter += 1
            return f"{prefix}-{self._counter}"

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        """Check a request before `submit` (read-only: safe off the engine thread).

        Stricter than the offline engine: prompt plus max_tokens must fit in max_model_len
        (vLLM's server rule), where `LLMEngine` would stop the request at the limit."""
        return self.engine.input_processor.process(prompt, params, strict_context=True)

    def num_pending(self) -> int:
        """Requests accepted but not yet running: queued commands plus the engine's queue."""
        with self._lock:
            return self._num_pending_locked()

    def _num_pending_locked(self) -> int:
        queued = sum(isinstance(c, _Add) for c in self._commands)
        return queued + self.engine.stats().num_waiting

    def submit(
        self,
        requests: list[tuple[str, ProcessedPrompt]],
        arrival_time: float,
        lora_request: LoRARequest | None = None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Queue requests (all or none; each from `process`, all with `lora_request`'s
        adapter or none) and return one output stream per request.

        The waiting-queue check and the queueing happen under one lock, so a burst can never
        overshoot `max_waiting_requests`. Leaving a stream early aborts its request.
        """
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error}")
        if not self._accepting:
            raise EngineDrainingError("the server is shutting down and takes no new requests")
        loop = asyncio.get_running_loop()
        streams = []
        with self._lock:
            limit = self.max_waiting_requests
            if limit is not None and self._num_pending_locked() + len(requests) > limit:
                raise EngineOverloadedError(f"the waiting queue is full ({limit} requests)")
            for request_id, prompt in requests:
                stream = _Stream(loop, asyncio.Queue())
                self._streams[request_id] = stream
                self._commands.append(_Add(request_id, prompt, arrival_time, lora_request))
                streams.append(self._read(request_id, stream))
        self._wake.set()
        return streams

    async def _read(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._commands.append(_Abort(request_id))
        self._wake.set()

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run `fn(engine)` on the engine thread between two steps (also while paused).

        The way to touch engine state from outside: weights, the prefix cache, sleep."""
        future: Future[T] = Future()
        if self._error is not None:
            future.set_exception(EngineDeadError(f"the engine stopped: {self._error}"))
            return future
        with self._lock:
            self._calls.append((fn, future))
        self._wake.set()
        return future

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    def pause(self) -> None:
        """Stop stepping after the current step; requests keep queueing until `resume`.

        For callers that must hold the engine still (e.g. while swapping weights)."""
        self._unpaused.clear()
        self._wake.set()

    def resume(self) -> None:
        self._unpaused.set()
        self._wake.set()

    # ---- graceful shutdown ------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        return self._accepting

    def stop_accepting(self) -> None:
        """Refuse new requests from now on; those already queued or running carry on."""
        self._accepting = False

    def is_idle(self) -> bool:
        """No request is queued, running, or still being streamed to its caller."""
        with self._lock:
            return not self._streams and not any(isinstance(c, _Add) for c in self._commands)

    def failure(self) -> BaseException | None:
        """The error that stopped the engine thread, if one did."""
        return self._error

    def abort_all(self) -> int:
        """Abort every request (finish reason "abort"); returns how many. Resumes a paused
        engine so that the aborts, applied between steps, take effect."""
        with self._lock:
            ids = list(self._streams)
            self._commands.extend(_Abort(request_id) for request_id in ids)
        self.resume()
        return len(ids)

    def shutdown(self) -> None:
        self._stopped = True
        self._unpaused.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def run_here(self) -> None:
        """Run the engine loop in the calling thread until `shutdown()` (or a failure).

        `forklift serve` runs it on the main thread, the one that loaded the model: torch's
        OpenMP workers then belong to a single thread. A second thread running kernels
        makes the runtime see more busy threads than cores, and it stops spinning between
        parallel regions: a decode step on a 2-core CPU measured 20 ms on the loading thread
        and 42 ms on another one."""
        self._run()

    # ---- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._run_calls()
                if not self._unpaused.is_set():
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self._deliver(outputs)
                if self._on_step is not None:
                    self._on_step(self.engine, outputs)
        except BaseException as exc:  # surface the failure to every waiting caller
            logger.exception("engine loop failed")
            self._error = exc
            with self._lock:
                streams = list(self._streams.values())
            for stream in streams:
                stream.put(EngineDeadError(f"the engine stopped: {exc}"))
            with self._lock:
                calls = list(self._calls)
                self._calls.clear()
            for _, future in calls:
                future.set_exception(EngineDeadError(f"the engine stopped: {exc}"))

    def _run_calls(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    return
                fn, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:  # handed to the caller, the engine carries on
                future.set_exception(exc)

    def _apply_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                command = self._commands.popleft()
                stream = self._streams.get(command.request_id)
            if isinstance(command, _Abort):
                aborted = self.engine.abort_request(command.request_id)
                # A caller still reading (abort_all at shutdown) gets its "abort" output.
                self._deliver(aborted)
                if aborted and self._on_step is not None:
                    self._on_step(self.engine, aborted)
                continue
            if stream is None:  # the caller left before its request was queued
                continue
            try:
                self.engine.add_processed(
                    command.request_id, command.prompt, command.arrival_time, command.lora_request
                )
            except ValueError as exc:
                stream.put(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            targets = [(self._streams.get(o.request_id), o) for o in outputs]
            # Forget finished streams here too: one whose reader never started (its response
            # was dropped first) would otherwise stay registered.
            for output in outputs:
                if output.finished:
                    self._streams.pop(output.request_id, None)
        # One wake-up per event loop per step, not one per request: each call_soon_threadsafe
        # writes to the loop's self-pipe, and on two cores the woken loop competes with the
        # step's threads.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for stream, output in targets:
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(self._hand_over, items)

    def _hand_over(self, items: list[tuple[_Stream, RequestOutput]]) -> None:
        """On the streams' event loop: each output to its stream's queue; the first token's
        arrival here ends the request's first-token timeline."""
        now = time.time()
        for stream, output in items:
            try:
                metrics = output.metrics
                if metrics is not None and metrics.first_sent_time is None:
                    if any(c.token_ids for c in output.outputs):
                        metrics.first_sent_time = now
                if output.finished:
                    self.timelines.record(output)
            except Exception:  # bookkeeping must never keep an output from its stream
                logger.exception("first-token timeline of %s", output.request_id)
            stream.queue.put_nowait(output)
