"""TCP ports for tests that must know a port before the server binds it (a service restarted on the same address, a
command-line flag, a rendezvous port, an address that must refuse connections).

A port picked by binding port 0 and closing the socket is free only at that instant: the kernel hands the same
ephemeral port to the next port-0 bind or outgoing connection of any process (another test's server, a gRPC
channel), and the test's own server then fails to bind it (EADDRINUSE) or a "closed" address answers. A port here
is taken below the kernel's ephemeral range, where no port-0 bind or connection is given it, and is reserved
across processes (each pytest-xdist worker, a second test session on the same machine) by a lock on a file named
after it, held until the process that took it exits. The product's own ranges stay clear of it: the local
cluster's 10000-19999 and the ranks' MASTER_PORT range 20000-31999.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path

LOCKS = Path(tempfile.gettempdir()) / "phalanx-test-ports"
_held: dict[int, int] = {}  # port -> the lock file's descriptor, held for this process's life


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _range() -> range:
    low = _ephemeral_low()
    top = min(low, 32768)
    return range(max(1024, top - 768), top)  # 32000-32767 with Linux's default ephemeral range


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def reserved_port() -> int:
    """A port on 127.0.0.1 free now, that no other test process is given and no port-0 bind takes meanwhile."""
    LOCKS.mkdir(exist_ok=True)
    candidates = _range()
    start = (os.getpid() * 7919) % len(candidates)  # processes start their search at different ports
    for i in range(len(candidates)):
        port = candidates[(start + i) % len(candidates)]
        if port in _held:
            continue
        fd = os.open(LOCKS / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # another test process holds it
        if not _bindable(port):  # something outside the tests listens there
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            continue
        _held[port] = fd
        return port
    raise AssertionError(f"no free port left in {candidates.start}-{candidates.stop - 1} for this test process")


def closed_address() -> str:
    """HOST:PORT where nothing listens, and nothing will while this process runs (connections are refused)."""
    return f"127.0.0.1:{reserved_port()}"
