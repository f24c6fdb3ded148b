"""A git revision beside this tree: its native library built from its C sources (to compare
kernels side by side in one process), or a worktree of it (to run its forklift)."""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from forklift.native.build import compile_flags, find_compiler

ROOT = Path(__file__).resolve().parents[2]
CSRC = "forklift/native/csrc"


@contextmanager
def revision_worktree(revision: str) -> Iterator[Path]:
    """A git worktree of `revision` in a scratch folder while the block runs (a whole tree,
    for scripts that run a revision's forklift in processes of its own)."""
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), revision], cwd=ROOT,
                       check=True, capture_output=True)  # fmt: skip
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           check=False)  # fmt: skip


def checkout_sources(revision: str, into: Path) -> Path:
    """The revision's native sources (every file of its csrc folder, subfolders such as isa/
    included) written into `into`."""
    into.mkdir(parents=True)
    listing = ["git", "ls-tree", "-r", "--name-only", f"{revision}:{CSRC}"]
    names = subprocess.run(listing, cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout.split()  # fmt: skip
    for name in names:
        text = subprocess.run(["git", "show", f"{revision}:{CSRC}/{name}"], cwd=ROOT,
                              check=True, capture_output=True).stdout  # fmt: skip
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        (into / name).write_bytes(text)
    return into


def build_library(
    source_dir: Path, name: str, target: Path, arch: tuple[str, ...] | None = None
) -> ctypes.CDLL:
    """Library `name` (its .c file in `source_dir`) compiled into `target` for this CPU, or
    for the target flags `arch` where given (as forklift.native.build takes them)."""
    compiler = find_compiler()
    assert compiler is not None, "no C compiler"
    command = [compiler, *compile_flags(arch), "-o", str(target),
               str(source_dir / f"{name}.c"), "-lm"]  # fmt: skip
    subprocess.run(command, check=True)
    return ctypes.CDLL(str(target))


def step_libraries(revision: str, scratch: Path) -> dict[str, ctypes.CDLL]:
    """The native step library built from `revision`'s sources and from this tree's, keyed
    by the revision and by "this tree" (sources and libraries written into `scratch`)."""
    base = checkout_sources(revision, scratch / "base")
    return {
        revision: build_library(base, "decode_step", scratch / "base.so"),
        "this tree": build_library(ROOT / CSRC, "decode_step", scratch / "tree.so"),
    }


def run_in_tree(tree: Path, code: str, *arguments: str) -> dict:
    """`python -c code arguments` with `tree` first on PYTHONPATH (and as the working
    folder): the JSON object the code prints on its line starting "RESULT "."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", code, *arguments], cwd=tree, env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def ab_row(pairs: list[dict], key: str, higher_is_better: bool) -> str:
    """One report cell set for measure `key` over rounds of {"baseline": ..., "this": ...}:
    the two medians and the median (range) of each round's ratio, above 1 where this tree is
    faster (rates: this / baseline; times: baseline / this)."""
    base = statistics.median(p["baseline"][key] for p in pairs)
    this = statistics.median(p["this"][key] for p in pairs)
    ratios = [
        p["this"][key] / p["baseline"][key]
        if higher_is_better
        else p["baseline"][key] / p["this"][key]
        for p in pairs
    ]
    return (f"{base:.2f} | {this:.2f} | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip
