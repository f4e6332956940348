"""XRT server clean-up that only touches servers our own workers started.

With legacy torch-neuronx 1.x, the ``xla`` process group makes local rank 0 start
``python3 -m torch_xla.distributed._xrt_run_server``, which exits only when the process it
tracks (the worker's parent: Ray's raylet) does. A crashed worker therefore leaks its server,
which keeps holding the NeuronCores. Ray's backend kills every process whose command line
matches ``xrt_run_server`` on the node, other users' and other jobs' servers too. Instead:

- while a worker runs, a watcher records each XRT server that is a descendant of the worker
  process (pid and start time, and the worker's pid and start time) in a per-user state dir;
- at shutdown, the worker stops its own descendants;
- at start, a worker stops the recorded servers whose recording worker is gone (a crashed
  attempt), after checking the pid still belongs to that same server process.

Linux only (reads /proc).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import tempfile
import threading
import time

from ray_train_xla.planning.contract import STATE_DIR_VAR

logger = logging.getLogger(__name__)

SERVER_MARK = "xrt_run_server"
_watcher_stop = threading.Event()


def state_dir() -> str:
    """Where server records live: per user, overridable with RAY_TRAIN_XLA_STATE_DIR."""
    base = os.environ.get(STATE_DIR_VAR) or os.path.join(tempfile.gettempdir(),
                                                         f"ray_train_xla-{os.getuid()}")
    path = os.path.join(base, "xrt")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (the state first); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (from /proc/PID/stat); None if it is gone or a
    zombie. With the pid, it identifies one process even after pids are reused."""
    fields = _stat(pid)
    return None if fields is None or fields[0] == "Z" else fields[19]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root`` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        fields = _stat(pid)
        if fields:
            children.setdefault(int(fields[1]), []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def own_servers() -> list[int]:
    """XRT servers started (directly or not) by this process."""
    return [pid for pid in descendants(os.getpid()) if SERVER_MARK in cmdline(pid)]


def _record(server: int) -> None:
    record = {"server": server, "server_start": start_time(server),
              "owner": os.getpid(), "owner_start": start_time(os.getpid())}
    if record["server_start"] is None:
        return
    path = os.path.join(state_dir(), f"{server}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def record_own_servers() -> list[int]:
    servers = own_servers()
    for pid in servers:
        _record(pid)
    return servers


def watch_for_servers(timeout_s: float, interval_s: float = 1.0) -> threading.Thread:
    """Record this worker's XRT servers as they appear, for ``timeout_s`` at most."""
    _watcher_stop.clear()

    def loop() -> None:
        deadline = time.monotonic() + timeout_s
        while not _watcher_stop.is_set() and time.monotonic() < deadline:
            try:
                record_own_servers()
            except OSError as exc:
                logger.debug("xrt watcher: %s", exc)
            _watcher_stop.wait(interval_s)

    thread = threading.Thread(target=loop, name="ray_train_xla-xrt-watch", daemon=True)
    thread.start()
    return thread


def terminate(pids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s`` for those still alive."""
    started = {pid: start_time(pid) for pid in pids}
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if start_time(p) is not None and start_time(p) == started[p]]
    _signal(alive, signal.SIGKILL)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _records() -> list[tuple[str, dict]]:
    out = []
    directory = state_dir()
    for path in (os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".json")):
        try:
            with open(path) as f:
                out.append((path, json.load(f)))
        except (OSError, ValueError):
            continue
    return out


def stop_own_servers() -> list[int]:
    """At shutdown: stop the XRT servers this worker started; returns their pids."""
    _watcher_stop.set()
    servers = set(own_servers())
    me, my_start = os.getpid(), start_time(os.getpid())
    mine = [(path, r) for path, r in _records()
            if r.get("owner") == me and r.get("owner_start") == my_start]
    servers.update(r["server"] for _, r in mine if start_time(r["server"]) == r["server_start"])
    terminate(sorted(servers))
    for path, _ in mine:
        _remove(path)
    return sorted(servers)


def clean_stale_servers() -> list[int]:
    """At start: stop recorded servers whose recording worker has exited; returns their pids."""
    stale = []
    for path, r in _records():
        if start_time(r.get("owner", -1)) == r.get("owner_start"):  # its worker still runs
            continue
        server = r.get("server", -1)
        if start_time(server) == r.get("server_start") and SERVER_MARK in cmdline(server):
            stale.append(server)
        _remove(path)
    if stale:
        logger.warning("stopping XRT servers left by crashed workers: %s", stale)
        terminate(stale)
    return stale


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
