"""forklift's GGUF metadata reader gives the fields gguf's generic reader gives."""

from __future__ import annotations

import gguf
import numpy as np

from forklift.checkpoint.gguf_file import _PlainArrayReader


class _GenericParse(gguf.GGUFReader):
    """gguf's own parse, over the same plain view of the mapped file (the view changes no
    value, and spares seconds of memmap slicing)."""

    data = _PlainArrayReader.data


def _generic(path) -> gguf.GGUFReader:
    return _GenericParse(str(path))


def _assert_same_fields(path) -> None:
    fast, generic = _PlainArrayReader(str(path)), _generic(path)
    assert list(fast.fields) == list(generic.fields)
    for key, field in generic.fields.items():
        mine = fast.fields[key]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), key
        assert len(mine.parts) == len(field.parts), key
        for a, b in zip(mine.parts, field.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), key
        assert mine.contents() == field.contents(), key
    assert [(t.name, t.data_offset) for t in fast.tensors] == [
        (t.name, t.data_offset) for t in generic.tensors
    ]


def test_every_kind_of_array_reads_as_the_generic_reader_reads_it(tmp_path):
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", ["a", "", "späť", "<|im_end|>", "x" * 300])
    writer.add_array("test.empty", [])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("test.string", "scalar")
    writer.add_uint32("test.uint", 7)
    writer.add_tensor("t.weight", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_same_fields(path)


def test_the_default_models_vocabulary_reads_as_the_generic_reader_reads_it(default_source):
    _assert_same_fields(default_source.path)
