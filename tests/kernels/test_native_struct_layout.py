"""The ctypes structs of the native decode step (forklift/native/decode_step.py) restate C
structs by hand (csrc/decode_step.c, csrc/quant_matmul.h). A field added, dropped, moved or
retyped on one side only makes C read the wrong bytes without any error, so each mirror is
checked against the C compiler's own layout: one small program, built with the project's
compiler and flags, prints every struct's size and alignment and, for each field the ctypes
class names, its offset, size and kind of type. The C fields' names and order are read from
the preprocessed source, so a C field the ctypes class lacks shows up too (even one that
fits in padding and changes no size)."""

from __future__ import annotations

import ctypes
import re
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

import forklift
from forklift.native import build as native_build
from forklift.native.decode_step import (
    StepLayer,
    StepLinearLayer,
    StepLinearShape,
    StepLoRA,
    StepModel,
    StepQuantWeight,
    _StepGroup,
)

# Each ctypes mirror and the C typedef it restates; SOURCE defines or includes them all.
MIRRORS: dict[type[ctypes.Structure], str] = {
    StepQuantWeight: "QuantWeight",
    StepLoRA: "StepLoRA",
    StepLinearLayer: "LinearLayer",
    StepLinearShape: "LinearShape",
    StepLayer: "StepLayer",
    _StepGroup: "StepGroup",
    StepModel: "StepModel",
}
SOURCE = "decode_step.c"

# The kind the C program prints for a field's type (see _kind_macro).
_INT_KIND, _UINT_KIND, _FLOAT_KIND, _POINTER_KIND = "int", "uint", "float", "pointer"


@dataclass(frozen=True)
class Field:
    name: str
    offset: int
    size: int
    kind: str


@dataclass
class Layout:
    size: int
    alignment: int
    fields: list[Field]
    declared: list[str]  # every field the C struct declares, in order


def _kind_macro() -> str:
    """KIND(x): the C type of x as one word (or a mirrored struct's name, or a pointer to
    one), comparable to what `_expected_kind` derives from the ctypes field."""
    integers = ("char", "short", "int", "long", "long long")
    kinds = [f'signed {t}: "{_INT_KIND}"' for t in integers]
    kinds += [f'unsigned {t}: "{_UINT_KIND}"' for t in integers]
    kinds += [f'{t}: "{_FLOAT_KIND}"' for t in ("float", "double", "long double")]
    kinds += ['char: "char"', '_Bool: "bool"']
    for name in MIRRORS.values():
        kinds += [f'{name}: "{name}"', f'{name} *: "{name} *"', f'const {name} *: "{name} *"']
    # 5 is pointer_type_class in GCC's and Clang's __builtin_classify_type.
    default = f'__builtin_classify_type(x) == 5 ? "{_POINTER_KIND}" : "other"'
    return f"#define KIND(x) _Generic((x), {', '.join(kinds)}, default: {default})"


def _program() -> str:
    lines = [
        "#include <stddef.h>",
        "#include <stdio.h>",
        f'#include "{SOURCE}"',
        _kind_macro(),
        "#define MEMBER(T, f) (((T *)0)->f)",  # unevaluated: sizeof and _Generic only
        "int main(void) {",
    ]
    for mirror, c_name in MIRRORS.items():
        lines.append(
            f'    printf("struct\\t{c_name}\\t%zu\\t%zu\\n", sizeof({c_name}), _Alignof({c_name}));'
        )
        # A ctypes field that C lacks stops the compile here, naming the field.
        for name, *_ in mirror._fields_:
            lines.append(
                f'    printf("field\\t{c_name}\\t{name}\\t%zu\\t%zu\\t%s\\n", '
                f"offsetof({c_name}, {name}), sizeof(MEMBER({c_name}, {name})), "
                f"KIND(MEMBER({c_name}, {name})));"
            )
    lines += ["    return 0;", "}", ""]
    return "\n".join(lines)


def _declared_fields(preprocessed: str, c_name: str) -> list[str]:
    """The field names `typedef struct { ... } c_name;` declares, in order. Refuses what it
    does not parse (nested structs, bit-fields, function pointers) rather than guess."""
    match = re.search(r"typedef\s+struct\s*\w*\s*\{([^{}]*)\}\s*" + c_name + r"\s*;", preprocessed)
    assert match, f"no plain `typedef struct {{ ... }} {c_name};` in {SOURCE} and its headers"
    names = []
    for declaration in filter(None, (d.strip() for d in match.group(1).split(";"))):
        assert not re.search(r"[(){}:]", declaration), f"{c_name}: cannot parse {declaration!r}"
        first, *rest = (part.strip() for part in declaration.split(","))
        head = re.fullmatch(r".*?[\s*](\w+)\s*(\[[^\]]*\])?", first, re.DOTALL)
        assert head, f"{c_name}: cannot parse {declaration!r}"
        names.append(head.group(1))
        for part in rest:
            more = re.fullmatch(r"[\s*]*(\w+)\s*(\[[^\]]*\])?", part)
            assert more, f"{c_name}: cannot parse {declaration!r}"
            names.append(more.group(1))
    return names


