"""The progress bar of `forklift run-batch` on stderr: requests done and output tok/s."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

from forklift.server.batch.records import output_tokens


class BatchProgress:
    def __init__(self, total: int, done: int, enabled: bool, out: TextIO = sys.stderr) -> None:
        self._bar = tqdm(
            total=total,
            initial=done,
            desc="Batch requests",
            unit="req",
            file=out,
            disable=not enabled,
            dynamic_ncols=True,
        )
        self._start = time.perf_counter()
        self.output_tokens = 0

    def record(self, record: dict[str, Any]) -> None:
        self.output_tokens += output_tokens(record)
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(f"output {self.output_tokens / elapsed:.1f} tok/s", False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
