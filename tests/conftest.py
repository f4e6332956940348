"""Shared fixtures: real local Ray clusters, shared by the modules that can share one, always
shut down.

Ray clusters are started once per kind and session (``shared_cluster``): one node with fake
accelerators (``one_node``) and two nodes (``two_nodes``); each module connects to one with its
own job ``runtime_env`` (test doubles, setup hooks) and disconnects at its end, which ends its
job's workers. The modules of one kind run one after another (``pytest_collection_modifyitems``),
so each kind starts once. Modules that change a cluster (add or drain nodes) start their own,
after the shared ones have ended. One cluster at a time in a pytest process: `make test` runs
two processes side by side (``run_suite.py``), so two clusters at a time on the machine.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from unittest import mock

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# torch_xla is installed (the suite's main environment, torch 2.9); `make test-native` runs the
# tests marked ``native`` where it is not (torch 2.13): the fits of a module that need it are
# left out there, and the tests that read them are not marked ``native``.
HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None
# Ray workers import the test modules that define training functions: put them on their path.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (TESTS_DIR, os.environ.get("PYTHONPATH", "")) if p
)
# Ray Train V2's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by
# default): every fit waits for a poll to see its workers start, report and finish. Every
# cluster the tests start (and its controllers) inherits this. No test asserts on report timing.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# Every temporary directory of a session (the tests', their Ray workers', the package's) lies
# under one directory of this pytest process, removed when the session ends: a run of the suite
# writes gigabytes (models, checkpoints) and leaves none of them behind. Ray keeps its session
# directory (its logs, which .ci/run prints on a failure) where it would be without this.
os.environ.setdefault("RAY_TMPDIR", tempfile.gettempdir())
SESSION_TMP = tempfile.mkdtemp(prefix="rtx-session-")
os.environ["TMPDIR"] = tempfile.tempdir = SESSION_TMP


@contextlib.contextmanager
def local_ray(num_cpus: int = 6, **init_kwargs):
    """A real local Ray instance of its own (fake resources, runtime_env, ... in
    ``init_kwargs``), shut down on exit even when a test fails."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    # address="local": never attach to a cluster another test or program left behind.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             **init_kwargs)
    try:
        yield ray
    finally:
        ray.shutdown()


# The shared clusters. one_node: enough CPUs for the biggest single-node test (4 workers plus
# Ray Data), fake TPU chips and NeuronCores (Ray assigns their ids and sets TPU_VISIBLE_CHIPS /
# NEURON_RT_VISIBLE_CORES only for workers that ask for them). two_nodes: per node 3 CPUs,
# 2 "slot"s (two workers asking for {"slot": 1} land per node), 2 fake NeuronCores and 2 fake
# TPU chips.
# one_node also exports Ray's metrics for Prometheus on a port of its own (its
# ``metrics_export_port``; only where Ray's metrics agent is installed, ``ray[default]``),
# every second rather than every 10 s, for ``test_goodput_ray.py``.
# Neither runs Ray Train V2's preemption watcher (an actor per worker group that polls the GCS
# for node drains, 2.5 s of CPU to start): no test on them drains a node. The tests of
# preemptions (test_elastic_ray.py, test_sharded_preemption.py) start clusters of their own, with
# the watcher.
NO_PREEMPTION_WATCHER = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
CLUSTERS = {
    "one_node": {"nodes": 1, "cpus_per_node": 6, "TPU": 4, "neuron_cores": 4, "metrics": True,
                 "env": NO_PREEMPTION_WATCHER},
    "two_nodes": {"nodes": 2, "cpus_per_node": 3, "neuron_cores": 2, "TPU": 2,
                  "env": NO_PREEMPTION_WATCHER},
}
_shared: dict = {}  # kind -> the running Cluster (at most one at a time)


def shared_cluster(kind: str):
    """The running cluster of this kind (started on first use, after shutting down the other
    kind's: one at a time in this process)."""
    if kind not in _shared:
        close_shared_clusters()
        _shared[kind] = new_cluster(**CLUSTERS[kind])
    return _shared[kind]


def close_shared_clusters() -> None:
    import ray

    if _shared and ray.is_initialized():
        ray.shutdown()
    while _shared:
        _, cluster = _shared.popitem()
        cluster.shutdown()


