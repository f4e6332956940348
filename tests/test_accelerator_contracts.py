"""Every kind of plan the CLI prints, fed to torch_xla's own initialisation code.

Neuron (per core, SPMD) goes through ``configure_pjrt_environment``, TPU (per chip, SPMD)
through ``configure_topology`` and the readers of ``torch_xla._internal.tpu``, each worker in a
freshly forked process with exactly its planned environment (one interpreter per device kind,
see ``tests/contracts``). XRT goes through a model of torch_xla 1.13's ``init_xrt_context``
(``contracts/xrt_init_model.py``: that torch_xla cannot be installed here).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys

import pytest
from contracts import xrt_init_model

from ray_train_xla import TorchXLAConfig, XLAConfigError
from ray_train_xla.planning import Rendezvous, plan
from ray_train_xla.planning.topology import Topology, WorkerFacts
from ray_train_xla.tools.cli import main as cli_main

HERE = os.path.dirname(os.path.abspath(__file__))
RDZV = Rendezvous(master_addr="10.0.0.1", master_port=29500, run_id="r", extra_ports=(29611,))


def cli_plan(*args: str) -> list[dict]:
    """What ``ray-train-xla plan ... --json`` prints, one dict per worker."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["plan", *args, "--json"]) == 0
    return json.loads(buf.getvalue())


def facts_for(ids_per_node, resource, worker_ids=None):
    """One worker per entry of each node's list, given those accelerator ids (tuple per worker)."""
    facts = []
    for n, workers in enumerate(ids_per_node):
        for local, ids in enumerate(workers):
            facts.append(WorkerFacts(
                node_id=f"n{n}", node_ip=f"10.0.0.{n + 1}", pid=100 + local,
                accelerator_ids={resource: tuple(str(i) for i in ids)},
                tpu_worker_id=None if worker_ids is None else worker_ids[n]))
    return facts


def planned(facts, resource, device, **config) -> list[dict]:
    plans = plan(Topology.from_facts(facts, resource), TorchXLAConfig(device=device, **config),
                 RDZV, device, facts)
    return [p.to_json() for p in plans]


