"""Neuron on a real local Ray with fake ``neuron_cores``: the environment workers really get,
torch_xla's Neuron init on it, and the parallel-compile workflow with the SDK's test double."""

import os
import subprocess
import sys
import tempfile
import threading

import pytest

from ray_train_xla import TorchXLAConfig

from conftest import (
    NEURON_ON_CPU,
    connected,
    fit,
    fit_failure,
    is_train_v2,
    neuron_scaling,
    with_neuron_doubles,
)
from neuron_probe import compile_records, neuron_env_probe, start_fake_xrt_server

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def neuron_ray(one_node):
    # Ray assigns and exports NEURON_RT_VISIBLE_CORES for neuron_cores even without Neuron
    # (the shared node has 4).
    with connected(one_node, runtime_env=with_neuron_doubles()) as ray:
        yield ray


def test_workers_get_the_core_ray_assigned_them(neuron_ray):
    ray = neuron_ray

    @ray.remote(num_cpus=0, resources={"neuron_cores": 1})
    class CoreHolder:  # holds core 0, so the trainer's cores do not start at 0
        def cores(self):
            return ray.get_runtime_context().get_accelerator_ids()["neuron_cores"]

    holder = CoreHolder.remote()
    try:
        held = ray.get(holder.cores.remote())
        _, records = fit(neuron_env_probe, torch_config=TorchXLAConfig(
            device="auto", timeout_s=120, env=NEURON_ON_CPU), scaling_config=neuron_scaling(2))
    finally:
        ray.kill(holder)
    assert len(records) == 2
    node_list = {r["planned"]["NEURON_RT_VISIBLE_CORES"] for r in records}
    assert len(node_list) == 1  # one node-local list for the trainer's workers
    by_local = sorted(records, key=lambda r: int(r["planned"]["LOCAL_RANK"]))
    assert node_list.pop() == ",".join(r["ray_cores"][0] for r in by_local)
    for r in records:
        assert r["graph_extraction_mark"] is None  # a real run's metrics are not marked
        assert len(r["ray_cores"]) == 1 and r["ray_cores"] != held
        assert r["after_init"] == r["ray_cores"][0]  # torch_xla's remap lands on Ray's core
        assert r["after_index"] == r["planned"]["RANK"]
        addr, port = r["planned"]["NEURON_RT_ROOT_COMM_ID"].rsplit(":", 1)
        assert port not in (r["planned"]["MASTER_PORT"], "62182")


def compile_config(record_dir, **kw):
    env = dict(NEURON_ON_CPU, RTX_TEST_RECORD_DIR=record_dir, **kw.pop("env", {}))
    return TorchXLAConfig(device="neuron", neuron_parallel_compile=True, timeout_s=120, env=env,
                          **kw)


@pytest.mark.e2e
@pytest.mark.skipif(not is_train_v2(), reason="two trainers at once on one driver: Train V2")
def test_two_trainers_at_once_compile_in_private_workdirs(neuron_ray):
    records_dir = tempfile.mkdtemp(prefix="rtx-compile-")
    configs = [
        compile_config(records_dir, compile_cache=os.path.join(records_dir, "cache-a"),
                       env={"RTX_TEST_COMPILE_SECONDS": "3"}),
        compile_config(records_dir, compile_cache=os.path.join(records_dir, "cache-b"),
                       env={"RTX_TEST_COMPILE_SECONDS": "3",
                            "NEURON_CC_FLAGS": "-O1 --cache_dir=/shared/flags-cache"}),
    ]
    results, errors = [None, None], []

    def run(i):
        try:
            results[i] = fit(neuron_env_probe, torch_config=configs[i],
                             scaling_config=neuron_scaling(2))
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    calls = compile_records(records_dir)
    # one node per trainer, so exactly one compile per trainer, on local rank 0
    assert len(calls) == 2
    assert all(c["local_rank"] == "0" for c in calls)
    assert len({c["run_id"] for c in calls}) == 2
    assert len({c["work_dir"] for c in calls}) == 2
    for c in calls:
        assert c["work_dir_exists"] and c["work_dir_mode"] == "0o700"
        assert not os.path.exists(c["work_dir"])  # removed afterwards
        assert c["cache_url_type"] == "CacheUrl"
    assert sorted(c["cache_url"] for c in calls) == sorted(
        [os.path.join(records_dir, "cache-a"), "/shared/flags-cache"])  # --cache_dir wins
    for _, records in results:
        assert {r["planned"]["NEURON_EXTRACT_GRAPHS_ONLY"] for r in records} == {"1"}
        assert {r["graph_extraction_mark"] for r in records} == {1}  # metrics are marked


def test_a_failed_compile_fails_the_run_with_the_compiler_message(neuron_ray):
    records_dir = tempfile.mkdtemp(prefix="rtx-compile-")
    message = fit_failure(neuron_env_probe, scaling_config=neuron_scaling(1),
                          torch_config=compile_config(records_dir,
                                                      env={"RTX_TEST_COMPILE_FAIL": "1"}))
    assert "compilation of graph MODULE_42 failed" in message
    assert len(compile_records(records_dir)) == 1


def test_a_missing_compile_module_fails_at_start_naming_the_worker(neuron_ray):
    records_dir = tempfile.mkdtemp(prefix="rtx-compile-")
    message = fit_failure(neuron_env_probe, scaling_config=neuron_scaling(1),
                          torch_config=compile_config(records_dir,
                                                      env={"RTX_TEST_HIDE_NEURON": "1"}))
    assert "worker rank 0" in message
    assert "libneuronxla.neuron_parallel_compile" in message
    assert compile_records(records_dir) == []


@pytest.mark.e2e
def test_xrt_runtime_stops_the_servers_its_workers_started(neuron_ray):
    from ray_train_xla.startup import xrt as _xrt

    fake_server = os.path.join(os.path.dirname(__file__), "doubles", "xrt_run_server.py")
    other = subprocess.Popen([sys.executable, fake_server, "120"])
    try:
        _, records = fit(
            start_fake_xrt_server,
            loop_config={"fake_server": fake_server},
            torch_config=TorchXLAConfig(device="neuron", runtime="xrt", timeout_s=60,
                                        env=NEURON_ON_CPU),
            scaling_config=neuron_scaling(2),
        )
        assert {r["runtime"] for r in records} == {"xrt"}
        assert {r["group_world_size"] for r in records} == {"1"}
        for r in records:
            assert _xrt.start_time(r["server"]) is None  # stopped at shutdown
        assert _xrt.start_time(other.pid) is not None  # not ours: untouched
    finally:
        other.kill()
        other.wait()


@pytest.mark.e2e  # the refusal itself: test_neuron_plan.py and test_native_plan.py, in make test
def test_two_cores_per_worker_are_refused_at_start_with_the_fix(neuron_ray):
    message = fit_failure(
        neuron_env_probe, scaling_config=neuron_scaling(1, cores_per_worker=2),
        torch_config=TorchXLAConfig(device="neuron", timeout_s=60, env=NEURON_ON_CPU))
    assert "2 neuron_cores per worker" in message
    assert "resources_per_worker={'neuron_cores': 1} and num_workers=2" in message
