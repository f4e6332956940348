"""TPU planning and SPMD configuration: pure planner tests, configuration errors, and the
contract test that feeds the planned env to torch_xla's own ``configure_topology``."""

import json
import subprocess
import sys

import pytest

from ray_train_xla import TorchXLAConfig, XLAConfigError
from ray_train_xla.planning import Rendezvous, plan, resolve_device
from ray_train_xla.planning.topology import Topology, WorkerFacts
from ray_train_xla.tools.cli import main as cli_main

RDZV = Rendezvous(master_addr="10.0.0.1", master_port=29500, run_id="run-1")
TPU_VARS = ["TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS",
            "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID"]


def tpu_facts(chips_by_worker, node_of):
    """One WorkerFacts per worker: its node (index) and the TPU ids Ray gave it."""
    return [
        WorkerFacts(node_id=f"node{n}", node_ip=f"10.0.0.{n + 1}", pid=100 + i,
                    accelerator_ids={"TPU": tuple(chips)} if chips else {})
        for i, (chips, n) in enumerate(zip(chips_by_worker, node_of))
    ]


def tpu_plan(facts, **config):
    topology = Topology.from_facts(facts, "TPU")
    return plan(topology, TorchXLAConfig(device="tpu", **config), RDZV, "tpu", facts)


def per_chip(hosts, chips):
    return tpu_plan(tpu_facts([[str(c)] for _ in range(hosts) for c in range(chips)],
                              [h for h in range(hosts) for _ in range(chips)]))


def test_auto_resolves_tpu_from_ray_resources():
    assert resolve_device("auto", tpu_facts([["0"], ["1"]], [0, 0])) == "tpu"


def test_per_chip_plan_two_hosts():
    plans = per_chip(2, 4)
    addresses = [f"10.0.0.{h}:{8476 + c}" for h in (1, 2) for c in range(4)]
    for p in plans:
        env, place = p.env, p.place
        assert env["PJRT_DEVICE"] == "TPU"
        assert env["TPU_VISIBLE_CHIPS"] == str(place.local_rank)
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == env["TPU_CHIPS_PER_HOST_BOUNDS"] == "1,1,1"
        assert env["TPU_PROCESS_BOUNDS"] == env["TPU_HOST_BOUNDS"] == "2,2,2"
        assert env["CLOUD_TPU_TASK_ID"] == env["RANK"]
        assert env["TPU_PROCESS_PORT"] == str(8476 + place.local_rank)
        assert env["TPU_PROCESS_ADDRESSES"].split(",") == addresses
        assert env["RAY_TRAIN_XLA_PG_BACKEND"] == "xla"
        assert "RAY_TRAIN_XLA_SPMD" not in env


def test_per_chip_follows_the_chips_ray_assigned():
    # Two workers on chips 3 and 1 of one host (another job holds 0 and 2): each sees its own
    # chip, ports follow chip ids (no clash with the other job), task ids follow chip order.
    plans = tpu_plan(tpu_facts([["3"], ["1"]], [0, 0]))
    env0, env1 = plans[0].env, plans[1].env
    assert (env0["TPU_VISIBLE_CHIPS"], env1["TPU_VISIBLE_CHIPS"]) == ("3", "1")
    assert (env0["TPU_PROCESS_PORT"], env1["TPU_PROCESS_PORT"]) == ("8479", "8477")
    assert (env0["CLOUD_TPU_TASK_ID"], env1["CLOUD_TPU_TASK_ID"]) == ("1", "0")
    assert env0["TPU_PROCESS_ADDRESSES"] == "localhost:8477,localhost:8479"
    assert env0["TPU_PROCESS_BOUNDS"] == "1,2,1"


