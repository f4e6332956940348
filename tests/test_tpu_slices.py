"""TPU process bounds from the slice's real topology, for TPU v4, v5e (v5litepod), v5p and v6e
from one host to 64 hosts: pure plans against the bounds each slice's metadata reports, the
contract with torch_xla's own ``configure_topology`` for v4-64, v4-256 and v5p-128 (per chip
and SPMD), the ``tpu_process_bounds`` override and its twins, ``plan --tpu-topology`` /
``--accelerator-type``, and the topology gathered with the worker facts."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys

import pytest

from ray_train_xla import TorchXLAConfig, XLAConfigError
from ray_train_xla.planning import Rendezvous, plan
from ray_train_xla.planning.topology import Topology, WorkerFacts
from ray_train_xla.tools.cli import main as cli_main

HERE = os.path.dirname(os.path.abspath(__file__))
RDZV = Rendezvous(master_addr="10.0.0.1", master_port=29500, run_id="r")

# accelerator type -> (topology, the slice metadata's TPU_PROCESS_BOUNDS (one process per host,
# "host bounds"), its TPU_CHIPS_PER_PROCESS_BOUNDS (the chips of one host)), as the TPU VMs'
# ``tpu-env`` metadata reports them (v4-256: TOPOLOGY '4x4x8', TPU_PROCESS_BOUNDS '2,2,8').
SLICES = {
    "v4-8": ("2x2x1", "1,1,1", "2,2,1"),
    "v4-16": ("2x2x2", "1,1,2", "2,2,1"),
    "v4-32": ("2x2x4", "1,1,4", "2,2,1"),
    "v4-64": ("2x4x4", "1,2,4", "2,2,1"),
    "v4-128": ("4x4x4", "2,2,4", "2,2,1"),
    "v4-256": ("4x4x8", "2,2,8", "2,2,1"),
    "v4-512": ("4x8x8", "2,4,8", "2,2,1"),
    "v5p-8": ("2x2x1", "1,1,1", "2,2,1"),
    "v5p-128": ("4x4x4", "2,2,4", "2,2,1"),
    "v5p-512": ("4x8x8", "2,4,8", "2,2,1"),
    "v5litepod-1": ("1x1", "1,1,1", "1,1,1"),
    "v5litepod-4": ("2x2", "1,1,1", "2,2,1"),
    "v5litepod-8": ("2x4", "1,1,1", "2,4,1"),
    "v5litepod-16": ("4x4", "2,2,1", "2,2,1"),
    "v5litepod-32": ("4x8", "2,4,1", "2,2,1"),
    "v5litepod-64": ("8x8", "4,4,1", "2,2,1"),
    "v5litepod-256": ("16x16", "8,8,1", "2,2,1"),
    "v6e-8": ("2x4", "1,1,1", "2,4,1"),
    "v6e-16": ("4x4", "2,2,1", "2,2,1"),
    "v6e-64": ("8x8", "4,4,1", "2,2,1"),
    "v6e-256": ("16x16", "8,8,1", "2,2,1"),
}


def grid(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(","))


def slice_facts(accel: str, spmd: bool, report: str = "both", worker_ids=None) -> list[WorkerFacts]:
    """Every host of the slice, with all its chips (one worker per chip, or one per host), each
    reporting the slice as Ray reads it (``report``: "both", "type" or "topology")."""
    topology, host_bounds, chips_bounds = SLICES[accel]
    hosts, chips = math.prod(grid(host_bounds)), math.prod(grid(chips_bounds))
    facts = []
    for h in range(hosts):
        for ids in ([tuple(range(chips))] if spmd else [(c,) for c in range(chips)]):
            facts.append(WorkerFacts(
                node_id=f"n{h}", node_ip=f"10.0.{h // 250}.{h % 250 + 1}", pid=100 + ids[0],
                accelerator_ids={"TPU": tuple(map(str, ids))},
                tpu_worker_id=h if worker_ids is None else worker_ids[h],
                tpu_accelerator_type=accel if report in ("both", "type") else "",
                tpu_topology=topology if report in ("both", "topology") else ""))
    return facts


def tpu_plan(facts, **config):
    return plan(Topology.from_facts(facts, "TPU"), TorchXLAConfig(device="tpu", **config), RDZV,
                "tpu", facts)


@pytest.mark.parametrize("report", ["both", "type", "topology"])
@pytest.mark.parametrize("accel", list(SLICES))
def test_bounds_follow_the_slice_topology(accel, report):
    _, host_bounds, chips_bounds = SLICES[accel]
    spmd = tpu_plan(slice_facts(accel, True, report), spmd=True)
    per_chip = tpu_plan(slice_facts(accel, False, report))
    for p in spmd:  # SPMD: the metadata's own values (one process per host, all its chips)
        env = p.env
        assert env["TPU_PROCESS_BOUNDS"] == env["TPU_HOST_BOUNDS"] == host_bounds, accel
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == env["TPU_CHIPS_PER_HOST_BOUNDS"] == chips_bounds
    # Per chip: torch_xla's configure_topology, host bounds x chips per host.
    expected = ",".join(str(a * b) for a, b in zip(grid(host_bounds), grid(chips_bounds)))
    for p in per_chip:
        env = p.env
        assert env["TPU_PROCESS_BOUNDS"] == env["TPU_HOST_BOUNDS"] == expected, accel
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == env["TPU_CHIPS_PER_HOST_BOUNDS"] == "1,1,1"
    assert math.prod(grid(expected)) == len(per_chip)


def test_a_job_on_part_of_a_multi_host_slice_is_refused():
    facts = [f for f in slice_facts("v4-64", True) if f.node_id in ("n0", "n1")]
    with pytest.raises(XLAConfigError, match="every host of the TPU slice") as info:
        tpu_plan(facts, spmd=True)
    assert "v4-64 (topology 2x4x4: 8 hosts of 4 chips), the job has 2 hosts of 4 chips" in str(
        info.value)


def test_hosts_reporting_different_slices_or_unreadable_ones_are_refused():
    facts = slice_facts("v4-32", True)
    facts[1] = WorkerFacts(**{**facts[1].__dict__, "tpu_topology": "2x4x4",
                              "tpu_accelerator_type": "v4-64"})
    with pytest.raises(XLAConfigError, match="report different slices"):
        tpu_plan(facts, spmd=True)
    bad = [WorkerFacts(**{**f.__dict__, "tpu_topology": "2x4x2"}) for f in slice_facts("v4-64", True)]
    with pytest.raises(XLAConfigError, match="has 16 chips but v4-64 has 32"):
        tpu_plan(bad, spmd=True)


def test_unknown_topology_beyond_four_hosts_is_refused_not_guessed():
    facts = slice_facts("v4-64", True, report="none")
    with pytest.raises(XLAConfigError, match="the TPU slice's topology for 8 hosts") as info:
        tpu_plan(facts, spmd=True)
    assert "tpu_process_bounds" in str(info.value)
    # The option gives it; TPU_HOST_BOUNDS, its twin, follows.
    env = tpu_plan(facts, spmd=True, tpu_process_bounds="1,2,4")[0].env
    assert env["TPU_PROCESS_BOUNDS"] == env["TPU_HOST_BOUNDS"] == "1,2,4"
    # 2 and 4 hosts without a topology: laid out as TPU v4 (v4-16, v4-32), as before.
    env = tpu_plan(slice_facts("v4-32", True, report="none"), spmd=True)[0].env
    assert env["TPU_PROCESS_BOUNDS"] == "1,1,4"


def test_process_bounds_override_must_match_a_known_topology():
    # v4-64 per chip is 2,4,4; 1,1,32 has the right size but contradicts the slice.
    facts = slice_facts("v4-64", False)
    with pytest.raises(XLAConfigError, match="tpu_process_bounds='1,1,32'") as info:
        tpu_plan(facts, tpu_process_bounds="1,1,32")
    assert "None or '2,4,4'" in str(info.value) and "TPU_HOST_BOUNDS" in str(info.value)
    env = tpu_plan(facts, tpu_process_bounds="2,4,4")[0].env
    assert env["TPU_PROCESS_BOUNDS"] == env["TPU_HOST_BOUNDS"] == "2,4,4"
    assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == env["TPU_CHIPS_PER_HOST_BOUNDS"] == "1,1,1"
    # SPMD: the host grid, its size the number of hosts.
    with pytest.raises(XLAConfigError, match="a grid of 8 processes"):
        tpu_plan(slice_facts("v4-64", True), spmd=True, tpu_process_bounds="2,4,4")
    # A bounds variable given through env instead is refused, naming the option.
    for var in ("TPU_PROCESS_BOUNDS", "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS"):
        with pytest.raises(XLAConfigError, match=f"{var} is planned for every worker"):
            TorchXLAConfig(device="tpu", env={var: "2,4,4"})


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["plan", "--device", "tpu", *args])
    return code, out.getvalue(), err.getvalue()


def test_cli_plan_prints_the_slice_bounds():
    # The command, now told the slice: one SPMD process per host of a v4-64.
    for flag in (["--accelerator-type", "v4-64"], ["--tpu-topology", "2x4x4"]):
        code, out, _ = cli("--nodes", "8", "--accelerators-per-worker", "4", "--spmd", *flag)
        assert code == 0 and "TPU_PROCESS_BOUNDS=1,2,4" in out and "TPU_HOST_BOUNDS=1,2,4" in out
        assert "TPU_CHIPS_PER_PROCESS_BOUNDS=2,2,1" in out
        code, out, _ = cli("--nodes", "8", "--workers-per-node", "4", *flag)
        assert code == 0 and "TPU_PROCESS_BOUNDS=2,4,4" in out, out
    code, out, _ = cli("--nodes", "64", "--accelerators-per-worker", "4", "--spmd",
                       "--accelerator-type", "v6e-256")
    assert code == 0 and "TPU_PROCESS_BOUNDS=8,8,1" in out
    # Without the slice, 8 hosts are refused rather than guessed.
    code, _, err = cli("--nodes", "8", "--accelerators-per-worker", "4", "--spmd")
    assert code == 2 and "--tpu-topology or --accelerator-type" in err
    code, _, err = cli("--nodes", "8", "--accelerators-per-worker", "4", "--spmd",
                       "--accelerator-type", "v4-64", "--tpu-topology", "4x4x4")
    assert code == 2 and "has 64 chips but v4-64 has 32" in err
    code, _, err = cli("--accelerator-type", "v4-64", "--device", "cpu")
    assert code == 2 and "--accelerator-type describes a TPU slice" in err


# ---- contract: torch_xla's configure_topology, fed the plan and the slice's metadata ----

CONTRACT_SLICES = ("v4-64", "v4-256", "v5p-128")


def _metadata(accel: str, worker_id: int, ips: str) -> dict:
    """The slice's metadata as torch_xla reads it with TPU_SKIP_MDS_QUERY (the tpu-env values
    under their environment names)."""
    _, host_bounds, chips_bounds = SLICES[accel]
    return {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": accel,
            "TPU_HOST_BOUNDS": host_bounds, "TPU_CHIPS_PER_HOST_BOUNDS": chips_bounds,
            "TPU_WORKER_ID": str(worker_id), "TPU_WORKER_HOSTNAMES": ips}


# Hundreds of processes: one interpreter runs them in turn, each with exactly its environment
# (configure_topology only reads the environment and sets missing values).
_CONTRACT = r"""
import json, os, sys
import torch_xla._internal.tpu as tpu
WATCHED = ("TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS",
           "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID")
