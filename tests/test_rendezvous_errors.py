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

from ray_train_xla import TorchNeuronConfig, TorchXLAConfig
from ray_train_xla.planning import Rendezvous, plan
from ray_train_xla.planning.contract import WorkerContext
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


def start(env: dict, neuron_import: bool = False, args: list[str] | None = None,
          doubles: bool = False) -> subprocess.Popen:
    """pg_worker.py with exactly ``env``; CPU runs import torch_xla before the clock starts
    (unless ``args`` are given); ``doubles`` puts the Neuron doubles on the path."""
    path = [os.environ.get("PYTHONPATH", "")]
    extra = {"PATH": os.environ.get("PATH", "/usr/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    if neuron_import or doubles:
        path.insert(0, DOUBLES_DIR)
    if neuron_import:  # torch_xla finds "libneuronxla" and runs its Neuron init at import
        extra["RTX_TEST_NEURON_IMPORT"] = "1"
    if args is None:
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
    published = int(got["text"].split("rank 0: ")[1].split(";")[0].rsplit(":", 1)[1])
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


# ---------------------------------------------------------------------------------------------
# Waits inside libraries that take no timeout: the store's port, the store client, the device
# runtime's client creation, the native Neuron barrier.
# ---------------------------------------------------------------------------------------------

GRACE_S = 2  # watchdog.GRACE_S: past the deadline, the library's own error may come first
SMALL_SLACK_S = 8  # process start-up noise on a shared 2-core machine


def test_the_reserved_master_port_stays_taken_until_rank_0s_store_serves_it():
    """The port the backend reserves on rank 0's worker (``on_start``) stays bound and
    listening there: another process cannot take it before the store does; rank 0's store then
    serves on that very socket and clients reach it."""
    from datetime import timedelta

    import torch.distributed as dist

    from ray_train_xla.startup import facts, netinfo, rendezvous

    master, extra = facts.reserve_ports(2)
    with socket.socket() as other:
        with pytest.raises(OSError) as taken:
            other.bind(("", master))
    assert taken.value.errno == 98  # EADDRINUSE: nobody else can listen there
    with socket.socket() as other:
        other.bind(("", extra))  # the extra ports are released for their users
    ctx = WorkerContext(rank=0, world_size=1, master_addr="127.0.0.1", master_port=master,
                        run_id="held", timeout_s=5)
    store = rendezvous.join(ctx, timedelta(seconds=5))
    assert master not in netinfo._held  # handed over to the store
    client = dist.TCPStore("127.0.0.1", master, is_master=False, timeout=timedelta(seconds=5))
    assert client.get("ray_train_xla/held/arrived/0") == str(os.getpid()).encode()
    del client, store


def result_within(proc: subprocess.Popen, seconds: float) -> dict:
    """pg_worker's JSON line, or ``{"hung": True}`` when it had not ended after ``seconds``
    (then it is killed)."""
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"hung": True, "after_s": seconds, "stderr": err[-2000:]}
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, err[-3000:]
    return json.loads(lines[-1])


def ended_within(proc: subprocess.Popen, seconds: float) -> dict:
    """How pg_worker ended (exit code, stderr), or ``{"hung": True}`` after ``seconds``."""
    try:
        _, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"hung": True, "after_s": seconds}
    return {"returncode": proc.returncode, "stderr": err}


def native_neuron_env(**extra) -> dict:
    """The native TorchNeuron plan of one worker on one NeuronCore, rendezvous on this host."""
    facts = [WorkerFacts(node_id="n0", node_ip="127.0.0.1", pid=1,
                         accelerator_ids={"neuron_cores": ("0",)})]
    rdzv = Rendezvous(master_addr="127.0.0.1", master_port=_free_port(), run_id="native",
                      extra_ports=(_free_port(),))
    config = TorchNeuronConfig(device="neuron", timeout_s=TIMEOUT_S)
    (p,) = plan(Topology.from_facts(facts, "neuron_cores"), config, rdzv, "neuron", facts)
    return {**p.env, **extra}


@pytest.fixture(scope="module")
def hung():
    """Waits that no library bounds, each in its own processes, started together."""
    taken = cpu_envs(2)
    foreign = socket.socket()  # another process's listener on the planned port, which it
    foreign.bind(("127.0.0.1", int(taken[0]["MASTER_PORT"])))  # took after the port was
    foreign.listen(16)  # released (as it was before rank 0's worker held it): it never answers
    try:
        procs = {
            "port-taken": [start(e) for e in taken],
            "pjrt-client": [start(cpu_envs(1)[0], args=["--preimport", "--hang-in-client-creation"])],
            "neuron-barrier": [start(native_neuron_env(RTX_TEST_NEURON_BARRIER_HANG="1"),
                                     args=["--native"], doubles=True)],
        }
        holding = start(cpu_envs(1)[0], args=["--preimport", "--hang-in-client-creation",
                                              "--holding-the-gil"])
        runs = {name: [result_within(p, 120) for p in ps] for name, ps in procs.items()}
        runs["holding-the-gil"] = [ended_within(holding, 120)]
        yield runs
    finally:
        foreign.close()


