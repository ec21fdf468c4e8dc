"""Which manager holds a checkpoint root: a lease record with a heartbeat.

Only the holder saves into the root, applies retention and removes leftovers, so anything it finds that is not its
own work in flight is the remains of a process that is gone. A second manager refuses to start while the lease is
live. The lease is live while its holder refreshes it: it is stale once ``timeout`` seconds pass without a
heartbeat, or at once when the holder ran on this host and its process is gone (a killed job restarted on the same
node need not wait).

Taking a lease is a write, a short wait and a read back: of two managers racing for a stale lease, the one whose
record is read back holds it and the other refuses. On a local file system a fresh lease is created with
``O_EXCL`` (only one can); on an object store without conditional writes the read back is what decides.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from dcp_zarr.errors import CheckpointRootBusyError

LEASE_KEY = ".dcp-zarr/lease.json"
DEFAULT_TIMEOUT_S = 60.0
_CONFIRM_DELAY_S = 0.2


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), if there is such a file."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def _process_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (tells a reused pid from the holder), if /proc has it."""
    fields = _proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _proc_stat(pid)
    if fields is None:
        return True  # no /proc: the signal check is all there is
    if fields[0] in ("Z", "X"):
        return False  # killed, not yet reaped by its parent
    return start is None or len(fields) <= 19 or fields[19] == start


class Lease:
    """The lease on ``root`` (a CheckpointRoot) for one manager; ``acquire()``, then ``release()``."""

    def __init__(self, root, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not timeout_s > 0:
            raise ValueError(f"lease timeout_s={timeout_s!r}: must be positive")
        self.root = root
        self.timeout_s = float(timeout_s)
        self.id = uuid.uuid4().hex
        self.lost: str | None = None  # why another manager now holds it, if it does
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self) -> dict:
        pid = os.getpid()
        return {"holder": self.id, "host": socket.gethostname(), "pid": pid, "pid_start": _process_start(pid),
                "heartbeat": time.time(), "timeout_s": self.timeout_s}

    def why_live(self, record: dict | None) -> str | None:
        """Why ``record`` (another holder's) is still live, or None if it is stale or absent."""
        if not record:
            return None
        try:
            age = time.time() - float(record["heartbeat"])
            timeout = float(record.get("timeout_s", self.timeout_s))
        except (KeyError, TypeError, ValueError):
            return None  # torn or foreign: nothing holds it
        if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
            if not _alive(record["pid"], record.get("pid_start")):
                return None
        if age > timeout:
            return None
        return (f"held by manager {record.get('holder')} (host {record.get('host')}, pid {record.get('pid')}), "
                f"last heartbeat {age:.1f} s ago; it is stale after {timeout:.0f} s without one")

    def acquire(self) -> None:
        current = self.root.read_json(LEASE_KEY)
        reason = self.why_live(current)
        if reason:
            raise CheckpointRootBusyError(f"checkpoint root {self.root.url} is {reason}. Two managers on one root "
                                          "would delete each other's saves; stop the other job first")
        if current is None and self.root.directory is not None:
            self._create_exclusively()
        else:
            self.root.write_json(LEASE_KEY, self.record())
        time.sleep(_CONFIRM_DELAY_S)  # a racing manager's write lands in this window, then the read back decides
        holder = self.root.read_json(LEASE_KEY) or {}
        if holder.get("holder") != self.id:
            raise CheckpointRootBusyError(f"checkpoint root {self.root.url}: another manager "
                                          f"({holder.get('holder')}) took the lease at the same moment")
        self._thread = threading.Thread(target=self._heartbeat, name="dcp-zarr-lease", daemon=True)
        self._thread.start()

    def _create_exclusively(self) -> None:
        path = os.path.join(self.root.directory, LEASE_KEY)
        for last_try in (False, True):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileExistsError:
                raise CheckpointRootBusyError(f"checkpoint root {self.root.url}: another manager created its lease "
                                              "at the same moment") from None
            except FileNotFoundError:  # the holder releasing its lease removed the empty folder meanwhile
                if last_try:
                    raise
        with os.fdopen(fd, "w") as f:
            json.dump(self.record(), f)

    def check(self) -> None:
        """Raise if the lease was lost (another manager judged it stale and took the root)."""
        if self.lost:
            raise CheckpointRootBusyError(f"checkpoint root {self.root.url}: this manager lost its lease: {self.lost}")

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            try:
                holder = self.root.read_json(LEASE_KEY) or {}
                if holder.get("holder") not in (None, self.id):
                    self.lost = f"manager {holder.get('holder')} (host {holder.get('host')}) holds it now"
                    return
                self.root.write_json(LEASE_KEY, self.record())
            except Exception:  # a store that is briefly unreachable: try again next beat; the timeout covers it
                continue

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.lost:
            return
        holder = self.root.read_json(LEASE_KEY) or {}
        if holder.get("holder") == self.id:
            self.root.remove_key(LEASE_KEY)
            self.root.remove_empty_records_folder()
