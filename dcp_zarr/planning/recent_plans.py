"""The last few plans this process made, by what decides them: a job saving one state dict every few minutes plans
once, and after a restart once again, without any exchange (the digests say the structure is the same).

Each plan is kept under a frozen key object (``write_plan.PlanKey``, ``rank_part.NodesKey``) that names every input
of the function making it, so an option added to that function's inputs is in its key too, and a plan made with
other options is never reused.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeVar

Plan = TypeVar("Plan")


class RecentPlans:
    def __init__(self, size: int = 8):
        self._plans: OrderedDict = OrderedDict()
        self._size = size
        self._lock = threading.Lock()  # async saves plan on DCP's background thread

    def get(self, key: Hashable):
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
            return plan

    def put(self, key: Hashable, plan: Plan) -> Plan:
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)
        return plan

    def made(self, key: Hashable, make: Callable[[], Plan]) -> Plan:
        """The plan kept under ``key``, else ``make()``'s, kept."""
        found = self.get(key)
        return found if found is not None else self.put(key, make())

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


recent_plans = RecentPlans()
