"""Progress bars for long offline operations: tqdm on stderr when asked for and installed, otherwise nothing.

tqdm is an optional dependency (the ``cli`` extra), so the library never imports it unless a bar is wanted.

Implementation.
"""

from __future__ import annotations

import sys


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def progress_bar(total: int, description: str, *, enabled: bool | None = False, unit: str = "B"):
    """A bar counting to ``total``. ``enabled=None`` shows it only when stderr is a terminal."""
    if enabled is False:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    scaled = unit == "B"
    return tqdm(total=total, desc=description, unit=unit, unit_scale=scaled, unit_divisor=1024 if scaled else 1000,
                file=sys.stderr, disable=None if enabled is None else False, leave=False, dynamic_ncols=True)
