"""A process's resident memory from ``/proc/self/status``: now (``VmRSS``), its peak (``VmHWM``),
and a reset of the peak (``/proc/self/clear_refs``), so a test bounds the peak growth of one
call: ``reset_peak(); before = rss(); call(); growth = peak() - before``."""

from __future__ import annotations

import re


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def rss() -> int:
    """Resident bytes now."""
    return _status("VmRSS")


def peak() -> int:
    """The most resident bytes since the start or the last :func:`reset_peak`."""
    return _status("VmHWM")


def reset_peak() -> None:
    """Start the peak again from the resident bytes now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class PeakGrowth:
    """``with PeakGrowth() as g: ...``; then ``g.bytes``: the peak above the resident memory at
    the start."""

    def __enter__(self) -> PeakGrowth:
        reset_peak()
        self.start = rss()
        return self

    def __exit__(self, *exc) -> bool:
        self.bytes = peak() - self.start
        return False
