"""`forklift run-batch`: an OpenAI batch file through one engine, as vLLM's `run-batch`.

Each answer is appended to the output file as its request finishes (so in finishing order,
not input order); a rerun with the same output file skips the lines already answered."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from forklift.config import EngineConfig
from forklift.engine.async_engine import AsyncEngine
from forklift.engine.engine import LLMEngine
from forklift.server.batch.output_file import RecordWriter, read_finished
from forklift.server.batch.progress import BatchProgress
from forklift.server.batch.records import BatchLine, is_failure, output_tokens, read_batch
from forklift.server.batch.runner import run_lines
from forklift.server.limits import ServerLimits
from forklift.server.serving import ServerContext
from forklift.server.tools.parsers import make_parser


@dataclass
class Tally:
    """What this run answered; the clock starts once the model is loaded."""

    answered: int = 0
    failed: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0

    def add(self, record: dict[str, Any]) -> None:
        if is_failure(record):
            self.failed += 1
        else:
            self.answered += 1
        self.output_tokens += output_tokens(record)


@dataclass(frozen=True)
class RunBatchSummary:
    total: int
    # Lines answered by an earlier run of the same output file.
    skipped: int
    tally: Tally

    def line(self) -> str:
        t = self.tally
        rate = t.output_tokens / t.elapsed_s if t.elapsed_s > 0 else 0.0
        return (
            f"{t.answered} answered, {t.failed} failed, {self.skipped} already done "
            f"(of {self.total}); {t.output_tokens} output tokens, {rate:.1f} tok/s"
        )


def read_input(path: Path) -> list[BatchLine]:
    if not path.is_file():
        raise ValueError(f"--input: {path} is not a file")
    with path.open(encoding="utf-8") as lines:
        return read_batch(lines)


def run_batch(
    config: EngineConfig,
    input_path: Path,
    output_path: Path,
    served_model_name: str,
    tool_call_parser: str = "hermes",
    window: int | None = None,
    show_progress: bool = True,
    err: TextIO = sys.stderr,
) -> RunBatchSummary:
    """Answer every line of `input_path` not yet in `output_path`. `window`: requests in
    flight at once (default twice max_num_seqs, so the scheduler always has the next ones)."""
    make_parser(tool_call_parser)  # a bad name fails before the model loads
    if window is not None and window < 1:
        raise ValueError(f"--max-concurrent-requests must be at least 1, got {window}")
    items = read_input(input_path)
    finished = read_finished(output_path)
    pending = [item for item in items if item.key not in finished.keys]
    skipped = len(items) - len(pending)
    tally = Tally()
    if pending:
        _answer(
            config, pending, output_path, served_model_name, tool_call_parser,
            window or 2 * config.max_num_seqs,
            lambda: BatchProgress(len(items), skipped, show_progress, err),
            tally,
        )  # fmt: skip
    return RunBatchSummary(len(items), skipped, tally)


def _answer(
    config: EngineConfig,
    pending: list[BatchLine],
    output_path: Path,
    served_model_name: str,
    tool_call_parser: str,
    window: int,
    make_progress: Callable[[], BatchProgress],
    tally: Tally,
) -> None:
    engine = LLMEngine(config)
    progress = make_progress()  # after loading, so the rate counts answering time only
    start = time.perf_counter()
    # The engine loop keeps this thread, the one that loaded the model (see
    # AsyncEngine.run_here); the requests' event loop runs beside it.
    async_engine = AsyncEngine(engine, start_thread=False)
    ctx = ServerContext(async_engine, served_model_name, ServerLimits(), tool_call_parser)
    writer = RecordWriter(output_path)
    failure: list[BaseException] = []

    def emit(record: dict[str, Any]) -> None:
        writer.append(record)
        tally.add(record)
        progress.record(record)
        tally.elapsed_s = time.perf_counter() - start

    def run_requests() -> None:
        try:
            asyncio.run(run_lines(ctx, pending, emit, window))
        except BaseException as exc:  # handed to the main thread
            failure.append(exc)
        finally:
            async_engine.shutdown()

    requests = threading.Thread(target=run_requests, name="forklift-batch", daemon=True)
    requests.start()
    try:
        async_engine.run_here()
    finally:
        async_engine.shutdown()
        requests.join()
        writer.close()
        progress.close()
        engine.shutdown()
    engine_failure = async_engine.failure()
    if isinstance(engine_failure, KeyboardInterrupt):
        raise engine_failure
    if failure:
        raise failure[0]
