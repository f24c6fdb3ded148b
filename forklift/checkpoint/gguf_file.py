"""Opening a llama.cpp GGUF file: checked up front, so a bad file fails with its name."""

from __future__ import annotations

import functools
import mmap
from pathlib import Path

import gguf
import numpy as np

_GGUF_MAGIC = b"GGUF"


class _PlainArrayReader(gguf.GGUFReader):
    """GGUFReader that parses through a plain ndarray view of its memory map, and reads
    arrays of scalars or strings (a vocabulary) in one pass.

    Slicing an `np.memmap` goes through Python-level subclass hooks, and the generic reader
    recurses once per array element; the metadata of a model with a 49k-token vocabulary
    takes hundreds of thousands of slices. The fields come out as the generic reader builds
    them (one part per length and per value), in a tenth of the time.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._plain_data = mapped.view(np.ndarray)

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray], list[int], list[gguf.GGUFValueType]]:
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        data = self.data
        raw_item_type = data[orig_offs : orig_offs + 4].view(np.uint32)
        length = data[orig_offs + 4 : orig_offs + 12].view(np.uint64)
        item_type, count = gguf.GGUFValueType(int(raw_item_type[0])), int(length[0])
        scalar = self.gguf_scalar_to_np.get(item_type)
        if item_type != gguf.GGUFValueType.STRING and scalar is None:
            return super()._get_field_parts(orig_offs, raw_type)  # nested arrays
        types = [gguf.GGUFValueType.ARRAY] + ([item_type] if count else [])
        parts: list[np.ndarray] = [raw_item_type, length]
        offs = orig_offs + 12
        if scalar is not None:
            size = np.dtype(scalar).itemsize * count
            values = data[offs : offs + size].view(scalar)
            parts.extend(values[i : i + 1] for i in range(count))
            return 12 + size, parts, list(range(2, 2 + count)), types
        for _ in range(count):
            string_length = data[offs : offs + 8].view(np.uint64)
            end = offs + 8 + int(string_length[0])
            parts += (string_length, data[offs + 8 : end])
            offs = end
        return offs - orig_offs, parts, list(range(3, 3 + 2 * count, 2)), types


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open and validate a GGUF file; every failure is a `ValueError` naming the file."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"GGUF file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"GGUF path {path} is not a file")
    _check_magic(path)
    stat = path.stat()
    try:
        reader = _parse(str(path.resolve()), (stat.st_ino, stat.st_size, stat.st_mtime_ns,
                                              stat.st_ctime_ns))  # fmt: skip
    except Exception as exc:  # the reader fails with assorted numpy/enum/key errors
        raise ValueError(f"GGUF file {path} is truncated or corrupt: {exc}") from exc
    _check_tensor_extents(path, reader)
    return reader


@functools.lru_cache(maxsize=4)
def _parse(path: str, identity: tuple[int, ...]) -> gguf.GGUFReader:
    """Parsing a 49k-token vocabulary takes 1-2 s, so engines of one process (a test run,
    an engine rebuilt at sleep or in a benchmark) share a file's read-only parse. A file
    replaced or rewritten has another inode, size or change time (ctime, which no copy tool
    sets back) and is parsed afresh."""
    del identity  # only the cache key
    return _PlainArrayReader(path)


def _check_magic(path: Path) -> None:
    try:
        with path.open("rb") as handle:
            magic = handle.read(len(_GGUF_MAGIC))
    except OSError as exc:
        raise ValueError(f"cannot read GGUF file {path}: {exc}") from exc
    if magic != _GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (bad magic {magic!r})")


def _check_tensor_extents(path: Path, reader: gguf.GGUFReader) -> None:
    # The reader memory-maps the file, so a short file might only fail when data is touched.
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise ValueError(
                f"GGUF file {path} is truncated: tensor {tensor.name} ends at byte {end} "
                f"but the file has {size} bytes"
            )


def release_pages(reader: gguf.GGUFReader) -> None:
    """Let the kernel take back the file pages a load touched: the model holds its own copy
    of the weights, and the mapped file would count in the resident size again (the
    pages come back from the page cache if the file is read again)."""
    array = reader.data
    while array is not None and not isinstance(getattr(array, "_mmap", None), mmap.mmap):
        array = getattr(array, "base", None)
    mapped = getattr(array, "_mmap", None)
    if isinstance(mapped, mmap.mmap) and hasattr(mapped, "madvise"):
        mapped.madvise(mmap.MADV_DONTNEED)