_session_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    close_shared_clusters()
    shutil.rmtree(SESSION_TMP, ignore_errors=True)
    _session_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Once pytest has reported everything, leave with its exit status without running the
    native libraries' teardown at interpreter exit. The tests run torch_xla (its PJRT client is
    never destroyed, pytorch/xla#9669), torch.distributed and Ray in this process; their
    destructors at exit segfaulted here once after a green session (`make test-e2e`: "25
    passed", then exit status 139), which CI would report as a failure of the suite."""
    if _session_status and "torch" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_session_status[-1])


def cluster_kind(item) -> str | None:
    for kind in CLUSTERS:
        if kind in item.fixturenames:
            return kind
    return None


def pytest_collection_modifyitems(session, config, items):
    """The tests without Ray first; then the modules of one shared cluster one after another;
    last the Ray tests that start clusters of their own (one cluster at a time in this process:
    the shared ones are shut down before them, ``pytest_runtest_setup``)."""
    def rank(item) -> int:
        kind = cluster_kind(item)
        if kind is not None:
            return 1 + list(CLUSTERS).index(kind)
        return 1 + len(CLUSTERS) if item.get_closest_marker("ray") else 0

    items.sort(key=rank)  # stable


def pytest_runtest_setup(item):
    if cluster_kind(item) is None and item.get_closest_marker("ray"):
        close_shared_clusters()


@pytest.fixture(scope="module")
def one_node():
    return shared_cluster("one_node")


@pytest.fixture(scope="module")
def two_nodes():
    return shared_cluster("two_nodes")


@pytest.fixture(autouse=True)
def fresh_runtime():
    """Each test in this process starts with a fresh toolkit runtime, as each training function
    does (``toolkit/runtime.py``), and ends it: options one test set do not reach the next.
    Nothing is imported for a test that has not loaded the toolkit."""
    module = sys.modules.get("ray_train_xla.toolkit.runtime")
    if module is not None:
        module.begin()
    yield
    module = sys.modules.get("ray_train_xla.toolkit.runtime")
    if module is not None:
        module.end()


