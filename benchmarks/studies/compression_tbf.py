"""The compression benchmark's ``s3-tbf`` target (benchmarks/reports/compression.md, "Targets"): moto's S3 server in a
network namespace, reached over a veth pair (MTU 65535, as ``lo``) whose two ends each carry a ``tbf`` qdisc at
``--rate-mbit`` (3200 mbit = 400 MB/s, 200 MB/s for each of 2 ranks writing at once; gloo between the ranks stays on
the unthrottled ``lo``). Needs root, ``ip`` and ``tc``. The link is measured first with bare TCP transfers each way
on 4 connections. It found moto, not the link, to be the limit on 2 cores; the ``throttled`` target of
benchmarks.compression is the bandwidth-limited one kept.

``python -m benchmarks.studies.compression_tbf [compression's options] [--rate-mbit 3200]``
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid

from benchmarks import compression
from benchmarks import harness as h

STREAMS = 4  # the link check's connections at once
MTU = 65535  # the veth pair's, as lo's: at 1500 the link's packets, not tbf, set its speed on 2 busy cores


def serve(host: str) -> None:
    """moto on ``host`` at a port the kernel picks, printed; ends when stdin closes."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address=host, port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    sys.stdin.read()
    server.stop()


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    while len(view):
        n = conn.recv_into(view)
        if not n:
            raise EOFError("the link check's peer closed early")
        view = view[n:]


def sink(host: str) -> None:
    """The link check's far end: on each of STREAMS connections, an 8-byte length and that many bytes in, b"k" back;
    then, once b"g" comes, the same bytes out."""

    def serve_one(conn: socket.socket) -> None:
        with conn:
            length = bytearray(8)
            _recv_into(conn, memoryview(length))
            buffer = bytearray(int.from_bytes(length, "little"))
            _recv_into(conn, memoryview(buffer))
            conn.sendall(b"k")
            _recv_into(conn, memoryview(bytearray(1)))
            conn.sendall(buffer)

    with socket.create_server((host, 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        threads = [threading.Thread(target=serve_one, args=(listener.accept()[0],)) for _ in range(STREAMS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def in_namespace(prefix: list[str], flag: str, host: str) -> tuple[subprocess.Popen, int]:
    """This module's ``flag host`` in a process of its own (in the namespace): the process and the port it printed."""
    env = {**os.environ, "TMPDIR": h.SCRATCH}  # moto spools objects over 5 MB to tmpfs
    process = subprocess.Popen([*prefix, sys.executable, "-m", __spec__.name, flag, host], cwd=h.REPO, env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()  # type: ignore[union-attr]
    if not line.strip().isdigit():
        process.kill()
        raise RuntimeError(f"{flag} {host}: the process printed {line!r}, not a port")
    return process, int(line)


def _ip(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


class ThrottledLink:
    """A network namespace reached over a veth pair, ``tbf`` at ``rate_mbit`` on both ends (egress each way)."""

    def __init__(self, rate_mbit: int):
        tag = os.getpid() % 100000
        self.ns, self.near, self.far = f"dcpzb{tag}", f"dcpzb{tag}a", f"dcpzb{tag}b"
        self.near_ip, self.far_ip = f"10.231.{tag % 250 + 1}.1", f"10.231.{tag % 250 + 1}.2"
        self.prefix = ["ip", "netns", "exec", self.ns]
        self.qdisc = f"tbf rate {rate_mbit}mbit burst {max(1 << 20, rate_mbit * 1000)}b latency 50ms"
        far = self.prefix
        try:
            for command in (["ip", "netns", "add", self.ns], ["ip", "link", "add", self.near, "type", "veth", "peer",
                            "name", self.far], ["ip", "link", "set", self.far, "netns", self.ns],
                            ["ip", "link", "set", self.near, "mtu", str(MTU)],
                            [*far, "ip", "link", "set", self.far, "mtu", str(MTU)],
                            ["ip", "addr", "add", f"{self.near_ip}/24", "dev", self.near],
                            ["ip", "link", "set", self.near, "up"],
                            [*far, "ip", "addr", "add", f"{self.far_ip}/24", "dev", self.far],
                            [*far, "ip", "link", "set", self.far, "up"], [*far, "ip", "link", "set", "lo", "up"],
                            ["tc", "qdisc", "add", "dev", self.near, "root", *self.qdisc.split()],
                            [*far, "tc", "qdisc", "add", "dev", self.far, "root", *self.qdisc.split()]):
                _ip(*command)
        except BaseException:
            self.remove()
            raise

    def check(self, nbytes: int = 256 << 20) -> dict[str, float]:
        """A bare TCP transfer of ``nbytes`` each way on STREAMS connections at once: MB/s up and down."""
        process, port = in_namespace(self.prefix, "--sink", self.far_ip)
        payload = os.urandom(1 << 20) * (nbytes // STREAMS >> 20)
        sent, received = threading.Barrier(STREAMS + 1), threading.Barrier(STREAMS + 1)
        conns = [socket.create_connection((self.far_ip, port), timeout=60) for _ in range(STREAMS)]

        def stream(conn: socket.socket) -> None:
            sent.wait()
            conn.sendall(len(payload).to_bytes(8, "little") + payload)
            _recv_into(conn, memoryview(bytearray(1)))
            sent.wait()
            received.wait()
            conn.sendall(b"g")
            _recv_into(conn, memoryview(bytearray(len(payload))))
            received.wait()

        threads = [threading.Thread(target=stream, args=(conn,)) for conn in conns]
        try:
            for thread in threads:
                thread.start()
            times = []
            for barrier in (sent, received):
                barrier.wait()
                start = time.perf_counter()
                barrier.wait()
                times.append(time.perf_counter() - start)
            for thread in threads:
                thread.join()
        finally:
            for conn in conns:
                conn.close()
            process.wait(timeout=30)
        total = len(payload) * STREAMS
        return {"streams": STREAMS, "up_mb_s": total / times[0] / 1e6, "down_mb_s": total / times[1] / 1e6}

    def remove(self) -> None:
        subprocess.run(["ip", "link", "del", self.near], capture_output=True, timeout=30)  # both ends go
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--serve"], ["--sink"]):
        return (serve if argv[0] == "--serve" else sink)(argv[1])
    args = compression.parse_args(argv, ("s3-tbf",), lambda p: p.add_argument(
        "--rate-mbit", type=int, default=3200, help="the link's rate each way (all ranks)"))
    link = ThrottledLink(args.rate_mbit)
    server = None
    try:
        measured = {"qdisc": link.qdisc, **link.check()}
        print(f"throttled link ({link.qdisc}, each way): {measured}", flush=True)
        server, port = in_namespace(link.prefix, "--serve", link.far_ip)
        options = {"endpoint_url": f"http://{link.far_ip}:{port}", "key": "testing", "secret": "testing"}
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir("bench")
        targets = {"s3-tbf": {"root": f"s3://bench/{uuid.uuid4().hex[:8]}", "options": options,
                              "per_rank": f"tbf {args.rate_mbit / 8 / args.ranks:g} MB/s per rank"}}
        note = (f"s3-tbf link: `{link.qdisc}` on each veth end; bare TCP {measured['up_mb_s']:.0f} MB/s up, "
                f"{measured['down_mb_s']:.0f} MB/s down")
        compression.run(args, targets, [note], link=measured)
    finally:
        if server is not None:
            server.stdin.close()  # type: ignore[union-attr]
            server.wait(timeout=20)
        link.remove()


if __name__ == "__main__":
    main()
