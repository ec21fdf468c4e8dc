"""The markers are claims that ``-m`` selections rely on (``-m "not distributed"`` must start no rank), so what
needs one checks that the running test carries it: ``run_ranks``, ``Zygote`` and ``S3Server`` call ``require``.

tests/conftest.py sets ``current`` before each test's setup (module-scoped fixtures are set up inside the first test
that asks for them, so they are checked against that test); outside pytest (benchmarks, tests/data scripts) it stays
None and nothing is checked.
"""

from __future__ import annotations

current: frozenset[str] | None = None


def require(marker: str, what: str) -> None:
    if current is not None and marker not in current:
        raise AssertionError(f"this test {what} but is not marked {marker!r}: add @pytest.mark.{marker} "
                             f"(or the module's pytestmark), so that -m selections see it")