def test_spmd_plan_one_process_per_host_with_all_chips():
    facts = tpu_facts([["0", "1", "2", "3"], ["0", "1", "2", "3"]], [0, 1])
    plans = tpu_plan(facts, spmd=True)
    for p in plans:
        env = p.env
        assert env["TPU_VISIBLE_CHIPS"] == "0,1,2,3"
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
        assert env["TPU_PROCESS_BOUNDS"] == "1,1,2"
        assert env["CLOUD_TPU_TASK_ID"] == str(p.place.node_rank)
        assert env["TPU_PROCESS_ADDRESSES"] == "10.0.0.1:8476,10.0.0.2:8476"
        assert (env["RAY_TRAIN_XLA_PG_BACKEND"], env["RAY_TRAIN_XLA_INIT_METHOD"]) == (
            "gloo", "xla://")
        assert env["RAY_TRAIN_XLA_SPMD"] == "1"


def test_cpu_spmd_plan():
    topology = Topology.uniform([1])
    env = plan(topology, TorchXLAConfig(device="cpu", spmd=True, cpu_devices_per_worker=4),
               RDZV, "cpu")[0].env
    assert env["CPU_NUM_DEVICES"] == "4" and env["RAY_TRAIN_XLA_SPMD"] == "1"
    assert (env["RAY_TRAIN_XLA_PG_BACKEND"], env["RAY_TRAIN_XLA_INIT_METHOD"]) == ("gloo", "xla://")


def test_tpu_process_bounds_option_sets_the_process_grid():
    facts = tpu_facts([[str(c)] for c in range(4)], [0] * 4)
    env = tpu_plan(facts, tpu_process_bounds="4,1,1")[0].env
    assert env["TPU_PROCESS_BOUNDS"] == env["TPU_HOST_BOUNDS"] == "4,1,1"
    with pytest.raises(XLAConfigError, match="a grid of 4 processes"):
        tpu_plan(facts, tpu_process_bounds="2,1,1")
    with pytest.raises(XLAConfigError, match="positive integers"):
        TorchXLAConfig(device="tpu", tpu_process_bounds="4x1x1")
    with pytest.raises(XLAConfigError, match="device='cpu'"):
        TorchXLAConfig(device="cpu", tpu_process_bounds="4,1,1")


@pytest.mark.parametrize(
    "kwargs,field,match",
    [
        (dict(spmd=True, runtime="xrt", device="neuron"), "spmd", "runtime='xrt'"),
        (dict(spmd=1), "spmd", "True or False"),
        (dict(cpu_devices_per_worker=0), "cpu_devices_per_worker", "positive integer"),
        (dict(cpu_devices_per_worker=2.5), "cpu_devices_per_worker", "positive integer"),
        (dict(cpu_devices_per_worker=4), "cpu_devices_per_worker", "without spmd=True"),
        (dict(device="tpu", spmd=True, cpu_devices_per_worker=4), "cpu_devices_per_worker",
         "device='tpu'"),
    ],
)
def test_config_errors(kwargs, field, match):
    with pytest.raises(XLAConfigError, match=f"TorchXLAConfig.{field}=") as err:
        TorchXLAConfig(**kwargs)
    assert match in str(err.value)


@pytest.mark.parametrize(
    "device,chips,nodes,spmd,match",
    [
        ("cpu", [[], []], [0, 0], True, "expected a single worker with spmd=True on the CPU device"),
        ("tpu", [["0", "1"], ["2", "3"]], [0, 0], True, "node 0 (10.0.0.1) has 2 workers"),
        ("tpu", [["0", "1"]], [0], False, "one TPU chip per worker"),
        ("tpu", [[]], [0], True, "was given none"),
        ("tpu", [["0"], ["1"], ["0"]], [0, 0, 1], False, "same number"),
        ("tpu", [[str(c)] for c in range(3)], [0] * 3, False, "got 3"),
    ],
    ids=["cpu-spmd-2-per-node", "tpu-spmd-2-per-node", "per-chip-2-chips", "spmd-no-chips",
         "uneven-hosts", "3-chips"],
)
def test_topology_errors(device, chips, nodes, spmd, match):
    facts = tpu_facts(chips, nodes)
    topology = Topology.from_facts(facts, "TPU")
    with pytest.raises(XLAConfigError, match="is not valid") as err:
        plan(topology, TorchXLAConfig(device=device, spmd=spmd), RDZV, device, facts)
    assert match in str(err.value)


