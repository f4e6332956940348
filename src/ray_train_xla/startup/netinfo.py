"""Node facts read on a worker: EFA devices and the network interface that carries an IP.

Linux-only reads of /sys and of interface addresses; both answer "not found" elsewhere.
"""

from __future__ import annotations

import os
import socket
import struct

INFINIBAND_SYSFS = "/sys/class/infiniband"


def has_efa(sysfs: str = INFINIBAND_SYSFS) -> bool:
    """True if any RDMA device under ``sysfs`` is bound to the ``efa`` driver."""
    try:
        names = os.listdir(sysfs)
    except OSError:
        return False
    for name in names:
        driver = os.path.join(sysfs, name, "device", "driver")
        try:
            if os.path.basename(os.path.realpath(driver)) == "efa" or name.startswith("efa"):
                return True
        except OSError:
            continue
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
    for name in names:
        if _ipv4_of(name) == ip:
            return name
    return None


def free_ports(count: int, ipv6: bool = False) -> list[int]:
    """``count`` distinct free TCP ports on this machine (bound together while chosen, then
    released for the caller to use)."""
    family = socket.AF_INET6 if ipv6 else socket.AF_INET
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
