"""Batches run in the background on the server's own engine, beside its other traffic.

validating -> in_progress -> finalizing -> completed, or failed (a bad input file);
cancelling -> cancelled. Answers are appended to files of the store as they finish; a
server stopped or killed mid-batch resumes it on its next start, skipping the lines
already answered."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from forklift.engine.async_engine import EngineDeadError, EngineDrainingError
from forklift.server.batch.file_store import FileStore
from forklift.server.batch.jobs import Batch, BatchStore, RequestCounts, not_found
from forklift.server.batch.output_file import FinishedRecords, RecordWriter, read_finished
from forklift.server.batch.records import BatchLine, is_failure, read_batch
from forklift.server.batch.runner import BatchInterrupted, run_lines
from forklift.server.endpoints import GENERATION_ENDPOINTS
from forklift.server.errors import APIError
from forklift.server.serving import ServerContext

logger = logging.getLogger("forklift")

# OpenAI's only window; batches here run at once and never expire.
COMPLETION_WINDOWS = ("24h",)
BATCH_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"
_MAX_METADATA_PAIRS = 16


class BatchService:
    def __init__(self, ctx: ServerContext, directory: Path) -> None:
        self.files = FileStore(directory / "files")
        self._store = BatchStore(directory / "batches")
        self._ctx = ctx
        # As many in flight as the engine runs at once: enough to keep it full, while other
        # traffic still finds room in the waiting queue.
        self._window = ctx.async_engine.config.max_num_seqs
        self._batches: dict[str, Batch] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        """Load every batch; resume those that were running when the server stopped."""
        for batch in await asyncio.to_thread(self._store.load_all):
            self._batches[batch.id] = batch
            if batch.status == "cancelling":
                self._end(batch, "cancelled")
            elif not batch.finished:
                logger.info("resuming batch %s (%s)", batch.id, batch.status)
                self._launch(batch)

    async def stop(self) -> None:
        """Stop running batches where they are; the next start resumes them."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
    ) -> Batch:
        if endpoint not in GENERATION_ENDPOINTS:
            known = ", ".join(GENERATION_ENDPOINTS)
            raise APIError(400, f"endpoint must be one of {known}, got {endpoint!r}", "endpoint")
        if completion_window not in COMPLETION_WINDOWS:
            message = f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}"
            raise APIError(400, f"{message}, got {completion_window!r}", "completion_window")
        if metadata is not None and len(metadata) > _MAX_METADATA_PAIRS:
            message = f"metadata has {len(metadata)} pairs, more than {_MAX_METADATA_PAIRS}"
            raise APIError(400, message, "metadata")
        try:
            source = self.files.get(input_file_id)
        except APIError as exc:
            exc.param = "input_file_id"
            raise
        if source.purpose != BATCH_PURPOSE:
            message = f"file {input_file_id} has purpose {source.purpose!r}, not 'batch'"
            raise APIError(400, message, "input_file_id")
        batch = Batch.new(endpoint, input_file_id, completion_window, metadata,
                          self.files.new_id(), self.files.new_id())  # fmt: skip
        self._store.save(batch)
        self._batches[batch.id] = batch
        self._launch(batch)
        return batch

    def get(self, batch_id: str) -> Batch:
        batch = self._batches.get(batch_id)
        if batch is None:
            raise not_found(batch_id)
        return batch

    def list(self) -> list[Batch]:
        """Newest first."""
        return sorted(self._batches.values(), key=lambda b: (b.created_at, b.id), reverse=True)

    def cancel(self, batch_id: str) -> Batch:
        batch = self.get(batch_id)
        if batch.finished or batch.status == "cancelling":
            message = f"batch {batch_id} is {batch.status}: only a running batch can be cancelled"
            raise APIError(409, message, "batch_id")
        batch.enter("cancelling")
        self._store.save(batch)
        task = self._tasks.get(batch_id)
        if task is not None:
            task.cancel()  # its requests are aborted; it ends as cancelled
        else:
            self._end(batch, "cancelled")
        return batch

    def using(self, file_id: str) -> Batch | None:
        """The unfinished batch that reads or writes this file, if any."""
        for batch in self._batches.values():
            if not batch.finished and file_id in (batch.input_file_id, batch.answers_file_id,
                                                  batch.errors_file_id):  # fmt: skip
                return batch
        return None

    def _launch(self, batch: Batch) -> None:
        task = asyncio.create_task(self._run(batch), name=f"forklift-{batch.id}")
        self._tasks[batch.id] = task

        def done(_: asyncio.Task[None]) -> None:
            self._tasks.pop(batch.id, None)
            if batch.status == "cancelling":
                self._end(batch, "cancelled")

        task.add_done_callback(done)

    async def _run(self, batch: Batch) -> None:
        try:
            lines = await asyncio.to_thread(self._read_input, batch)
        except ValueError as exc:
            batch.errors = [{"code": "invalid_input_file", "message": str(exc), "param": None,
                             "line": None}]  # fmt: skip
            self._end(batch, "failed")
            return
        answers_path = self.files.content_path(batch.answers_file_id)
        errors_path = self.files.content_path(batch.errors_file_id)
        finished = await asyncio.to_thread(_read_both, answers_path, errors_path)
        batch.request_counts = RequestCounts(len(lines), finished.completed, finished.failed)
        if batch.status == "validating":
            batch.enter("in_progress")
            self._store.save(batch)
        pending = [line for line in lines if line.key not in finished.keys]
        answers, errors = RecordWriter(answers_path), RecordWriter(errors_path)

        def emit(record: dict[str, Any]) -> None:
            if is_failure(record):
                errors.append(record)
                batch.request_counts.failed += 1
            else:
                answers.append(record)
                batch.request_counts.completed += 1

        try:
            await run_lines(self._ctx, pending, emit, self._window)
        except (EngineDrainingError, EngineDeadError, BatchInterrupted) as exc:
            logger.warning("batch %s stopped (%s); the next start resumes it", batch.id, exc)
            return
        finally:
            answers.close()
            errors.close()
        batch.enter("finalizing")
        self._store.save(batch)
        self._end(batch, "completed")

    def _read_input(self, batch: Batch) -> list[BatchLine]:
        path = self.files.content_path(batch.input_file_id)
        try:
            with path.open(encoding="utf-8") as text:
                lines = read_batch(text, batch.endpoint)
        except FileNotFoundError:
            raise ValueError(f"the input file {batch.input_file_id} was deleted") from None
        if not lines:
            raise ValueError(f"the input file {batch.input_file_id} holds no requests")
        return lines

    def _end(self, batch: Batch, status: str) -> None:
        """Publish what was written (the errors file only if it holds any) and save."""
        errors_path = self.files.content_path(batch.errors_file_id)
        if status != "failed":
            batch.output_file_id = self.files.publish(
                batch.answers_file_id, f"{batch.id}_output.jsonl", OUTPUT_PURPOSE
            ).id
        if errors_path.exists() and errors_path.stat().st_size > 0:
            batch.error_file_id = self.files.publish(
                batch.errors_file_id, f"{batch.id}_error.jsonl", OUTPUT_PURPOSE
            ).id
        batch.enter(status)
        self._store.save(batch)


def _read_both(answers: Path, errors: Path) -> FinishedRecords:
    return read_finished(errors, read_finished(answers))