def _run(script: str, payload):
    out = subprocess.run([sys.executable, os.path.join(HERE, "contracts", script)],
                         input=json.dumps(payload), capture_output=True, text=True, timeout=300,
                         env={"PATH": os.environ.get("PATH", "/usr/bin"),
                              "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


# ---------------------------------------------------------------- Neuron ----------------------

NEURON = {
    "per-core-1x2": lambda: cli_plan("--device", "neuron", "--workers-per-node", "2",
                                     "--accelerators-per-worker", "1"),
    "per-core-2x4": lambda: cli_plan("--device", "neuron", "--nodes", "2", "--workers-per-node",
                                     "4", "--accelerators-per-worker", "1"),
    "per-core-uneven-3+1": lambda: cli_plan("--device", "neuron", "--nodes", "2",
                                            "--workers-per-node", "3,1", "--accelerators-per-worker", "1"),
    "spmd-1x8": lambda: cli_plan("--device", "neuron", "--accelerators-per-worker", "8", "--spmd"),
    "spmd-2x4": lambda: cli_plan("--device", "neuron", "--nodes", "2", "--accelerators-per-worker", "4",
                                 "--spmd"),
    "spmd-2x32": lambda: cli_plan("--device", "neuron", "--nodes", "2", "--accelerators-per-worker",
                                  "32", "--spmd"),
    # Not describable with the CLI: nodes whose SPMD workers got different core sets.
    "spmd-uneven-4+2": lambda: planned(facts_for([[(0, 1, 2, 3)], [(6, 7)]], "neuron_cores"),
                                       "neuron_cores", "neuron", spmd=True),
}


def _neuron_payload():
    rows = {name: make() for name, make in NEURON.items()}
    # Plus the 2x4 SPMD plan's rank 0 without XLA_USE_SPMD: the environment before the fix.
    unfixed = {k: v for k, v in rows["spmd-2x4"][0]["env"].items() if k != "XLA_USE_SPMD"}
    return rows, [r["env"] for name in NEURON for r in rows[name]] + [unfixed]


@pytest.fixture(scope="module")
def neuron_results(contract_runs):
    rows, _ = contract_runs["neuron-payload"]
    results = iter(contract_runs["neuron"])
    out = {name: [(r, next(results)) for r in rows[name]] for name in NEURON}
    out["unfixed"] = next(results)
    return out


@pytest.mark.parametrize("name", list(NEURON))
def test_neuron_plans_pass_torch_xla_neuron_init(name, neuron_results):
    pairs = neuron_results[name]
    spmd = name.startswith("spmd")
    world = len(pairs)
    for row, res in pairs:
        assert res["ok"], (name, row["rank"], res.get("error"))
        env, planned_env = res["env"], row["env"]
        # Rank 0's node and a port taken there for it, never MASTER_PORT or torch_xla's 62182.
        assert env["NEURON_RT_ROOT_COMM_ID"] == planned_env["NEURON_RT_ROOT_COMM_ID"]
        host, port = env["NEURON_RT_ROOT_COMM_ID"].rsplit(":", 1)
        assert host == "10.0.0.1" and port not in (planned_env["MASTER_PORT"], "62182")
        assert env["NEURON_PJRT_PROCESS_INDEX"] == str(row["rank"])
        if spmd:
            # Every core Ray gave the worker is kept: one process drives them all.
            assert env["XLA_USE_SPMD"] == "1"
            assert env["NEURON_RT_VISIBLE_CORES"] == ",".join(row["accelerator_ids"])
            counts = env["NEURON_PJRT_PROCESSES_NUM_DEVICES"].split(",")
            assert len(counts) == world and counts[row["rank"]] == str(len(row["accelerator_ids"]))
            assert env["NEURON_PJRT_WORLD_SIZE"] is None
        else:
            assert env["XLA_USE_SPMD"] is None
            assert env["NEURON_RT_VISIBLE_CORES"] == row["accelerator_ids"][0]
            assert env["PJRT_LOCAL_PROCESS_RANK"] == str(row["local_rank"])
            assert env["PJRT_LOCAL_PROCESS_COUNT"] == str(row["local_world_size"])
            assert env["NEURON_PJRT_WORLD_SIZE"] == str(world)
    assert len({res["env"]["NEURON_RT_ROOT_COMM_ID"] for _, res in pairs}) == 1
    if spmd:
        total = sum(len(r["accelerator_ids"]) for r, _ in pairs)
        assert total == {"spmd-1x8": 8, "spmd-2x4": 8, "spmd-2x32": 64,
                         "spmd-uneven-4+2": 6}[name]


def test_neuron_spmd_plan_without_xla_use_spmd_fails_torch_xla_init(neuron_results):
    # The defect the plan fixes: without XLA_USE_SPMD at import, torch_xla narrows the worker to
    # one core and rejects the 4-core list.
    res = neuron_results["unfixed"]
    assert not res["ok"] and "is not equal to count 4" in res["error"]


# ---------------------------------------------------------------- TPU -------------------------

def _tpu_cases():
    """name -> (rows, TPU worker id of each node, chips per host)."""
    return {
        "per-chip-1x4": (cli_plan("--device", "tpu", "--workers-per-node", "4",
                                  "--accelerators-per-worker", "1"), [0], 4),
        "per-chip-2x4": (cli_plan("--device", "tpu", "--nodes", "2", "--workers-per-node", "4",
                                  "--accelerators-per-worker", "1"), [0, 1], 4),
        "spmd-1x4": (cli_plan("--device", "tpu", "--accelerators-per-worker", "4", "--spmd"), [0], 4),
        "spmd-2x4": (cli_plan("--device", "tpu", "--nodes", "2", "--accelerators-per-worker", "4",
                              "--spmd"), [0, 1], 4),
        # Ray's node order is not the slice's host order: node 0 is TPU worker 2, and so on.
        "per-chip-4x4-worker-ids": (
            planned(facts_for([[(c,) for c in range(4)]] * 4, "TPU", [2, 0, 3, 1]), "TPU", "tpu"),
            [2, 0, 3, 1], 4),
        "spmd-4x4-worker-ids": (
            planned(facts_for([[(0, 1, 2, 3)]] * 4, "TPU", [2, 0, 3, 1]), "TPU", "tpu",
                    spmd=True),
            [2, 0, 3, 1], 4),
        # TPU v7x (4 chips of 2 devices per host). Per device: Ray counts devices
        # (RAY_TPU_RESOURCE_PER_CHIP=2), one worker each; SPMD: Ray counting chips (TPU: 4) or
        # devices (TPU: 8, ids collapsed to chips), one worker per host.
        "v7-per-device-1x8": (
            planned(v7_facts([[(d,) for d in range(8)]], [0], "tpu7x-8", 2), "TPU", "tpu"),
            [0], 4, 2),
        "v7-per-device-4x8": (
            planned(v7_facts([[(d,) for d in range(8)]] * 4, [2, 0, 3, 1], "tpu7x-32", 2),
                    "TPU", "tpu"),
            [2, 0, 3, 1], 4, 2),
        "v7-spmd-1x4": (
            planned(v7_facts([[(0, 1, 2, 3)]], [0], "v7x-8", 1), "TPU", "tpu", spmd=True),
            [0], 4, 1),
        "v7-spmd-4x8": (
            planned(v7_facts([[tuple(range(8))]] * 4, [2, 0, 3, 1], "tpu7x-32", 2), "TPU",
                    "tpu", spmd=True),
            [2, 0, 3, 1], 4, 2),
    }


V7_TOPOLOGIES = {"tpu7x-8": "2x2x1", "v7x-8": "2x2x1", "tpu7x-32": "2x2x4"}


def v7_facts(ids_per_node, worker_ids, accelerator_type, per_chip):
    """TPU v7x hosts as Ray reports them: the slice's type and topology, Ray's TPU count per
    chip (``RAY_TPU_RESOURCE_PER_CHIP``; the ids are device ids with 2)."""
    import dataclasses

    return [dataclasses.replace(f, tpu_accelerator_type=accelerator_type,
                                tpu_topology=V7_TOPOLOGIES[accelerator_type],
                                tpu_resource_per_chip=per_chip)
            for f in facts_for(ids_per_node, "TPU", worker_ids)]


def _gce_metadata(accelerator_type: str, hosts: int, worker_id: int, ips: list) -> dict:
    """The GCE metadata of a TPU v7x host (``tpu-env``: host bounds, each host's 2x2x1 chips;
    the worker IPs), served to torch_xla's metadata path (``contracts/tpu_configure.py``)."""
    return {"RTX_GCE_TPU_METADATA": json.dumps({
        "ACCELERATOR_TYPE": accelerator_type, "TPU_PROCESS_BOUNDS": f"1,1,{hosts}",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "WORKER_ID": str(worker_id), "ips": ips})}


def _slice_metadata(num_hosts: int, worker_id: int) -> dict:
    """The TPU VM metadata torch_xla reads (with TPU_SKIP_MDS_QUERY): a v4 slice of hosts x 4
    chips, host IPs in worker-id order (host with worker id w has IP 10.0.0.<node+1>)."""
    return {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": f"v4-{8 * num_hosts}",
            "TPU_WORKER_ID": str(worker_id)}


_V7_TYPE = {"v7-per-device-1x8": "tpu7x-8", "v7-per-device-4x8": "tpu7x-32",
            "v7-spmd-1x4": "v7x-8", "v7-spmd-4x8": "tpu7x-32"}


def _tpu_payload():
    cases = _tpu_cases()
    payload, index = [], []
    for name, (rows, worker_ids, *_) in cases.items():
        hosts = len(worker_ids)
        by_id = sorted(range(hosts), key=lambda n: worker_ids[n])
        ips = ",".join(f"10.0.0.{n + 1}" for n in by_id)
        for row in rows:
            if name.startswith("v7"):  # torch_xla's GCE metadata path (see tpu_configure.py)
                meta = _gce_metadata(_V7_TYPE[name], hosts,
                                     worker_ids[row["node_rank"]], ips.split(","))
            else:
                meta = _slice_metadata(hosts, worker_ids[row["node_rank"]])
                meta["TPU_WORKER_HOSTNAMES"] = ips
            spmd = "spmd" in name
            local = (0, 1) if spmd else (row["local_rank"], row["local_world_size"])
            payload.append([{**row["env"], **meta}, *local])
            index.append(name)
            if not spmd:
                # torch_xla's own derivation for the same process from the slice metadata alone.
                own = dict(meta) if name.startswith("v7") else {
                    **meta, "TPU_HOST_BOUNDS": f"1,1,{hosts}", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"}
                payload.append([own, *local])
                index.append(name + "/own")
    return cases, index, payload


@pytest.fixture(scope="module")
def contract_runs():
    """Every Neuron and TPU case through one interpreter (forked per case)."""
    neuron_rows, neuron_envs = _neuron_payload()
    tpu_cases, tpu_index, tpu_payload = _tpu_payload()
    out = _run("configure_all.py", {"neuron": neuron_envs, "tpu": tpu_payload})
    out["neuron-payload"] = (neuron_rows, neuron_envs)
    out["tpu-payload"] = (tpu_cases, tpu_index)
    return out


@pytest.fixture(scope="module")
def tpu_results(contract_runs):
    cases, index = contract_runs["tpu-payload"]
    results = contract_runs["tpu"]
    out: dict[str, list] = {}
    for name, res in zip(index, results):
        out.setdefault(name, []).append(res)
    return cases, out


@pytest.mark.parametrize("name", list(_tpu_cases()))
def test_tpu_plans_pass_torch_xla_topology(name, tpu_results):
    cases, results = tpu_results
    rows, worker_ids, chips_per_host, *rest = cases[name]
    ray_per_chip = rest[0] if rest else 1  # Ray's TPU ids per chip (2: device ids on v7x)
    after = results[name]
    spmd = "spmd" in name
    hosts = len(worker_ids)
    # devices per process on v7x per device: TPU_PROCESS_BOUNDS counts devices (",2")
    per_chip = 2 if name.startswith("v7") and not spmd else 1
    assert all(r["ok"] for r in after), after
    for row, res in zip(rows, after):
        env = res["env"]
        for key, value in env.items():  # torch_xla kept every planned value (setdefault)
            assert value == row["env"].get(key), (key, value, row["env"].get(key))
        assert res["is_spmd"] is spmd
        chips = env["TPU_VISIBLE_CHIPS"].split(",")
        given = row["accelerator_ids"]
        if spmd:  # Ray's device ids name chips id // ray_per_chip (as Ray masks them)
            given = sorted({str(int(i) // ray_per_chip) for i in given})
        assert sorted(chips) == sorted(given)  # every chip (device) Ray gave is kept
        per_process = math.prod(int(d) for d in env["TPU_CHIPS_PER_PROCESS_BOUNDS"].split(","))
        assert per_process == len(chips)
        # libtpu's grid holds every process of the job, and every chip (device) of the slice.
        bounds = [int(d) for d in env["TPU_PROCESS_BOUNDS"].split(",")]
        assert len(bounds) == (4 if per_chip > 1 else 3) and bounds[3:] in ([], [per_chip])
        assert math.prod(bounds) == len(rows)
        assert math.prod(bounds) * per_process == hosts * chips_per_host * per_chip
        if per_chip == 1:
            assert res["process_bounds_size"] == len(rows)  # torch_xla's own reading
        else:  # torch_xla 2.9 reads 3 entries only: xmp.spawn could not size a v7 host
            assert "should be length 3" in res["process_bounds_size"]
        # The task id orders hosts by TPU worker id, as torch_xla and libtpu number them.
        worker_id = worker_ids[row["node_rank"]]
        assert res["task_id"] == worker_id * (len(rows) // hosts) + (
            0 if spmd else int(chips[0]))
        addresses = env["TPU_PROCESS_ADDRESSES"].split(",")
        assert len(addresses) == len(rows)
        host, port = addresses[res["task_id"]].rsplit(":", 1)
        assert port == env["TPU_PROCESS_PORT"]
        assert host == ("localhost" if hosts == 1 else row["node_ip"])
        # The host list torch_xla reads from the metadata agrees with the planned addresses.
        if hosts > 1:
            assert res["worker_ips"][worker_id] == row["node_ip"]
    assert sorted(r["task_id"] for r in after) == list(range(len(rows)))
    if not spmd:  # agrees with what torch_xla derives on its own from the slice metadata
        for res, own in zip(after, results[name + "/own"]):
            for key in ("TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "CLOUD_TPU_TASK_ID",
                        "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT", "TPU_VISIBLE_CHIPS"):
                assert own["env"][key] == res["env"][key], (key, own["env"][key], res["env"][key])


def test_tpu_hosts_of_several_slices_are_refused():
    facts = [WorkerFacts(node_id=f"n{n}", node_ip=f"10.0.0.{n + 1}", pid=1,
                         accelerator_ids={"TPU": ("0", "1", "2", "3")}, tpu_worker_id=0,
                         tpu_name=f"slice-{n}") for n in range(2)]
    with pytest.raises(XLAConfigError, match="multislice") as info:
        planned(facts, "TPU", "tpu", spmd=True)
    assert "slice-0, slice-1" in str(info.value)


def test_tpu_duplicate_or_partial_worker_ids_are_refused():
    with pytest.raises(XLAConfigError, match="distinct TPU worker id"):
        planned(facts_for([[(0, 1, 2, 3)]] * 2, "TPU", [0, 0]), "TPU", "tpu", spmd=True)
    with pytest.raises(XLAConfigError, match=r"node 1 \(10.0.0.2\): None"):
        planned(facts_for([[(0, 1, 2, 3)]] * 2, "TPU", [1, None]), "TPU", "tpu", spmd=True)


# ---------------------------------------------------------------- XRT -------------------------

@pytest.mark.parametrize("nodes,per_node", [(1, 2), (2, 4)], ids=["1x2", "2x4"])
def test_xrt_plans_meet_torch_xla_1_13_init(nodes, per_node):
    rows = cli_plan("--device", "neuron", "--runtime", "xrt", "--nodes", str(nodes),
                    "--workers-per-node", str(per_node), "--accelerators-per-worker", "1")
    store: dict = {}
    for row in rows:
        xrt_init_model.publish(row["env"], store)
    after = [xrt_init_model.init_xrt_context(row["env"], store) for row in rows]
    for row, env in zip(rows, after):
        assert all(var in row["env"] for var in xrt_init_model.READ)
        assert env["XRT_HOST_WORLD_SIZE"] == str(nodes)
        kind = "localservice" if nodes == 1 else "c_localservice"
        assert env["XRT_LOCAL_WORKER"] == f"{kind}:{row['node_rank']}"
        assert env["XRT_SHARD_ORDINAL"] == str(row["rank"])
        assert env["XRT_SHARD_LOCAL_ORDINAL"] == str(row["local_rank"])
        # The node's server drives exactly this trainer's cores on the node.
        assert env["NEURON_RT_VISIBLE_CORES"] == row["env"]["NEURON_RT_VISIBLE_CORES"]
        assert len(env["NEURON_RT_VISIBLE_CORES"].split(",")) == per_node
    assert after[0]["XRT_TPU_CONFIG"] == "|".join(
        f"{kind};{i};host{i}:9000" for i in range(nodes))
    assert sum(env["_starts_server"] == "True" for env in after) == nodes


def test_xrt_uneven_nodes_are_refused():
    # init_xrt_context would count 6 // 3 = 2 nodes for 3 + 2 + 1 workers, and wait for the
    # wrong servers: refused before start.
    facts = facts_for([[(0,), (1,), (2,)], [(0,), (1,)], [(0,)]], "neuron_cores")
    with pytest.raises(XLAConfigError, match=r"runtime='xrt' needs the same number of workers"):
        planned(facts, "neuron_cores", "neuron", runtime="xrt")


def test_tpu_host_identity_is_read_as_ray_reads_it(monkeypatch):
    # GKE sets TPU_WORKER_ID and TPU_NAME on each TPU pod; Ray's TPU support reads them first
    # (then the GCE metadata server), and so does gather_facts on a worker given TPU chips.
    from ray._private.accelerators.tpu import TPUAcceleratorManager

    from ray_train_xla.startup.facts import tpu_host_identity as _tpu_host_identity

    monkeypatch.setenv("TPU_WORKER_ID", "3")
    monkeypatch.setenv("TPU_NAME", "slice-a")
    # The slice's host count: its type (GKE's TPU_ACCELERATOR_TYPE) over the chips of this host
    # (Ray counts /dev/accel*): a v4-16 is 16 cores, 8 per host of 4 two-core chips.
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v4-16")
    monkeypatch.setenv("TPU_TOPOLOGY", "2x2x2")
    monkeypatch.setattr(TPUAcceleratorManager, "get_current_node_num_accelerators", lambda: 4)
    assert _tpu_host_identity() == (3, "slice-a", "v4-16", "2x2x2", 2)


def slice_hosts(nodes, of_slice):
    """One SPMD worker on each of ``nodes`` hosts (worker ids 0..nodes-1) of an ``of_slice``-host
    slice."""
    return [WorkerFacts(node_id=f"n{n}", node_ip=f"10.0.0.{n + 1}", pid=1,
                        accelerator_ids={"TPU": ("0", "1", "2", "3")}, tpu_worker_id=n,
                        tpu_name="slice-a", tpu_slice_hosts=of_slice) for n in range(nodes)]


@pytest.mark.parametrize("nodes", [1, 2, 3])
def test_tpu_group_holding_part_of_a_slice_is_refused(nodes):
    # An elastic group that lost a host of a 4-host slice: torch_xla would wait for the host
    # that is gone; refused before any worker is set up, naming the fix.
    with pytest.raises(XLAConfigError, match=r"every host of the TPU slice \(4 hosts of slice-a\)"
                       ) as info:
        planned(slice_hosts(nodes, 4), "TPU", "tpu", spmd=True)
    assert f"runs on {nodes} (TPU worker ids" in str(info.value)
    assert "use_tpu=True" in str(info.value)


def test_tpu_group_holding_a_whole_slice_is_planned():
    rows = planned(slice_hosts(4, 4), "TPU", "tpu", spmd=True)
    assert [r["env"]["CLOUD_TPU_TASK_ID"] for r in rows] == ["0", "1", "2", "3"]
