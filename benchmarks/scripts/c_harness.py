"""Small C programs that time one kernel sequence in isolation (the AMX measurements): the
lines each begins with, and how one is built for this CPU and run."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from forklift.cpu import native_arch_flags
from forklift.native.build import find_compiler

# Headers, a monotonic clock in seconds, and AMX's tile configuration (64 bytes, as
# ldtilecfg reads it). A program asks for the tile state itself:
# syscall(SYS_arch_prctl, 0x1023, 18).
PRELUDE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;
"""


@contextmanager
def compiled(source: str, name: str, optimization: str) -> Iterator[Callable[..., float]]:
    """`source` (after PRELUDE) built for this CPU at `optimization` ("-O2", "-O3"); yields a
    function that runs it with the given arguments and returns the first number it prints."""
    compiler = find_compiler()
    assert compiler is not None, "no C compiler"
    with tempfile.TemporaryDirectory() as scratch:
        path, program = Path(scratch) / f"{name}.c", Path(scratch) / name
        path.write_text(PRELUDE + source)
        subprocess.run([compiler, optimization, *native_arch_flags(), "-o", str(program),
                        str(path)], check=True)  # fmt: skip

        def run(*arguments: object) -> float:
            command = [str(program), *(str(a) for a in arguments)]
            output = subprocess.run(command, check=True, capture_output=True, text=True)
            return float(output.stdout.split()[0])

        yield run