out = []
for env, local_rank, local_world in json.loads(sys.stdin.read()):
    os.environ.clear()
    os.environ.update(env)
    try:
        tpu.configure_topology(local_rank, local_world, base_port=8476)
        out.append({"ok": True, "env": {k: os.environ.get(k) for k in WATCHED},
                    "task_id": tpu.task_id(), "process_bounds_size": tpu.process_bounds_size(),
                    "worker_ips": tpu.get_worker_ips()})
    except Exception as exc:
        out.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def contract():
    """Per slice and mode: the plans, configure_topology after each planned environment, and
    (per chip) torch_xla's own derivation from the metadata alone. Hosts report worker ids in
    reverse of Ray's node order."""
    payload, index, plans = [], [], {}
    for accel in CONTRACT_SLICES:
        hosts = math.prod(grid(SLICES[accel][1]))
        ids = list(reversed(range(hosts)))
        for spmd in (False, True):
            rows = tpu_plan(slice_facts(accel, spmd, worker_ids=ids), spmd=spmd)
            plans[accel, spmd] = rows
            by_id = sorted(range(hosts), key=lambda n: ids[n])
            ips = ",".join(f"10.0.{n // 250}.{n % 250 + 1}" for n in by_id)
            for p in rows:
                meta = _metadata(accel, ids[p.place.node_rank], ips)
                local = (0, 1) if spmd else (p.place.local_rank, p.place.local_world_size)
                payload.append([{**p.env, **meta}, *local])
                index.append((accel, spmd, "planned"))
                if not spmd:
                    payload.append([meta, *local])
                    index.append((accel, spmd, "own"))
    proc = subprocess.run([sys.executable, "-c", _CONTRACT],
                          input=json.dumps(payload), capture_output=True, text=True, timeout=300,
                          env={"PATH": os.environ.get("PATH", "/usr/bin"),
                               "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results: dict = {}
    for key, res in zip(index, json.loads(proc.stdout.strip().splitlines()[-1])):
        results.setdefault(key, []).append(res)
    return plans, results


@pytest.mark.parametrize("spmd", [False, True], ids=["per-chip", "spmd"])
@pytest.mark.parametrize("accel", CONTRACT_SLICES)
def test_contract_torch_xla_configure_topology(contract, accel, spmd):
    plans, results = contract
    rows, after = plans[accel, spmd], results[accel, spmd, "planned"]
    _, host_bounds, chips_bounds = SLICES[accel]
    hosts = math.prod(grid(host_bounds))
    assert all(r["ok"] for r in after), after[:2]
    for p, res in zip(rows, after):
        env = res["env"]
        for key, value in env.items():  # torch_xla kept every planned value (setdefault)
            assert value == p.env.get(key), (key, value, p.env.get(key))
        # libtpu's grid: every process of the job and every chip of the slice.
        assert res["process_bounds_size"] == len(rows)
        per_process = math.prod(grid(env["TPU_CHIPS_PER_PROCESS_BOUNDS"]))
        assert res["process_bounds_size"] * per_process == math.prod(
            int(d) for d in SLICES[accel][0].split("x"))
        addresses = env["TPU_PROCESS_ADDRESSES"].split(",")
        host, port = addresses[res["task_id"]].rsplit(":", 1)
        assert host == p.place.node_ip and port == env["TPU_PROCESS_PORT"]
        assert res["worker_ips"][p.place.tpu_worker_id] == p.place.node_ip
    assert sorted(r["task_id"] for r in after) == list(range(len(rows)))
    if spmd:  # the metadata's own per-host values
        assert {r["env"]["TPU_PROCESS_BOUNDS"] for r in after} == {host_bounds}
        assert {r["env"]["TPU_CHIPS_PER_PROCESS_BOUNDS"] for r in after} == {chips_bounds}
        assert len(rows) == hosts
    else:  # agrees with what torch_xla derives from the slice's metadata alone
        for res, own in zip(after, results[accel, spmd, "own"]):
            assert own["ok"], own
            for key in ("TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "CLOUD_TPU_TASK_ID",
                        "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT", "TPU_VISIBLE_CHIPS"):
                assert own["env"][key] == res["env"][key], (key, own["env"][key], res["env"][key])


def test_worker_facts_carry_the_slice_as_ray_reads_it(monkeypatch):
    # GKE sets these on each TPU pod; Ray's TPU support reads them first (then the GCE
    # metadata server), and so does gather_facts on a worker given TPU chips.
    from ray_train_xla.startup.facts import tpu_host_identity

    for key, value in {"TPU_WORKER_ID": "3", "TPU_NAME": "slice-a",
                       "TPU_ACCELERATOR_TYPE": "v4-64", "TPU_TOPOLOGY": "2x4x4"}.items():
        monkeypatch.setenv(key, value)
    # The slice's host count is the type's chips over this host's (Ray counts /dev/accel*).
    from ray._private.accelerators.tpu import TPUAcceleratorManager

    monkeypatch.setattr(TPUAcceleratorManager, "get_current_node_num_accelerators", lambda: 4)
    assert tpu_host_identity() == (3, "slice-a", "v4-64", "2x4x4", 8)


# ---- one set of slice rules, on both TPU runtimes ----

def plan_json(*args: str) -> list[dict]:
    code, out, err = cli(*args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("accel, nodes, per_node, topology, bounds", [
    ("v6e-16", 4, 4, "4,4,1", "4,4,1"),
    ("v6e-8", 1, 8, "2,4,1", "2,4,1"),
    ("v6e-8", 2, 4, "2,4,1", "2,4,1"),  # v6e's 2x4 as 2 VMs of 4 chips (GKE)
    ("v5litepod-64", 16, 4, "8,8,1", "8,8,1"),
    ("v5p-32", 4, 4, "2,2,4", "2,2,4"),
    ("v4-64", 8, 4, "2,4,4", "2,4,4"),
    ("tpu7x-32", 4, 8, "2,2,4,2", "2,2,4,2"),
])
def test_an_accelerator_type_gives_its_standard_topology_on_every_runtime(
        accel, nodes, per_node, topology, bounds):
    """``--accelerator-type`` alone: torch_xla's process bounds and TorchTPU's topology are
    the type's standard slice (it was ignored on the native runtime: v6e-16 planned 2,2,4)."""
    args = ("--accelerator-type", accel, "--nodes", str(nodes), "--workers-per-node", str(per_node))
    xla = plan_json(*args)
    native = plan_json(*args, "--runtime", "native")
    assert {r["env"]["TPU_PROCESS_BOUNDS"] for r in xla} == {bounds}
    assert {r["env"]["TORCH_TPU_TOPOLOGY"] for r in native} == {topology}
    assert len(xla) == len(native) == nodes * per_node


API_WORDS = ("num_workers", "resources_per_worker", "ScalingConfig", "device='tpu'", "spmd=True")


@pytest.mark.parametrize("args, words", [
    (["--accelerator-type", "v6e-16", "--tpu-topology", "2x2x4", "--nodes", "4"],
     ["--accelerator-type v6e-16 --tpu-topology 2x2x4 is not valid",
      "'2x2x4' is 3-D but v6e slices are 2-D"]),
    (["--accelerator-type", "v6e-16", "--tpu-topology", "2x8", "--nodes", "4"],
     ["'2x8' is not a v6e slice: expected one of 1x1, 2x2, 2x4, 4x4"]),
    (["--accelerator-type", "v9z-16", "--nodes", "4"],
     ["--accelerator-type v9z-16 is not valid", "not of a generation this package knows",
      "v2, v3, v4, v5p, v5litepod, v6e, v7x", "'TPU generations and slices'"]),
    (["--accelerator-type", "v9z-16", "--tpu-topology", "4x4", "--nodes", "4"],
     ["not of a generation this package knows"]),
    (["--accelerator-type", "v6e-24", "--nodes", "6"],
     ["'v6e-24' (24 chips) is not a v6e slice size: expected one of v6e-1, v6e-4, v6e-8, "
      "v6e-16, v6e-32, v6e-64, v6e-128, v6e-256"]),
    (["--accelerator-type", "v5p-48", "--nodes", "6"],
     ["not a v5p slice size", "another shape: give its topology too"]),
    (["--accelerator-type", "v6e-16", "--nodes", "2"],
     ["--nodes 2 --workers-per-node 4 is not valid with --accelerator-type v6e-16",
      "4 hosts of 4 chips", "Use --nodes 4 --workers-per-node 4"]),
    (["--accelerator-type", "v5p-8", "--workers-per-node", "8"],
     ["--nodes 1 --workers-per-node 8 is not valid with --accelerator-type v5p-8",
      "1 host of 4 chips", "Use --nodes 1 --workers-per-node 4"]),
    (["--accelerator-type", "tpu7x-32", "--nodes", "4"],
     ["--nodes 4 --workers-per-node 4 is not valid with --accelerator-type tpu7x-32",
      "4 hosts of 4 chips (8 devices)", "Use --nodes 4 --workers-per-node 8"]),
    (["--accelerators-per-worker", "2"],
     ["--accelerators-per-worker 2 is not valid with --device tpu", "per worker"]),
    (["--workers-per-node", "4,2"], ["--workers-per-node 4,2 is not valid with --device tpu",
                                     "the same number of workers"]),
])
@pytest.mark.parametrize("runtime", ["pjrt", "native"])
def test_both_runtimes_refuse_by_the_slice_rules_in_plans_flags(args, words, runtime):
    """The slice rules are one (a type's generation and size, 2-D or 3-D, whole hosts, at most
    a host's chips), and a refusal blames the flag that is wrong, in plan's own words."""
    if "--workers-per-node" not in args:
        args = [*args, "--workers-per-node", "4"]
    code, _, err = cli(*args, "--runtime", runtime)
    assert code == 2, err
    for word in words:
        assert word in err, (word, err)
    for word in API_WORDS:
        assert word not in err, (word, err)


def test_the_backend_says_the_same_in_the_apis_words():
    """The torch_xla backend's refusal names ScalingConfig's fields and how to reserve the
    slice with Ray, where plan names its flags; never ``device='tpu'``."""
    facts = [f for f in slice_facts("v4-64", True) if f.node_id in ("n0", "n1")]
    with pytest.raises(XLAConfigError) as info:
        tpu_plan(facts, spmd=True)
    message = str(info.value)
    assert message.startswith("ScalingConfig(num_workers=2, resources_per_worker={'TPU': 4}) is "
                              "not valid with the TPU slice the hosts report (accelerator type "
                              "v4-64)"), message
    assert ("Use ScalingConfig(num_workers=8, resources_per_worker={'TPU': 4}, use_tpu=True, "
            "topology='2x4x4', accelerator_type='TPU-V4')") in message
    assert "--" not in message and "device='tpu'" not in message
    assert info.value.for_plan().startswith("--nodes 2 --workers-per-node 1 "
                                            "--accelerators-per-worker 4 is not valid")


def test_a_host_holds_at_most_its_chips_and_unknown_types_are_refused():
    # 8 workers on one v5p-8 host of 4 chips (8 is a chip count Ray knows, not this host's).
    eight = [WorkerFacts(node_id="n0", node_ip="10.0.0.1", pid=c, accelerator_ids={"TPU": (str(c),)},
                         tpu_accelerator_type="v5p-8") for c in range(8)]
    with pytest.raises(XLAConfigError, match=r"1 host of 4 chips\), the job has 1 host of 8 chips"):
        tpu_plan(eight)
    assert len(tpu_plan(eight[:4])) == 4 and len(tpu_plan(eight[:2])) == 2  # part of the host
    # A type of an unknown generation is refused even with a topology: devices per chip and the
    # host size are the generation's, and a topology does not tell them.
    unknown = [WorkerFacts(**{**f.__dict__, "tpu_accelerator_type": "v9z-64"})
               for f in slice_facts("v4-64", True)]
    with pytest.raises(XLAConfigError, match="not of a generation this package knows") as info:
        tpu_plan(unknown, spmd=True)
    assert str(info.value).startswith("the TPU slice the hosts report (accelerator type v9z-64, "
                                      "topology 2x4x4) is not valid")


def test_a_topology_without_a_generation_counts_hosts_as_torchtpu_does():
    """No accelerator type to say a host's chips: a host holds at most the slice's extent along
    each axis, as TorchTPU's own host count (1x2x2: two hosts of two chips); a known
    generation keeps its hosts of 2x2 chips and refuses the same topology."""
    from ray_train_xla.planning.runtimes.tpu import tpu_slice

    found = tpu_slice("", "1x2x2", hosts=2)
    assert found.host_chips == (1, 2, 1) and found.hosts == 2
    with pytest.raises(ValueError, match="not a grid of hosts of 2x2 chips"):
        tpu_slice("v4-8", "1x2x2", hosts=2)
