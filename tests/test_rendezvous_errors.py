"""``init_process_group`` outside Ray, in plain processes: ``timeout_s`` bounds the ``xla://``
rendezvous and a missing rank is named; torch_xla's own initialisation errors are reported as
such, naming the variables at fault (through torch_xla's real Neuron import path). A group that
forms on the owned store is tested by every Ray fit (tests/test_ray_cpu.py: ``xla://`` for one
worker, ``env://`` for several)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from ray_train_xla import TorchXLAConfig
from ray_train_xla.planning import Rendezvous, plan
from ray_train_xla.planning.topology import Topology, WorkerFacts

from conftest import DOUBLES_DIR

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 5
SLACK_S = 30  # the bound: every rank gives up within timeout_s + 30 s
XLA_PG = {"RAY_TRAIN_XLA_PG_BACKEND": "xla", "RAY_TRAIN_XLA_INIT_METHOD": "xla://"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_envs(world: int, **env) -> list[dict]:
    """The CPU plan of ``world`` workers on one node, rendezvous on this host, through xla://
    (not the gloo env:// the CPU runtime picks for several workers)."""
    rdzv = Rendezvous(master_addr="127.0.0.1", master_port=_free_port(), run_id=f"t{world}")
    config = TorchXLAConfig(device="cpu", timeout_s=TIMEOUT_S)
    return [{**p.env, **XLA_PG, **env} for p in plan(Topology.uniform([world]), config, rdzv, "cpu")]


def neuron_spmd_envs() -> list[dict]:
    facts = [WorkerFacts(node_id=f"n{n}", node_ip="127.0.0.1", pid=1,
                         accelerator_ids={"neuron_cores": ("0", "1", "2", "3")}) for n in range(2)]
    rdzv = Rendezvous(master_addr="127.0.0.1", master_port=_free_port(), run_id="neuron",
                      extra_ports=(_free_port(),))
    config = TorchXLAConfig(device="neuron", spmd=True, timeout_s=TIMEOUT_S)
    return [p.env for p in plan(Topology.from_facts(facts, "neuron_cores"), config, rdzv,
                                "neuron", facts)]


def start(env: dict, neuron_import: bool = False) -> subprocess.Popen:
    """pg_worker.py with exactly ``env``; CPU runs import torch_xla before the clock starts."""
    path = [os.environ.get("PYTHONPATH", "")]
    extra = {"PATH": os.environ.get("PATH", "/usr/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    if neuron_import:  # torch_xla finds "libneuronxla" and runs its Neuron init at import
        path.insert(0, DOUBLES_DIR)
        extra["RTX_TEST_NEURON_IMPORT"] = "1"
    args = [] if neuron_import else ["--preimport"]
    return subprocess.Popen([sys.executable, os.path.join(HERE, "pg_worker.py"), *args],
                            env={**env, **extra, "PYTHONPATH": os.pathsep.join(path)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, err[-3000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def runs():
    """Every scenario's processes, started together (each pays its own imports)."""
    three = cpu_envs(3)
    two = cpu_envs(2)
    neuron = neuron_spmd_envs()
    unfixed = {k: v for k, v in neuron[0].items() if k != "XLA_USE_SPMD"}
    procs = {
        "rank2-missing": [start(three[0]), start(three[1])],  # rank 2 never starts
        "rank0-missing": [start(two[1])],  # nobody serves the store
        "neuron-unfixed": [start(unfixed, neuron_import=True)],
        "neuron-spmd": [start(neuron[0], neuron_import=True)],  # rank 1 never starts
    }
    return {name: [result(p) for p in ps] for name, ps in procs.items()}


def test_missing_rank_is_named_within_timeout(runs):
    rank0, rank1 = runs["rank2-missing"]
    assert rank0["error_type"] == "RendezvousTimeoutError", rank0
    assert "rank 2 (of 3) did not arrive" in rank0["error"]
    assert f"timeout_s={TIMEOUT_S}" in rank0["error"]
    # Rank 1 names rank 2 too, unless rank 0 (which arrived first) gave up first and took the
    # store with it; then it says so and points at rank 0's error.
    assert rank1["error_type"] == "RendezvousTimeoutError", rank1
    assert ("rank 2 (of 3) did not arrive" in rank1["error"]
            or "rank 0, which serves the store, gave up" in rank1["error"]), rank1
    for res in (rank0, rank1):
        assert res["elapsed_s"] < TIMEOUT_S + SLACK_S, res  # torch_xla's own store: 300 s


def test_missing_rank_0_is_named_within_timeout(runs):
    (res,) = runs["rank0-missing"]
    assert res["error_type"] == "RendezvousTimeoutError", res
    assert "rank 0 did not arrive" in res["error"] and "127.0.0.1:" in res["error"]
    assert res["elapsed_s"] < TIMEOUT_S + SLACK_S, res


def test_torch_xla_init_error_is_reported_as_such_naming_the_variables(runs):
    # The Neuron SPMD plan as it was (no XLA_USE_SPMD), through torch_xla's real import path.
    (res,) = runs["neuron-unfixed"]
    assert res["error_type"] == "XLAInitError", res
    message = res["error"]
    assert "torch_xla's initialisation failed" in message
    assert "is not equal to count 4" in message
    assert "NEURON_RT_VISIBLE_CORES='0,1,2,3'" in message and "LOCAL_WORLD_SIZE='1'" in message
    assert "worker rank 0" in message
    assert "MASTER_ADDR" not in message  # not blamed on the network


def test_neuron_spmd_plan_passes_torch_xla_import_then_waits_bounded(runs):
    # The planned environment gets through torch_xla's Neuron init at import; rank 1 never
    # comes, and that is what the error says (the time here includes the import: not asserted).
    (res,) = runs["neuron-spmd"]
    assert res["error_type"] == "RendezvousTimeoutError", res
    assert "rank 1 (of 2) did not arrive" in res["error"]


def test_missing_torch_xla_is_named_as_such():
    from ray_train_xla.startup.process_group import describe_xla_init_error

    exc = ModuleNotFoundError("No module named 'torch_xla'", name="torch_xla")
    assert "torch_xla cannot be imported on this worker" in describe_xla_init_error(exc)


def test_a_gloo_failure_names_where_each_rank_published_its_listener():
    """gloo_listeners reads back what gloo's connectFullMesh published, for the error message:
    checked against the listening socket gloo opened in that process."""
    code = """
import json, os, socket
from datetime import timedelta
import torch.distributed as dist
from ray_train_xla.startup.process_group import gloo_listeners
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=30))
before = {f for f in os.listdir("/proc/self/fd")}
dist.init_process_group("cpu:gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
text = gloo_listeners(store, 2)
ports = []
for fd in set(os.listdir("/proc/self/fd")) - before:
    try:
        sock = socket.socket(fileno=int(fd))
        if sock.type == socket.SOCK_STREAM and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            ports.append(sock.getsockname()[1])
        sock.detach()
    except OSError:
        pass
print(json.dumps({"text": text, "ports": ports}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["text"].startswith(" gloo listeners as published: rank 0: "), got
    assert "rank 1: none" in got["text"]
    published = int(got["text"].split("rank 0: ")[1].split(" ")[0].rsplit(":", 1)[1])
    assert published in got["ports"], got  # the port gloo listens on in that process


def _devmode_envs(world: int, run_id: str) -> list[dict]:
    """The CPU plan of several workers as planned: the development mode's gloo group, env://."""
    rdzv = Rendezvous(master_addr="127.0.0.1", master_port=_free_port(), run_id=run_id)
    config = TorchXLAConfig(device="cpu", timeout_s=60)
    return [p.env for p in plan(Topology.uniform([world]), config, rdzv, "cpu")]


def _start_retry_worker(env: dict, fail_rank: int, kind: str) -> subprocess.Popen:
    extra = {"PATH": os.environ.get("PATH", "/usr/bin"), "HOME": os.environ.get("HOME", "/tmp"),
             "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "pg_retry_worker.py"), "--fail-once", str(fail_rank),
         kind], env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_gloo_connection_failure_on_one_rank_restarts_the_group_on_every_rank():
    """Rank 1's first start fails the way gloo's does when a connection it did not expect
    reaches its listener; the other ranks started theirs. Every rank starts the group again and
    it works; any other error is not retried, on any rank."""
    gloo = [_start_retry_worker(e, 1, "gloo") for e in _devmode_envs(3, "retry")]
    other = [_start_retry_worker(e, 1, "other") for e in _devmode_envs(2, "noretry")]
    gloo_out, other_out = [result(p) for p in gloo], [result(p) for p in other]
    for rank, out in enumerate(gloo_out):
        assert out["ok"] and out["total"] == 6.0, (rank, out)  # 1 + 2 + 3 over the new group
        assert out["attempts"] == 2, (rank, out)
    assert not any(out["ok"] for out in other_out)
    assert all(out["attempts"] == 1 for out in other_out), other_out
    assert "some other failure (injected)" in other_out[1]["error"]
    assert "not on rank(s) [1]" in other_out[0]["error"]


def test_the_development_modes_group_creates_no_gloo_context_it_drops():
    """The default group of the CPU development mode is its host-bridge backend. Started as
    ``cpu:gloo,xla:xla_host``, torch also created a gloo backend for "cpu", connected it to every
    rank, then dropped it (a Python ProcessGroup backend becomes the whole group), closing its
    connections while other ranks could still be connecting: gloo's intermittent
    "connectFullMesh failed ... Connection closed by peer" at start. Now nothing is dropped."""
    code = """
import gc, json, weakref
from datetime import timedelta
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from ray_train_xla.planning.contract import DEVMODE_BACKEND
from ray_train_xla.startup import devmode

made = []
class Spy(dist.ProcessGroupGloo):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        made.append(weakref.ref(self))
c10d.ProcessGroupGloo = Spy
devmode.register_backend()
dist.init_process_group(DEVMODE_BACKEND, store=dist.HashStore(), rank=0, world_size=1,
                        timeout=timedelta(seconds=30))
gc.collect()
print(json.dumps({"made": len(made), "dropped": sum(r() is None for r in made),
                  "group": type(c10d._get_default_group()).__name__,
                  "backend": dist.get_backend()}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"made": 0, "dropped": 0, "group": "HostBridgeGroup", "backend": "xla_host"}
