"""docs/api.md says what the code says: every public name, its signature and its docstring
(tests/support/api_reference.py makes the page; ``python -m tests.support.api_reference`` rewrites it)."""

from __future__ import annotations

import inspect

import pytest

import dcp_zarr
from dcp_zarr import errors
from tests.support.api_reference import PAGE, SECTIONS, documented_names, render


def test_every_public_name_has_its_place_on_the_page():
    sections = {name for _, _, names in SECTIONS for name in names}
    assert set(dcp_zarr.__all__) - set(errors.__all__) - {"__version__"} == sections
    assert set(dcp_zarr.__all__) <= documented_names()


def test_the_package_lists_its_names_in_the_pages_order():
    """``__all__`` reads as the page does: its sections in order, then the errors, then ``__version__``."""
    in_sections = [name for _, _, names in SECTIONS for name in names]
    assert dcp_zarr.__all__[:len(in_sections)] == in_sections
    assert dcp_zarr.__all__[-1] == "__version__"


def test_every_error_lives_in_dcp_zarr_errors_and_is_found_from_the_package_too():
    defined = {name for name, value in vars(errors).items()
               if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == errors.__name__}
    assert set(errors.__all__) == defined
    for name in errors.__all__:  # code written against the package's earlier, longer __all__ keeps working
        assert getattr(dcp_zarr, name) is getattr(errors, name)
    assert [n for n in dcp_zarr.__all__ if n.endswith(("Error", "Warning"))] == [
        "ZarrCheckpointError", "NotACheckpointError", "IncompleteCheckpointError", "CheckpointExistsError",
        "CorruptChunkError"]


@pytest.mark.frameworks  # the page documents the adapters, whose import imports each framework
@pytest.mark.slow
def test_the_page_is_what_the_code_says_now():
    assert PAGE.read_text() == render(), "docs/api.md is out of date: python -m tests.support.api_reference"
