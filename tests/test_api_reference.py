"""docs/api.md says what the code says: every public name, its signature and its docstring
(tests/support/api_reference.py makes the page; ``python -m tests.support.api_reference`` rewrites it)."""

from __future__ import annotations

import pytest

import dcp_zarr
from tests.support.api_reference import PAGE, documented_names, render


def test_every_public_name_has_its_place_on_the_page():
    assert set(dcp_zarr.__all__) == documented_names()


@pytest.mark.frameworks  # the page documents the adapters, whose import imports each framework
@pytest.mark.slow
def test_the_page_is_what_the_code_says_now():
    assert PAGE.read_text() == render(), "docs/api.md is out of date: python -m tests.support.api_reference"