@pytest.fixture(scope="module")
def c_layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Layout]:
    """Every mirrored struct as the C compiler lays it out: one compile, one run."""
    compiler = native_build.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    work = tmp_path_factory.mktemp("struct_layout")
    source = work / "layout.c"
    source.write_text(_program())
    # The kernels' flags (same target, same macros), for an executable; -O0 as layout does
    # not depend on optimisation and decode_step.c takes seconds at -O3.
    flags = [flag for flag in native_build.compile_flags() if flag != "-shared"]
    include = ["-I", str(native_build.NATIVE_SOURCE_DIR)]
    done = subprocess.run([compiler, *flags, "-O0", *include, "-E", "-P", str(source)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    preprocessed = done.stdout
    binary = work / "layout"
    done = subprocess.run([compiler, *flags, "-O0", *include, "-o", str(binary), str(source),
                           "-lm"], capture_output=True, text=True, timeout=120)  # fmt: skip
    # The error lines name the ctypes field C lacks; the include chain above them does not.
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 0, "\n".join(errors) or done.stderr
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60, check=True)
    layouts: dict[str, Layout] = {}
    for line in done.stdout.splitlines():
        what, c_name, *values = line.split("\t")
        if what == "struct":
            size, alignment = map(int, values)
            layouts[c_name] = Layout(size, alignment, [], _declared_fields(preprocessed, c_name))
        else:
            name, offset, size, kind = values
            layouts[c_name].fields.append(Field(name, int(offset), int(size), kind))
    return layouts


def _expected_kind(field_type: type) -> str:
    """What KIND prints for the C type a ctypes field type stands for."""
    if field_type in MIRRORS:
        return MIRRORS[field_type]
    if issubclass(field_type, ctypes._Pointer) and field_type._type_ in MIRRORS:
        return f"{MIRRORS[field_type._type_]} *"
    if field_type in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(field_type, ctypes._Pointer):
        return _POINTER_KIND
    if field_type in (ctypes.c_float, ctypes.c_double, ctypes.c_longdouble):
        return _FLOAT_KIND
    if issubclass(field_type, ctypes._SimpleCData) and isinstance(field_type(-1).value, int):
        return _INT_KIND if field_type(-1).value < 0 else _UINT_KIND
    raise TypeError(f"no C kind known for {field_type!r}: teach _expected_kind")


def _ctypes_fields(mirror: type[ctypes.Structure]) -> list[Field]:
    fields = []
    for name, field_type, *_ in mirror._fields_:
        descriptor = getattr(mirror, name)
        kind = _expected_kind(field_type)
        fields.append(Field(name, descriptor.offset, descriptor.size, kind))
    return fields


def test_every_ctypes_struct_is_checked() -> None:
    """A ctypes struct added anywhere in the package must join MIRRORS (or this test)."""
    package = Path(forklift.__file__).parent
    pattern = re.compile(r"^class\s+(\w+)\((?:ctypes\.)?(?:Structure|Union)\)", re.MULTILINE)
    found = {name for path in package.rglob("*.py") for name in pattern.findall(path.read_text())}
    assert found == {mirror.__name__ for mirror in MIRRORS}


@pytest.mark.parametrize("mirror", list(MIRRORS), ids=lambda mirror: mirror.__name__)
def test_ctypes_struct_matches_c_layout(
    mirror: type[ctypes.Structure], c_layouts: dict[str, Layout]
) -> None:
    c_name = MIRRORS[mirror]
    c = c_layouts[c_name]
    assert [name for name, *_ in mirror._fields_] == c.declared, f"{c_name}'s fields"
    got = _ctypes_fields(mirror)
    want = []
    for ours, theirs in zip(got, c.fields, strict=True):
        # An untyped ctypes pointer (c_void_p) stands for any C pointer.
        if ours.kind == _POINTER_KIND and theirs.kind.endswith(" *"):
            theirs = replace(theirs, kind=_POINTER_KIND)
        want.append(theirs)
    assert got == want, f"{mirror.__name__} against C's {c_name}"
    assert (ctypes.sizeof(mirror), ctypes.alignment(mirror)) == (c.size, c.alignment)
