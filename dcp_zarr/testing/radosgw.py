"""A throw-away Ceph cluster on 127.0.0.1 with its S3 gateway (radosgw): one monitor, one OSD on a sparse file, no
authentication inside the cluster, one S3 user. A real S3 server for the tests and benchmarks, from Debian's packages
(``radosgw ceph-mon ceph-osd ceph-common``; ``.ci/install-ceph`` installs them).

Every setting below was needed on these machines (the object-stores note of the team's shared notes has the
measurements): a one-node cluster needs pools of size one and a crush rule that does not spread over hosts;
radosgw defaults to cephx against the monitor and waits forever under ``auth ... = none`` unless its client mode
says crc; small GETs take 44-64 ms each until the gateway's frontend sets ``tcp_nodelay``; deleted objects' data is
collected after 10 s instead of 2 hours; and the first PUT and the first multipart upload create pools (1.6 s and
2.5 s), so ``start`` makes both before anyone times anything.

``rgw max put size`` is lowered (``max_put_bytes``) so that uploads above a server's single-PUT limit, 5 GiB on AWS,
are tested with tens of MiB.

Run alone, ``python -m dcp_zarr.testing.radosgw`` starts one and prints its endpoint and credentials until Ctrl-C.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
import uuid

__all__ = ["ACCESS_KEY", "DAEMONS", "SECRET_KEY", "Radosgw", "missing_daemons", "shared"]

DAEMONS = ("monmaptool", "ceph-mon", "ceph-osd", "ceph", "radosgw", "radosgw-admin")
ACCESS_KEY = SECRET_KEY = "testing"
# Above the writers' multipart threshold (storage/obstore_storage.py: MULTIPART_ABOVE), far below AWS's 5 GiB.
MAX_PUT_BYTES = 48 << 20
START_TIMEOUT_S = 120


def missing_daemons() -> list[str]:
    """The Ceph programs not on PATH (an empty list: a gateway can be started here)."""
    return [name for name in DAEMONS if shutil.which(name) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(root: str, fsid: str, mon_port: int, rgw_port: int, max_put_bytes: int) -> str:
    return textwrap.dedent(f"""\
        [global]
        fsid = {fsid}
        mon host = v2:127.0.0.1:{mon_port}
        mon initial members = a
        auth cluster required = none
        auth service required = none
        auth client required = none
        ms mon client mode = crc
        mon allow pool size one = true
        mon warn on pool no redundancy = false
        mon data avail warn = 1
        mon data avail crit = 0
        osd pool default size = 1
        osd pool default min size = 1
        osd pool default pg num = 8
        osd pool default pgp num = 8
        osd crush chooseleaf type = 0
        run dir = {root}/run
        admin socket = {root}/run/$name.asok
        log file = {root}/log/$name.log
        mon data = {root}/mon/$name
        osd data = {root}/osd/$name
        osd objectstore = bluestore
        bluestore block path = {root}/osd/block
        bluestore block create = true
        bluestore block size = {64 << 30}
        [client.rgw.a]
        rgw frontends = beast endpoint=127.0.0.1:{rgw_port} tcp_nodelay=1
        rgw data = {root}/rgw
        ms mon client mode = crc secure
        auth client required = none
        rgw gc obj min wait = 10
        rgw gc processor period = 10
        rgw gc processor max time = 10
        rgw max put size = {max_put_bytes}
        """)


class Radosgw:
    """One cluster and gateway in a temporary directory; ``stop`` kills the daemons and removes it."""

    def __init__(self, max_put_bytes: int = MAX_PUT_BYTES) -> None:
        missing = missing_daemons()
        if missing:
            raise RuntimeError(f"radosgw: {', '.join(missing)} not installed (Debian: apt-get install radosgw "
                               "ceph-mon ceph-osd ceph-common; .ci/install-ceph does it)")
        self.max_put_bytes = max_put_bytes
        self.root = tempfile.mkdtemp(prefix="dcp-zarr-radosgw-")
        self.endpoint = ""
        self._processes: list[subprocess.Popen] = []

    def start(self) -> Radosgw:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        for folder in ("mon", "osd/osd.0", "run", "log", "rgw"):
            os.makedirs(f"{self.root}/{folder}")
        fsid, mon_port, rgw_port = str(uuid.uuid4()), _free_port(), _free_port()
        self.conf = f"{self.root}/ceph.conf"
        with open(self.conf, "w") as f:
            f.write(_config(self.root, fsid, mon_port, rgw_port, self.max_put_bytes))
        self._run("monmaptool", "--create", "--addv", "a", f"[v2:127.0.0.1:{mon_port}]", "--fsid", fsid,
                  f"{self.root}/monmap")
        self._run("ceph-mon", "-c", self.conf, "--mkfs", "-i", "a", "--monmap", f"{self.root}/monmap")
        self._daemon("ceph-mon", "-c", self.conf, "-i", "a")
        osd = self._run("ceph", "-c", self.conf, "osd", "create").strip()
        self._run("ceph-osd", "-c", self.conf, "-i", osd, "--mkfs")
        self._daemon("ceph-osd", "-c", self.conf, "-i", osd)
        self._daemon("radosgw", "-c", self.conf, "-n", "client.rgw.a")
        self.endpoint = f"http://127.0.0.1:{rgw_port}"
        self._wait_for_gateway()
        self._run("radosgw-admin", "-c", self.conf, "user", "create", "--uid=testing", "--display-name=testing",
                  f"--access-key={ACCESS_KEY}", f"--secret-key={SECRET_KEY}")
        self._warm_up()

    def _run(self, *command: str) -> str:
        done = subprocess.run(command, capture_output=True, text=True, timeout=START_TIMEOUT_S)
        if done.returncode:
            raise RuntimeError(f"radosgw: {' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-2000:]}"
                               f" (logs in {self.root}/log)")
        return done.stdout

    def _daemon(self, *command: str) -> None:
        # -f: in the foreground, so that the process is ours to kill; new session: Ctrl-C in a terminal reaches us
        self._processes.append(subprocess.Popen([*command, "-f"], stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL, start_new_session=True))

    def _wait_for_gateway(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=5).close()
                return
            except urllib.error.HTTPError:
                return  # it answers
            except OSError:
                dead = [str(p.args[0]) for p in self._processes if p.poll() is not None]  # type: ignore[index]
                if dead or time.monotonic() > deadline:
                    why = f"{', '.join(dead)} exited" if dead else f"no answer in {START_TIMEOUT_S} s"
                    raise RuntimeError(f"radosgw: the gateway did not start ({why}; logs in {self.root}/log)") from None
                time.sleep(0.25)

    def _warm_up(self) -> None:
        """Create the data pools (the first PUT and the first multipart upload do) before anything is timed."""
        import boto3  # type: ignore[import-untyped]  # comes with s3fs's aiobotocore, with the test extras

        client = self.client(boto3)
        client.create_bucket(Bucket="warm-up")
        client.put_object(Bucket="warm-up", Key="object", Body=b"x")
        upload = client.create_multipart_upload(Bucket="warm-up", Key="multipart")
        client.abort_multipart_upload(Bucket="warm-up", Key="multipart", UploadId=upload["UploadId"])
        client.delete_object(Bucket="warm-up", Key="object")
        client.delete_bucket(Bucket="warm-up")

    def cpu_seconds(self) -> float:
        """CPU time the cluster's daemons have used so far (user and system, from /proc)."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for process in self._processes:
            with contextlib.suppress(OSError), open(f"/proc/{process.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        return total

    def client(self, boto3):
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def stop(self) -> None:
        for process in reversed(self._processes):
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)  # a throw-away cluster: nothing to flush
            process.wait()
        self._processes.clear()
        shutil.rmtree(self.root, ignore_errors=True)


_SHARED: Radosgw | None = None


def shared() -> Radosgw:
    """This process's gateway, started on first use (about 20 s) and stopped when the process exits."""
    global _SHARED
    if _SHARED is None:
        _SHARED = Radosgw().start()
        atexit.register(_SHARED.stop)
    return _SHARED


def main() -> None:
    gateway = Radosgw().start()
    print(f"radosgw on {gateway.endpoint}: access key {ACCESS_KEY!r}, secret key {SECRET_KEY!r}, region us-east-1, "
          f"single PUTs up to {gateway.max_put_bytes} bytes; Ctrl-C stops it", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        gateway.stop()


if __name__ == "__main__":
    main()
