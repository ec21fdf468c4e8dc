"""What kind of file system a local path is on: one machine's own, or one shared over a network (Lustre, GPFS,
NFS, ...), where many ranks' small writes to one file at unaligned offsets are the pattern served worst (locks,
read-modify-write of stripes), which aggregated writes avoid.

Read from the mount table (``/proc/self/mounts``: the longest mount point above the path); anything not known as
shared counts as local, and so does a system without a mount table.
"""

from __future__ import annotations

import os
from functools import lru_cache

# Mount types of file systems shared by the machines of a job (parallel and network file systems).
SHARED_TYPES = frozenset({
    "lustre", "gpfs", "nfs", "nfs4", "beegfs", "ceph", "cifs", "smb3", "glusterfs", "fuse.glusterfs", "panfs",
    "orangefs", "pvfs2", "wekafs", "fuse.weka", "fuse.juicefs", "fuse.cephfs", "fuse.gcsfuse", "fuse.s3fs",
    "fuse.mountpoint-s3", "fuse.goofys", "9p", "virtiofs", "vast", "fhgfs", "quobyte", "fuse.quobyte", "daos",
    "fuse.dfuse", "fuse.sshfs",
})
MOUNTS = "/proc/self/mounts"


@lru_cache(maxsize=256)  # a storage is opened per save and load; mounts seldom change under a running job
def file_system_type(path: str, mounts: str = MOUNTS) -> str | None:
    """The mount type of the file system holding ``path`` (which need not exist yet), or None if unknown."""
    path = os.path.realpath(os.path.abspath(path))
    try:
        with open(mounts) as table:
            lines = table.read().splitlines()
    except OSError:
        return None
    best, found = -1, None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, found = len(point), fields[2]
    return found


def is_shared(path: str, mounts: str = MOUNTS) -> bool:
    return file_system_type(path, mounts) in SHARED_TYPES
