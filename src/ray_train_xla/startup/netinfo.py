"""Node facts read on a worker: EFA devices and the network interface that carries an IP.

Linux-only reads of /sys and of interface addresses; both answer "not found" elsewhere.
"""

from __future__ import annotations

import os
import socket
import struct
import threading

INFINIBAND_SYSFS = "/sys/class/infiniband"


def has_efa(sysfs: str = INFINIBAND_SYSFS) -> bool:
    """True if any RDMA device under ``sysfs`` is bound to the ``efa`` driver."""
    try:
        names = os.listdir(sysfs)
    except OSError:
        return False
    for name in names:
        driver = os.path.realpath(os.path.join(sysfs, name, "device", "driver"))
        if name.startswith("efa") or os.path.basename(driver) == "efa":
            return True
    return False


def _ipv4_of(ifname: str) -> str | None:
    import fcntl

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = struct.pack("256s", ifname.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, packed)[20:24])
        except OSError:
            return None


def interface_for_ip(ip: str) -> str | None:
    """The name of the local interface whose IPv4 address is ``ip`` (None if none is)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return next((name for name in names if _ipv4_of(name) == ip), None)


def free_ports(count: int, ipv6: bool = False, hold: int = 0) -> list[int]:
    """``count`` distinct free TCP ports on this machine, bound together while chosen. The
    first ``hold`` of them stay bound and listening in this process, so that no other process
    can take them, until ``take_held`` hands one to the server that will use it or
    ``release_held`` closes it (ports an earlier call held are released first); the others are
    released for the caller to use."""
    family = socket.AF_INET6 if ipv6 else socket.AF_INET
    release_held()
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            if len(socks) <= hold:
                # As TCPStore's own listener: the connections it accepts inherit the option, so
                # once they are closed their TIME_WAIT does not keep the port from the next
                # server (Linux refuses the bind unless both sockets allow reuse).
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", 0))
        ports = [s.getsockname()[1] for s in socks]
        with _held_lock:
            for s in socks[:hold]:
                s.listen(LISTEN_BACKLOG)  # a listener: nobody else can bind or listen there
                _held[s.getsockname()[1]] = s
        return ports
    finally:
        for s in socks[hold:]:
            s.close()


# Ports this process holds for a server that starts later (see free_ports): port -> socket.
_held: dict[int, socket.socket] = {}
_held_lock = threading.Lock()
LISTEN_BACKLOG = 2048  # connections that arrive before the server takes the socket wait here


def take_held(port: int) -> int | None:
    """The file descriptor of the listening socket this process holds for ``port`` (the
    caller owns it from now on), or None when this process does not hold that port."""
    with _held_lock:
        sock = _held.pop(port, None)
    return sock.detach() if sock is not None else None


def release_held(port: int | None = None) -> None:
    """Close the socket held for ``port`` (every held socket when None), if any."""
    with _held_lock:
        socks = [_held.pop(p, None) for p in (list(_held) if port is None else [port])]
    for sock in socks:
        if sock is not None:
            sock.close()
