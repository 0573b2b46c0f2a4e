"""Packed launches: the parameter lists the adapters state match the kernels' C signatures.

A code that disagrees with its C parameter would shift every later argument in the buffer;
this reads each kernel's parameter list from its source and compares.
"""

from __future__ import annotations

import re
from importlib import resources

import pytest
from softmaxkit_cupy import rows

_C_CODES = {"long long": "q", "int": "i", "float": "f"}


def _parameter_codes(source: str, kernel: str) -> str:
    """The struct codes of ``kernel``'s parameters in ``source`` (pointers as addresses)."""
    match = re.search(rf"\b{kernel}\(([^)]*)\)\s*{{", source)
    assert match, f"no definition of {kernel}"
    codes = ""
    for param in match.group(1).split(","):
        decl = re.sub(r"\b(const|__restrict__)\b", "", param).split()
        ctype = " ".join(decl[:-1])
        codes += "Q" if "*" in param else _C_CODES[ctype]
    return codes


def _source(name: str) -> str:
    text = resources.files("softmaxkit_cupy").joinpath("kernels", name).read_text()
    return text + "".join(resources.files("softmaxkit_cupy").joinpath("kernels", inc)
                          .read_text() for inc in re.findall(r'#include "(\w+\.cuh)"', text))


@pytest.mark.parametrize(("file", "kernels", "codes"), [
    ("rows.cu", ("sk_rows", "sk_rows_cluster", "sk_rows16", "sk_rows16_staged",
                 "sk_rows16_persist"), rows._ROW_PARAMS),
    ("rowgrads.cu", ("sk_vjp",), rows._VJP_PARAMS),
    ("rowgrads.cu", ("sk_xent",), rows._XENT_PARAMS),
])
def test_stated_parameters_match_the_kernels(file, kernels, codes):
    source = _source(file)
    for kernel in kernels:
        assert _parameter_codes(source, kernel) == codes, kernel
