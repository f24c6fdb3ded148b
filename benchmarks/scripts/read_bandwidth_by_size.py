"""Read bandwidth by buffer size: a sum over one float32 buffer, repeated, at 2 threads, for
sizes from what the last-level cache holds to far past it (where a decode step's 110 MB
lands). Writes benchmarks/<dir>/read-bandwidth.{md,json}.

Run: .venv/bin/python benchmarks/scripts/read_bandwidth_by_size.py [out_dir]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from results import command_line, write_results
from revision_build import ROOT

from forklift.bench.decode import read_bandwidth
from forklift.bench.report import cpu_flags

SIZES_MB = (32, 64, 80, 96, 104, 112, 120, 128, 192, 256, 512)
REPEATS = 30


def main() -> None:
    out_dir = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "benchmarks"
    torch.set_num_threads(2)
    rows = [{"megabytes": mb, "gb_per_s": read_bandwidth(mb * 2**20, REPEATS) / 1e9}
            for mb in SIZES_MB]  # fmt: skip
    report = {"cpu_flags": cpu_flags(), "threads": 2, "repeats": REPEATS, "rows": rows}
    lines = [
        "# Read bandwidth by buffer size",
        "",
        f"A sum over one float32 buffer (MiB), best of {REPEATS} repeats, 2 threads.",
        "",
        "| buffer (MiB) | GB/s |",
        "|---:|---:|",
        *(f"| {r['megabytes']} | {r['gb_per_s']:.1f} |" for r in rows),
        "",
    ]
    write_results(out_dir, "read-bandwidth", report, lines, command_line(__file__, out_dir))


if __name__ == "__main__":
    main()
