"""Units of collective work, each owned by one rank, packed into rounds that bound the bytes held at once.

A unit is a block an aggregator assembles and writes, or a region a reader reads and sends on. Every rank packs the
same units into the same rounds (first fit, in the units' order), so the rounds need no message: in a round each
owner holds at most ``budget`` bytes of its units, and the largest part any one rank sends or receives of each unit
adds up to at most ``budget`` over the round (a unit larger than the budget is a round of its own for its owner).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class Unit(NamedTuple):
    key: tuple  # sortable and unique: (array, block) or (array, region)
    owner: int  # the rank that assembles or reads it
    nbytes: int  # what the owner holds of it
    max_part: int  # the most one other rank sends (or receives) of it


def pack_rounds(units: Iterable[Unit], budget: int) -> list[list[Unit]]:
    """The units in rounds, in key order within each round; the same on every rank for the same units."""
    budget = max(int(budget), 1)
    rounds: list[list[Unit]] = []
    owner_loads: list[dict[int, int]] = []  # per round: owner -> bytes of its units
    part_loads: list[int] = []  # per round: the sum of its units' max_part
    for unit in sorted(units, key=lambda u: u.key):
        for r, loads in enumerate(owner_loads):
            held = loads.get(unit.owner, 0)
            if ((held == 0 or held + unit.nbytes <= budget)
                    and (part_loads[r] == 0 or part_loads[r] + unit.max_part <= budget)):
                break
        else:
            r = len(rounds)
            rounds.append([])
            owner_loads.append({})
            part_loads.append(0)
        rounds[r].append(unit)
        owner_loads[r][unit.owner] = owner_loads[r].get(unit.owner, 0) + unit.nbytes
        part_loads[r] += unit.max_part
    return rounds
