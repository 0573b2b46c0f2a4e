"""The examples of the user guide and the README run and print what the pages say."""

from __future__ import annotations

import doctest
from pathlib import Path

import numpy as np
import pytest

import softmaxkit as sk

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["docs/semantics.md", "docs/index.md", "README.md"]


@pytest.mark.parametrize("page", PAGES)
def test_examples_in_docs(page):
    path = ROOT / page
    if not path.exists():
        pytest.skip(f"{page} not written")
    # the pages set numpy's print options; restore them afterwards
    with sk.backend_opts(prioritize="reference"), np.printoptions():
        result = doctest.testfile(str(path), module_relative=False,
                                  optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