def test_cli_plan_tpu(capsys):
    assert cli_main(["plan", "--device", "tpu", "--nodes", "2", "--accelerators-per-worker", "4",
                     "--spmd", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["env"]["TPU_VISIBLE_CHIPS"] for r in rows] == ["0,1,2,3", "0,1,2,3"]
    assert cli_main(["plan", "--device", "tpu", "--workers-per-node", "2", "--spmd"]) == 2
    assert "has 2 workers" in capsys.readouterr().err


# ---- contract: torch_xla's own configure_topology, fed exactly the planned environment ----

_CONTRACT = r"""
import json, os, sys
import torch_xla._internal.tpu as tpu
out = []
for env, local_rank, local_world in json.loads(sys.stdin.read()):
    os.environ.clear()
    os.environ.update(env)
    tpu.configure_topology(local_rank, local_world, base_port=8476)
    out.append(dict(os.environ))
print(json.dumps(out))
"""


def _configure_topology(cases):
    """Run configure_topology in one fresh interpreter, each case with exactly its env."""
    proc = subprocess.run([sys.executable, "-c", _CONTRACT], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=180, env={"PATH": "/usr/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


HOSTS = {"1x4": 1, "2x4": 2}


@pytest.fixture(scope="module")
def topology_results():
    """For each slice of HOSTS: the per-chip plans, and configure_topology's environment after
    each planned one and after torch_xla's own derivation from the slice's metadata (every case
    in one interpreter)."""
    cases, spans = [], {}
    for name, hosts in HOSTS.items():
        plans = per_chip(hosts, 4)
        ips = ",".join(f"10.0.0.{h + 1}" for h in range(hosts))
        accel = f"v4-{8 * hosts}"
        # The metadata torch_xla reads with TPU_SKIP_MDS_QUERY: a v4 slice of `hosts` x 4 chips.
        meta = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": accel,
                "TPU_WORKER_HOSTNAMES": ips}
        planned = [
            [{**p.env, **meta}, p.place.local_rank, p.place.local_world_size] for p in plans
        ]
        # What torch_xla derives on its own from the slice's metadata, for comparison.
        derived_only = [
            [{**meta, "TPU_HOST_BOUNDS": f"1,1,{hosts}", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
              "TPU_WORKER_ID": str(p.place.node_rank)}, p.place.local_rank,
             p.place.local_world_size]
            for p in plans
        ]
        spans[name] = (plans, len(cases), len(cases) + len(plans))
        cases += planned + derived_only
    results = _configure_topology(cases)
    return {name: (plans, results[start:middle], results[middle:middle + len(plans)])
            for name, (plans, start, middle) in spans.items()}


@pytest.mark.parametrize("name", HOSTS)
def test_contract_torch_xla_configure_topology(name, topology_results):
    hosts = HOSTS[name]
    plans, after, derived = topology_results[name]
    for p, env, own in zip(plans, after, derived):
        for key, value in p.env.items():
            assert env[key] == value, (key, env[key], value)  # torch_xla left it as planned
        for key in TPU_VARS:
            assert own[key] == p.env[key], (key, own[key], p.env[key])  # and agrees with it
    # Every worker has the same address list, in which its task id points at its own port.
    lists = {env["TPU_PROCESS_ADDRESSES"] for env in after}
    assert len(lists) == 1
    addresses = lists.pop().split(",")
    task_ids = sorted(int(env["CLOUD_TPU_TASK_ID"]) for env in after)
    assert task_ids == list(range(len(plans))) == list(range(len(addresses)))
    for p, env in zip(plans, after):
        host, port = addresses[int(env["CLOUD_TPU_TASK_ID"])].rsplit(":", 1)
        assert port == env["TPU_PROCESS_PORT"]
        assert host == ("localhost" if hosts == 1 else p.place.node_ip)
