"""XRT server clean-up touches only servers our workers started (never a node-wide pkill)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ray_train_xla.startup import xrt as _xrt

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE_SERVER = os.path.join(HERE, "doubles", "xrt_run_server.py")

# A worker process: starts its own XRT server child, records it, reports both pids, then
# either waits to be killed or stops its own servers, as the test asks.
WORKER = textwrap.dedent(f"""
    import subprocess, sys, time
    from ray_train_xla.startup import xrt as _xrt
    server = subprocess.Popen([sys.executable, {FAKE_SERVER!r}, "120"])
    deadline = time.monotonic() + 30
    while server.pid not in _xrt.record_own_servers() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(server.pid, flush=True)
    if sys.argv[1] == "stop":
        print(",".join(map(str, _xrt.stop_own_servers())), flush=True)
    else:
        time.sleep(120)
""")


def alive(pid):
    return _xrt.start_time(pid) is not None


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_XLA_STATE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def other_users_server():
    """An XRT server that some other job started: nothing of ours may touch it."""
    proc = subprocess.Popen([sys.executable, FAKE_SERVER, "120"])
    yield proc
    proc.kill()
    proc.wait()


def start_worker(mode):
    return subprocess.Popen([sys.executable, "-c", WORKER, mode], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ))


def test_a_crashed_workers_server_is_stopped_at_next_start(state_dir, other_users_server):
    worker = start_worker("crash")
    server = int(worker.stdout.readline())
    assert alive(server) and _xrt.SERVER_MARK in _xrt.cmdline(server)
    worker.send_signal(signal.SIGKILL)  # the worker crashes; its server is leaked
    worker.wait()
    time.sleep(0.2)
    assert alive(server)

    stopped = _xrt.clean_stale_servers()

    assert stopped == [server]
    deadline = time.monotonic() + 10
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(server)
    assert alive(other_users_server.pid)  # another job's server is untouched
    assert not list(state_dir.glob("xrt/*.json"))  # its record is gone too


def test_a_worker_stops_only_its_own_server_at_shutdown(state_dir, other_users_server):
    worker = start_worker("stop")
    server = int(worker.stdout.readline())
    stopped = worker.stdout.readline().strip()
    worker.wait(timeout=30)
    assert stopped == str(server)
    assert not alive(server)
    assert alive(other_users_server.pid)
    assert _xrt.clean_stale_servers() == []


def test_a_live_workers_server_is_not_stale(state_dir):
    worker = start_worker("crash")  # stays alive, holding its server
    try:
        server = int(worker.stdout.readline())
        assert _xrt.clean_stale_servers() == []
        assert alive(server)
    finally:
        worker.kill()
        worker.wait()
        _xrt.clean_stale_servers()  # the test's own leftover