def test_a_port_another_process_took_is_named_and_no_rank_hangs(hung):
    rank0, rank1 = hung["port-taken"]
    assert not rank0.get("hung") and not rank1.get("hung"), (rank0, rank1)
    assert rank0["error_type"] == "WorkerSetupError", rank0
    assert "rank 0 cannot serve the rendezvous store at 127.0.0.1:" in rank0["error"]
    assert "another process took that port (EADDRINUSE)" in rank0["error"]
    assert "did not arrive" not in rank0["error"]
    assert rank1["error_type"] == "RendezvousTimeoutError", rank1
    assert "connecting to the rendezvous store that rank 0 serves at 127.0.0.1:" in rank1["error"]
    assert f"did not finish within timeout_s={TIMEOUT_S}" in rank1["error"]
    assert "no store answered there: another process listens on that port" in rank1["error"]
    for res in (rank0, rank1):
        assert res["elapsed_s"] < TIMEOUT_S + GRACE_S + SMALL_SLACK_S, res


def test_a_pjrt_client_creation_that_never_ends_fails_the_worker_within_timeout(hung):
    (res,) = hung["pjrt-client"]
    assert not res.get("hung"), res
    assert res["error_type"] == "WorkerSetupError", res
    assert "torch_xla's xla:// process-group start (the device runtime's PJRT client creation" in res["error"]
    assert f"did not finish within timeout_s={TIMEOUT_S}" in res["error"]
    assert res["elapsed_s"] < TIMEOUT_S + GRACE_S + SMALL_SLACK_S, res


def test_a_neuron_barrier_that_never_ends_fails_the_worker_within_timeout(hung):
    (res,) = hung["neuron-barrier"]
    assert not res.get("hung"), res
    assert res["error_type"] == "WorkerSetupError", res
    assert "the native Neuron process group's start (ProcessGroupNeuron" in res["error"]
    assert "barrier across ranks" in res["error"]
    assert f"did not finish within timeout_s={TIMEOUT_S}" in res["error"]
    assert "worker rank 0" in res["error"]
    assert res["elapsed_s"] < TIMEOUT_S + GRACE_S + SMALL_SLACK_S, res


def test_a_call_that_keeps_pythons_lock_is_ended_by_the_backstop(hung):
    """The watchdog's thread cannot wake up while a C call keeps Python's global lock: the
    backstop outside Python dumps every thread's stack, the stuck call among them, and ends the
    worker process (timeout_s + 2 s + 10 s after the call began)."""
    (res,) = hung["holding-the-gil"]
    assert not res.get("hung"), res
    assert res["returncode"] != 0, res
    assert "Timeout (0:00:1" in res["stderr"], res["stderr"][-3000:]  # 5 + 2 + 10 s
    assert "in client_never_created" in res["stderr"]  # the stuck call, on the watchdog's thread
    assert "ray_train_xla/startup/watchdog.py" in res["stderr"]


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


RESTARTS = 30

RESTART_LOOP = """
import json, os, random, sys, time
from datetime import timedelta
import torch, torch_xla
import torch.distributed as dist
from ray_train_xla.startup import devmode

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
backend = os.environ["RAY_TRAIN_XLA_PG_BACKEND"]
devmode.register_backend()
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                      rank == 0, timedelta(seconds=30))
random.seed(rank)
if os.environ["GROUP_RANK"] != "0":
    os.nice(19)  # the second node is busy: its workers get the cores last
started = 0
for i in range(int(sys.argv[1])):
    if os.environ["GROUP_RANK"] != "0":  # the second node's workers come a moment later
        time.sleep(random.random() * 0.05)
    dist.init_process_group(backend, store=dist.PrefixStore(f"start{i}", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    t = torch.ones(3, device=torch_xla.device())
    dist.all_reduce(t)  # the host bridge's own gloo group
    host = dist.new_group(backend="gloo")  # as the development mode's install() makes one
    c = torch.ones(2)
    dist.all_reduce(c, group=host)
    assert t.cpu().tolist() == [world] * 3 and c.tolist() == [world] * 2
    dist.destroy_process_group()
    started += 1
print(json.dumps({"rank": rank, "started": started}))
"""


@pytest.mark.e2e
def test_the_development_mode_group_of_4_workers_on_2_nodes_starts_30_times_in_a_row():
    """The CPU plan of 4 workers on 2 nodes; its process group (the development mode's, as
    planned) started, used (host bridge and a gloo subgroup) and ended 30 times in a row in
    the same 4 processes on a busy machine, the second node's workers a little later each
    time and with the lowest CPU priority: every start works at the first try (no retry
    anywhere on this path)."""
    rdzv = Rendezvous(master_addr="127.0.0.1", master_port=_free_port(), run_id="restarts")
    envs = [p.env for p in plan(Topology.uniform([2, 2]), TorchXLAConfig(device="cpu"), rdzv, "cpu")]
    assert {e["RAY_TRAIN_XLA_PG_BACKEND"] for e in envs} == {"xla_host"}
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1", "1"]
    extra = {"PATH": os.environ.get("PATH", "/usr/bin"), "HOME": os.environ.get("HOME", "/tmp"),
             "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    # A busy machine (a spinning process; the second node's workers niced): the former group
    # (`cpu:gloo,xla:xla_host`) failed here within the 30 starts in 5 runs of 5 (gloo's
    # "connectFullMesh failed ... Connection closed by peer", or the ranks left waiting for it),
    # as it did in Ray runs; the same loop on an idle machine did not fail in 100 starts.
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])]
    procs = [subprocess.Popen([sys.executable, "-c", RESTART_LOOP, str(RESTARTS)],
                              env={**env, **extra}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for env in envs]
    outs, errors = [], []
    try:
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=240)
            if p.returncode:
                errors.append(f"rank {r}: {err[-1500:]}")
            else:
                outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs + busy:
            if p.poll() is None:
                p.kill()
    assert not errors, "\n".join(errors)
    assert outs == [{"rank": r, "started": RESTARTS} for r in range(4)]