@pytest.fixture(autouse=True)
def no_leftover_placement_groups():
    """After each test, remove the placement groups its fits left in this driver's job. Ray
    Train V2 keeps a run's placement group when the workers fail to start (our backend refusing
    a plan, a failed process group): its CPUs and accelerators stay taken while the job lives,
    and a later fit of the module that needs them waits forever."""
    yield
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import (
        PlacementGroup,
        placement_group_table,
        remove_placement_group,
    )

    job = ray.get_runtime_context().get_job_id()  # a placement group id ends with its job's
    for pg_id, info in placement_group_table().items():
        if pg_id.endswith(job) and info["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))


@contextlib.contextmanager
def connected(cluster, runtime_env=None):
    """This driver connected to ``cluster`` as a new job with ``runtime_env``; disconnected on
    exit (the job's workers end with it)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    # A copy: ray.init adds to the runtime_env it is given.
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env=copy.deepcopy(runtime_env))
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local(one_node):
    """Real Ray for a module: a job of its own on the shared one-node cluster."""
    with connected(one_node) as ray:
        yield ray


def fit(train_fn, num_workers: int = 1, torch_config=None, loop_config=None, **trainer_kwargs):
    """Run TorchTrainer.fit() and return (result, records): one JSON record per file the
    workers wrote into ``config["out_dir"]`` (Train V2 reports no metrics without a checkpoint).
    """
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import TorchXLAConfig

    out_dir = tempfile.mkdtemp(prefix="rtx-test-out-")
    config = dict(loop_config or {})
    config["out_dir"] = out_dir
    scaling = trainer_kwargs.pop("scaling_config", None) or ScalingConfig(num_workers=num_workers)
    run_config = trainer_kwargs.pop("run_config", None) or RunConfig(
        storage_path=tempfile.mkdtemp(prefix="rtx-test-results-")
    )
    result = TorchTrainer(
        train_fn,
        train_loop_config=config,
        torch_config=torch_config or TorchXLAConfig(device="cpu", timeout_s=120),
        scaling_config=scaling,
        run_config=run_config,
        **trainer_kwargs,
    ).fit()
    records = []
    for name in sorted(os.listdir(out_dir)):
        with open(os.path.join(out_dir, name)) as f:
            records.append(json.load(f))
    return result, records


def fit_failure(train_fn, **fit_kwargs) -> str:
    """Run ``fit()``, which must fail; return the error message the user sees."""
    with pytest.raises(Exception) as info:
        fit(train_fn, **fit_kwargs)
    return str(info.value)


def fit_in_background(trainer):
    """Start ``trainer.fit()`` in a daemon thread (the test acts on the cluster meanwhile);
    returns (the thread, the outcome: ``{"result": ...}`` or ``{"error": ...}`` once it ends)."""
    import threading

    outcome: dict = {}

    def run():
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 (the test reads it)
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def neuron_scaling(workers: int, cores_per_worker: int = 1):
    """ScalingConfig for workers with fake NeuronCores (``neuron_cores`` resource)."""
    from ray.train import ScalingConfig

    return ScalingConfig(num_workers=workers,
                         resources_per_worker={"CPU": 1, "neuron_cores": cores_per_worker})


def write_record(config: dict, name: str, record: dict) -> None:
    """Called on a worker: leave a JSON record for the test to read."""
    with open(os.path.join(config["out_dir"], f"{name}.json"), "w") as f:
        json.dump(record, f)


def is_train_v2() -> bool:
    from ray.train.v2._internal.constants import is_v2_enabled

    return is_v2_enabled()


DOUBLES_DIR = os.path.join(TESTS_DIR, "doubles")


def plan_on_cpu() -> dict:
    """A job runtime_env that lets a run ask for its Neuron or TPU plan to run on CPU workers
    (NEURON_ON_CPU, TPU_WITHOUT_CLIENT): see neuron_on_cpu.py. A new dict every time: ray.init
    adds to the runtime_env it is given."""
    return {"worker_process_setup_hook": "neuron_on_cpu.install"}


def with_neuron_doubles() -> dict:
    """A job runtime_env that puts the Neuron SDK test doubles on the workers' import path, and
    lets a run ask for its Neuron plan to run on CPU (``NEURON_ON_CPU``)."""
    return {"env_vars": {"PYTHONPATH": os.pathsep.join([DOUBLES_DIR, os.environ["PYTHONPATH"]])},
            **plan_on_cpu()}


# Workers here have no NeuronCores: with this in TorchXLAConfig.env (and a job started with
# with_neuron_doubles()), the process group runs on CPU/gloo while every other variable is the
# Neuron plan under test (see neuron_on_cpu.py).
NEURON_ON_CPU = {"RTX_TEST_NEURON_ON_CPU": "1"}
# Workers here have no TPU: with this in TorchXLAConfig.env (and a job started with
# plan_on_cpu()), the process group goes through gloo and SPMD is not switched on, so that no TPU
# client is created; everything else is the TPU plan under test.
TPU_WITHOUT_CLIENT = {"RTX_TEST_TPU_WITHOUT_CLIENT": "1"}


def new_cluster(nodes: int = 2, cpus_per_node: int = 3, metrics: bool = False,
                env: dict | None = None, **node_resources):
    """A Ray cluster of ``nodes`` nodes on this machine (``ray.cluster_utils.Cluster``), not
    connected. Every node gets ``slot`` = 2 so that two workers asking for ``{"slot": 1}`` land
    per node. ``metrics``: the head node serves Ray's metrics for Prometheus on a free port,
    ``cluster.metrics_export_port``, exported every second. ``env``: environment variables of
    the nodes' processes (their raylets pass them on to every worker and actor)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster()
    cluster.metrics_export_port = None
    try:
        with mock.patch.dict(os.environ, env or {}):
            _add_nodes(cluster, nodes, cpus_per_node, metrics, node_resources)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def _add_nodes(cluster, nodes: int, cpus_per_node: int, metrics: bool, node_resources: dict):
    for i in range(nodes):
        extra = {}
        if metrics and i == 0:
            cluster.metrics_export_port = extra["metrics_export_port"] = _free_port()
            extra["_system_config"] = {"metrics_report_interval_ms": 1000}
        cluster.add_node(
            num_cpus=cpus_per_node,
            resources={"slot": 2, **node_resources},
            include_dashboard=False,
            **extra,
        )
    cluster.wait_for_nodes()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(nodes: int = 2, cpus_per_node: int = 3, runtime_env=None, **node_resources):
    """A multi-node Ray cluster of its own (``new_cluster``), connected."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    cluster = new_cluster(nodes, cpus_per_node, **node_resources)
    try:
        ray.init(address=cluster.address, log_to_driver=False, runtime_env=runtime_env)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def stop_cluster(cluster) -> None:
    import ray

    ray.shutdown()
    cluster.shutdown()


def pytest_collection_finish(session):
    """On a machine without the cached torch-tpu environment of the TorchTPU contract tests
    (``test_native_tpu_contract.py``), start building it in the background at once: the
    install (about half a minute, mostly downloads and unpacking) overlaps the tests that run
    before that module, which waits for it (under the same lock) when it gets there. Not with
    ``RTX_SKIP_TORCH_TPU_CONTRACT=1``, which skips that module."""
    if not any(item.nodeid.startswith("tests/test_native_tpu_contract.py") or
               "test_native_tpu_contract.py" in item.nodeid for item in session.items):
        return
    import threading

    import test_native_tpu_contract as contract

    if contract.skipped() or os.path.exists(os.path.join(contract.VENV, ".complete")):
        return

    def build() -> None:
        try:
            contract.torch_tpu_python()
        except BaseException:  # noqa: BLE001 (the module reports its own failure)
            pass

    threading.Thread(target=build, name="torch-tpu-venv", daemon=True).start()


# ---- where the suite's time goes --------------------------------------------------------------
# With RTX_TEST_CPU=1: each test's wall time and the CPU time of this process and every process
# it started (Ray's clusters and workers, subprocesses), sampled from /proc every 0.2 s (a
# process's own time, kept after it ends: Ray reaps its workers without adding their time to any
# parent). A test whose wall time is far above half its CPU time (two cores here) waits rather
# than computes. The slowest RTX_TEST_CPU_TOP (default 30) are listed at the end, with totals.
_times: list[tuple[float, float, str]] = []
_cpu_seen: dict[tuple[int, str], float] = {}
_cpu_lock = None


def _sample_cpu() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stats[int(name)] = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
    ours = {os.getpid()}
    for pid in sorted(stats):  # a child's pid is almost always above its parent's: iterate
        chain, p = [], pid
        while p not in ours and p in stats and p > 1 and len(chain) < 64:
            chain.append(p)
            p = int(stats[p][1])  # ppid
        if p in ours:
            ours.update(chain)
    for pid in ours:
        fields = stats.get(pid)
        if fields is not None:
            # utime, stime: fields 14-15 of /proc/<pid>/stat; starttime (22) tells pids apart
            _cpu_seen[(pid, fields[19])] = (int(fields[11]) + int(fields[12])) / ticks


def _cpu_total() -> float:
    with _cpu_lock:
        _sample_cpu()
        return sum(_cpu_seen.values())


def pytest_sessionstart(session):
    global _cpu_lock
    if os.environ.get("RTX_TEST_CPU") != "1" or not os.path.isdir("/proc"):
        return
    import threading
    import time

    _cpu_lock = threading.Lock()

    def sample() -> None:
        while True:
            with _cpu_lock:
                _sample_cpu()
            time.sleep(0.2)

    threading.Thread(target=sample, name="rtx-test-cpu", daemon=True).start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _cpu_lock is None:
        yield
        return
    import time

    wall, cpu = time.monotonic(), _cpu_total()
    yield
    _times.append((time.monotonic() - wall, _cpu_total() - cpu, item.nodeid))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _times:
        return
    top = int(os.environ.get("RTX_TEST_CPU_TOP", "30"))
    write = terminalreporter.write_line
    terminalreporter.section("where the time goes (wall s, CPU s of the processes it started)")
    for w, c, nodeid in sorted(_times, reverse=True)[:top]:
        write(f"{w:8.1f} {c:8.1f}  {nodeid}")
    write(f"{sum(t[0] for t in _times):8.1f} {sum(t[1] for t in _times):8.1f}  "
          f"all {len(_times)} tests")
