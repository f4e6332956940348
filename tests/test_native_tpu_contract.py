"""Contract: every environment TorchTPUConfig plans passes TorchTPU's own launch code.

``torch-tpu`` 0.2.0 needs torch 2.11-2.15, so it cannot share this environment (torch 2.9 for
torch_xla): the test creates a virtual environment with it from PyPI once and keeps it
(``~/.cache/ray-train-xla/``, keyed by the versions; ``RTX_TORCH_TPU_VENV`` names another
place). When that environment cannot be built (no network, no disk), the tests fail, so that a
run without the contract is never mistaken for a pass; ``RTX_SKIP_TORCH_TPU_CONTRACT=1`` skips
them (and the build) instead. ``tests/torch_tpu_launch.py`` runs there, and feeds TorchTPU's
``set_tpu_launch_env``, ``_calculate_topological_node_rank`` and
``_get_slice_host_coordinates`` (``torch_tpu/_internal/distributed/distributed.py``), replacing
only the reads of TPU hardware (the PCI scan of ``hardware.py`` and the chip-coordinate query).

Per host, the launcher parent that TorchTPU expects is run with what a launcher on that host
would have: the host list in the order of our plan (``TPU_WORKER_HOSTNAMES``), the slice's
``TORCH_TPU_TOPOLOGY``, the host's chip coordinates. What it derives (``NODE_RANK``,
``NNODES``, ``MASTER_ADDR``, the address list's hosts, the topology) must equal our plan, and
torchrun's ``RANK = NODE_RANK * nproc + LOCAL_RANK`` must be our rank. Then each rank's planned
environment is checked against what TorchTPU's native worker code requires
(``worker_problems``: read from the wheel's C++ glue, as ``docs/native-tpu-spec.md`` records; that
code cannot run without a TPU). Cases: one host (v5p, v6e), four hosts of a v5p and of a v6e
slice with Ray's node order shuffled against the topological order, and two slices; the same on
TPU v7x (4 chips of 2 devices per host, one worker per device: TorchTPU's PCI scan counts the 8
devices, its topology is 4-D). A plan made in Ray's node order fails.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from test_native_tpu_plan import SHUFFLED, host_facts, tpu_plan

from ray_train_xla.planning.runtimes.native_tpu import slice_hosts

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH, TORCH_TPU = "2.13.0", "0.2.0"
VENV = os.environ.get("RTX_TORCH_TPU_VENV") or os.path.join(
    os.path.expanduser("~/.cache/ray-train-xla"),
    f"torch-tpu-{TORCH_TPU}-torch-{TORCH}-py{sys.version_info[0]}.{sys.version_info[1]}")
INSTALL_TIMEOUT_S = 900
SKIP_VAR = "RTX_SKIP_TORCH_TPU_CONTRACT"


def skipped() -> bool:
    """Whether ``RTX_SKIP_TORCH_TPU_CONTRACT`` (1) asks to skip these tests."""
    return os.environ.get(SKIP_VAR, "") not in ("", "0")


pytestmark = pytest.mark.skipif(skipped(), reason=f"{SKIP_VAR} is set: the TorchTPU contract "
                                "tests are skipped")


class CannotBuild(Exception):
    """The torch-tpu environment could not be built."""


def torch_tpu_python() -> str:
    """The venv's python, creating the venv once (under a lock; complete or not at all); fails
    the test, saying how to skip it, when the venv cannot be built."""
    try:
        return _build_venv()
    except (CannotBuild, OSError, subprocess.SubprocessError) as exc:
        pytest.fail(f"cannot build the torch-tpu environment for the TorchTPU contract tests "
                    f"({VENV}): {exc}. Fix the cause (these tests need PyPI once, about 2 GB), "
                    f"or set {SKIP_VAR}=1 to skip them", pytrace=False)


def _build_venv() -> str:
    python = os.path.join(VENV, "bin", "python")
    done = os.path.join(VENV, ".complete")
    if os.path.exists(done):
        return python
    os.makedirs(os.path.dirname(VENV), exist_ok=True)
    with open(VENV + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(done):
            return python
        shutil.rmtree(VENV, ignore_errors=True)
        base = getattr(sys, "_base_executable", sys.executable)
        steps = [[base, "-m", "venv", VENV],
                 [python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                  f"torch=={TORCH}", f"torch-tpu=={TORCH_TPU}"]]
        for step in steps:
            try:
                out = subprocess.run(step, capture_output=True, text=True,
                                     timeout=INSTALL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                shutil.rmtree(VENV, ignore_errors=True)  # nothing half built stays
                raise
            if out.returncode != 0:
                shutil.rmtree(VENV, ignore_errors=True)
                raise CannotBuild(f"{' '.join(step[1:4])} failed: {out.stderr.strip()[-800:]}")
        open(done, "w").close()
    return python


def run_torch_tpu(cases: list[dict]) -> list[dict]:
    python = torch_tpu_python()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = subprocess.run([python, os.path.join(HERE, "torch_tpu_launch.py")],
                         input=json.dumps(cases), capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULTS="))
    results = json.loads(line[len("RESULTS="):])
    for r in results:
        assert "error" not in r, r.get("trace") or r
    return results


# ---- the checks ------------------------------------------------------------------------------

REQUIRED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY")  # discovery.cc


def worker_problems(facts, plans) -> list[str]:
    """What TorchTPU's worker-side native code requires of every rank's environment
    (``discovery.cc``, ``environment.cc``, ``handshake.py``, ``process_group_tpu.cc``,
    ``device_mesh.py``), over the whole world."""
    problems = []
    envs = [p.env for p in plans]
    rank0 = next(e for e in envs if e.get("RANK") == "0")
    host_of_rank = {int(e["RANK"]): f.node_ip for f, e in zip(facts, envs)}
    world = int(rank0["WORLD_SIZE"])
    if sorted(host_of_rank) != list(range(world)):
        problems.append(f"ranks are not 0..{world - 1}: {sorted(host_of_rank)}")
    for f, env in zip(facts, envs):
        who = f"rank {env.get('RANK')} ({f.node_ip})"
        missing = [k for k in REQUIRED if not env.get(k)]
        if missing:
            problems.append(f"{who}: missing {missing} (discovery.cc)")
            continue
        addresses = env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
        rank = int(env["RANK"])
        own = addresses[rank % len(addresses)].split(":")
        if len(own) != 2:
            problems.append(f"{who}: own address {own} is not host:port")
        elif own[0] not in (f.node_ip, "localhost"):
            problems.append(f"{who}: own slicebuilder address is on {own[0]}, not on its host")
        chip = env.get("TPU_VISIBLE_DEVICES", "")
        if not chip.isdigit() or chip != f.accelerator_ids["TPU"][0]:
            problems.append(f"{who}: TPU_VISIBLE_DEVICES={chip!r} is not Ray's chip "
                            f"{f.accelerator_ids['TPU'][0]} (TorchTPU falls back to LOCAL_RANK)")
        topology = env["TORCH_TPU_TOPOLOGY"]
        dims = topology.split(",")
        if len(dims) not in (3, 4) or not all(d.isdigit() for d in dims):
            problems.append(f"{who}: TORCH_TPU_TOPOLOGY={topology!r} is not comma form "
                            "(copied verbatim into TPU_HOST_BOUNDS)")
        elif math.prod(int(d) for d in dims) != len(addresses):  # one process per chip
            problems.append(f"{who}: topology {topology} has not one chip per address "
                            f"({len(addresses)})")
        slices = world // len(addresses)
        if world % len(addresses):
            problems.append(f"{who}: WORLD_SIZE {world} is not slices x {len(addresses)}")
        if slices > 1:
            coordinator = env.get("MEGASCALE_COORDINATOR_ADDRESS", "")
            if (env.get("MEGASCALE_NUM_SLICES") != str(slices)
                    or env.get("MEGASCALE_SLICE_ID") != str(rank // len(addresses))
                    or not coordinator.rpartition(":")[2].isdigit()):
                problems.append(f"{who}: MegaScale variables do not describe {slices} slices "
                                "with ranks slice-major and a coordinator port (device_mesh.py)")
            elif coordinator != f"{host_of_rank[0]}:8080":
                problems.append(f"{who}: MEGASCALE_COORDINATOR_ADDRESS={coordinator} is not "
                                "rank 0's host and local rank 0's MEGASCALE_PORT")
        if env["MASTER_ADDR"] != host_of_rank[0]:
            problems.append(f"{who}: MASTER_ADDR {env['MASTER_ADDR']} is not rank 0's host "
                            f"{host_of_rank[0]} (handshake.py dials it)")
        if "TORCH_TPU_DEVICES_PER_HOST" in env:
            problems.append(f"{who}: TORCH_TPU_DEVICES_PER_HOST makes a /dev/shm store keyed by "
                            "the raylet's pid")
        for key in ("TORCH_TPU_INTERNAL_HANDSHAKE_PORT", "TORCH_TPU_XPROF_SESSION_ID",
                    "MASTER_PORT", "NNODES"):
            if env.get(key) != rank0.get(key):
                problems.append(f"{who}: {key} differs from rank 0's")
    return problems


def launch_cases(facts, plans, generation: str) -> list[dict]:
    """One launcher parent per host (see the module docstring), plus, per rank, the planned
    environment handed to ``set_tpu_launch_env``, which must find nothing to set."""
    cases = []
    hosts = {}
    for f, p in zip(facts, plans):
        hosts.setdefault(f.node_id, (f, p))
    for f, p in hosts.values():
        env = p.env
        addresses = env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
        names = list(dict.fromkeys(a.split(":")[0] for a in addresses))
        single = len(names) == 1
        launcher = {} if single else {"TPU_WORKER_HOSTNAMES": ",".join(names),
                                      "TORCH_TPU_TOPOLOGY": env["TORCH_TPU_TOPOLOGY"]}
        cases.append({"kind": "launch", "host": f.node_id, "generation": generation,
                      "chips": int(env["LOCAL_WORLD_SIZE"]), "coords": list(f.tpu_chip_coords or []),
                      "env": launcher, "nnodes": None if single else len(names),
                      "nproc_per_node": int(env["LOCAL_WORLD_SIZE"])})
    seen = set()
    for f, p in zip(facts, plans):
        if f.node_id in seen:  # one rank per host: the others differ only in their ranks
            continue
        seen.add(f.node_id)
        cases.append({"kind": "launch", "rank": p.env["RANK"], "generation": generation,
                      "chips": int(p.env["LOCAL_WORLD_SIZE"]),
                      "coords": list(f.tpu_chip_coords or []), "env": p.env,
                      "nnodes": int(p.env["NNODES"]),
                      "nproc_per_node": int(p.env["LOCAL_WORLD_SIZE"])})
    return cases


def launch_problems(facts, plans, results) -> list[str]:
    """Differences between TorchTPU's launcher on each host and our plan."""
    problems = []
    by_node = {r_case["host"]: r for r_case, r in results if "host" in r_case}
    for f, p in zip(facts, plans):
        env, theirs = p.env, by_node[f.node_id]["env"]
        who = f"rank {env['RANK']} ({f.node_ip})"
        ours_hosts = [a.split(":")[0] for a in env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")]
        their_hosts = [a.split(":")[0]
                       for a in theirs["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")]
        if ours_hosts != their_hosts:
            problems.append(f"{who}: address hosts {ours_hosts} != TorchTPU's {their_hosts}")
        if theirs["TORCH_TPU_TOPOLOGY"] != env["TORCH_TPU_TOPOLOGY"]:
            problems.append(f"{who}: topology {env['TORCH_TPU_TOPOLOGY']} != TorchTPU's "
                            f"{theirs['TORCH_TPU_TOPOLOGY']}")
        if len(set(ours_hosts)) == 1:
            continue  # one host: TorchTPU plans no ranks
        node_rank = int(theirs["NODE_RANK"])
        slice_offset = int(env.get("MEGASCALE_SLICE_ID", 0)) * len(set(ours_hosts))
        if env["NODE_RANK"] != str(slice_offset + node_rank):
            problems.append(f"{who}: NODE_RANK {env['NODE_RANK']} != TorchTPU's topological "
                            f"{node_rank} (+ slice offset {slice_offset})")
        torchrun_rank = node_rank * int(env["LOCAL_WORLD_SIZE"]) + int(env["LOCAL_RANK"])
        if int(env["RANK"]) % len(ours_hosts) != torchrun_rank:
            problems.append(f"{who}: RANK is not torchrun's NODE_RANK*nproc+LOCAL_RANK "
                            f"({torchrun_rank})")
        slices = int(env.get("MEGASCALE_NUM_SLICES", 1))
        if theirs["NNODES"] != str(int(env["NNODES"]) // slices):
            problems.append(f"{who}: NNODES per slice {theirs['NNODES']} vs ours {env['NNODES']}")
        if slices == 1 and theirs["MASTER_ADDR"] != env["MASTER_ADDR"]:
            problems.append(f"{who}: MASTER_ADDR {env['MASTER_ADDR']} != TorchTPU's "
                            f"{theirs['MASTER_ADDR']}")
    for case, r in results:
        if "rank" in case and r["set"]:
            problems.append(f"rank {case['rank']}: set_tpu_launch_env still set {r['set']} on "
                            "the planned environment")
    return problems


def check(facts, plans, generation, results=None):
    """Every problem TorchTPU's code finds with ``plans``; ``results`` of a run made before
    (:func:`all_results`), else run now."""
    cases = launch_cases(facts, plans, generation)
    results = run_torch_tpu(cases) if results is None else results
    return worker_problems(facts, plans) + launch_problems(facts, plans, list(zip(cases, results)))


# ---- the cases --------------------------------------------------------------------------------

V7X = {"per_host": 8, "accelerator_type": "TPU-V7X", "resource_per_chip": 2}

CASES = {
    "v5p-1host": ("v5p", lambda: host_facts("", [0], per_host=4)),
    "v6e-1host": ("v6e", lambda: host_facts("", [0], per_host=8)),
    "v5p-4hosts": ("v5p", lambda: host_facts("2x2x4", SHUFFLED)),
    "v6e-4hosts": ("v6e", lambda: host_facts("4x4", SHUFFLED)),
    # The hosts' accelerator type alone (no topology reported): its standard topology, 4x4.
    "v6e-4hosts-by-type": ("v6e", lambda: [
        f.__class__(**{**f.__dict__, "tpu_topology": "", "tpu_accelerator_type": "v6e-16"})
        for f in host_facts("4x4", SHUFFLED)]),
    "v6e-2slices": ("v6e", lambda: (
        host_facts("4x4", SHUFFLED, slice_name="b", ip_base=2, node_prefix="b")
        + host_facts("4x4", [1, 3, 0, 2], slice_name="a", ip_base=1, node_prefix="a"))),
    # TPU v7x: 4 chips of 2 devices per host, one worker per device (Ray counting devices).
    "v7x-1host": ("v7", lambda: host_facts("", [0], **V7X)),
    "v7x-4hosts": ("v7", lambda: host_facts("2x2x4", SHUFFLED, **V7X)),
    "v7x-2slices": ("v7", lambda: (
        host_facts("2x2x4", SHUFFLED, slice_name="b", ip_base=2, node_prefix="b", **V7X)
        + host_facts("2x2x4", [1, 3, 0, 2], slice_name="a", ip_base=1, node_prefix="a",
                     **V7X))),
}


def naive_plan():
    """The hosts of ``v5p-4hosts`` planned as if Ray's node order were the slice's (every host
    reporting the coordinates of its Ray index); returns (real facts, that plan)."""
    import dataclasses

    real = host_facts("2x2x4", SHUFFLED)
    naive = host_facts("2x2x4", [0, 1, 2, 3])
    return real, tpu_plan([dataclasses.replace(r, tpu_chip_coords=n.tpu_chip_coords,
                                               tpu_worker_id=n.tpu_worker_id)
                           for r, n in zip(real, naive)])


TOPOLOGY_SHAPES = ["2x2x4", "4x4x4", "4x4", "8x16", "2,2,1,2", "4x4x8"]


def topology_cases() -> list[dict]:
    return [{"kind": "node_rank", "topology": shape, "coords": [h[0] * 2 + 1, h[1] * 2, h[2]]}
            for shape in TOPOLOGY_SHAPES for h in slice_hosts(shape)[:12]]


@pytest.fixture(scope="module")
def all_results():
    """Every case of this module, run by TorchTPU in one process (its import takes seconds)."""
    groups = {}
    for name, (generation, make) in CASES.items():
        facts = make()
        plans = tpu_plan(facts)
        groups[name] = (facts, plans, generation, launch_cases(facts, plans, generation))
    real, plans = naive_plan()
    groups["naive"] = (real, plans, "v5p", launch_cases(real, plans, "v5p"))
    # Recovery in place plans two more variables of ours (the memory tier's, the budget)
    facts = CASES["v5p-4hosts"][1]()
    plans = tpu_plan(facts, memory_every=1, recovery="in_place")
    groups["in_place"] = (facts, plans, "v5p", launch_cases(facts, plans, "v5p"))
    flat = ([c for g in groups.values() for c in g[3]] + topology_cases()
            + [DEFAULT_PORTS_CASE, {"kind": "hardware"}])
    results = iter(run_torch_tpu(flat))
    out = {name: [next(results) for _ in g[3]] for name, g in groups.items()}
    out["topology"] = list(results)
    out["hardware"] = out["topology"].pop()
    out["default_ports"] = out["topology"].pop()
    return groups, out


# TorchTPU's launcher on a host of a 2-host job given no addresses: it numbers the ports itself,
# from TORCH_TPU_BASE_PORT's default (the base our plan falls back to).
DEFAULT_PORTS_CASE = {"kind": "launch", "host": "defaults", "generation": "v5p", "chips": 4,
                      "coords": [], "nnodes": 2, "nproc_per_node": 4,
                      "env": {"TPU_WORKER_HOSTNAMES": "h0,h1", "JOB_COMPLETION_INDEX": "0"}}


@pytest.mark.parametrize("case", CASES)
def test_plans_pass_torchtpu_launch_code(case, all_results):
    groups, results = all_results
    facts, plans, generation, _ = groups[case]
    assert check(facts, plans, generation, results[case]) == []
    per_host = int(plans[0].env["LOCAL_WORLD_SIZE"])
    if "4hosts" in case:  # Ray's node n is the slice's host SHUFFLED[n]
        assert [p.env["NODE_RANK"] for p in plans][::per_host] == [str(s) for s in SHUFFLED]
    if generation == "v7":  # one process per device: 4 chips, 8 ranks and addresses per host
        env = plans[0].env
        assert per_host == 8 and env["TORCH_TPU_TOPOLOGY"].endswith(",2")
        slices = int(env.get("MEGASCALE_NUM_SLICES", 1))
        assert len(env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == len(facts) // slices
        for f, p in zip(facts, plans):
            assert p.env["TPU_VISIBLE_DEVICES"] == f.accelerator_ids["TPU"][0] == p.env[
                "LOCAL_RANK"]


def test_a_plan_in_rays_node_order_fails(all_results):
    """TorchTPU's launcher, given the real coordinates, disagrees with a plan in Ray's order."""
    groups, results = all_results
    real, plans, generation, _ = groups["naive"]
    problems = check(real, plans, generation, results["naive"])
    assert any("!= TorchTPU's topological" in p for p in problems), problems
    assert any("RANK is not torchrun's" in p for p in problems), problems


def test_the_in_place_recovery_plan_passes_torchtpu_launch_code(all_results):
    from ray_train_xla.planning.contract import RECOVERY_VAR

    groups, results = all_results
    facts, plans, generation, _ = groups["in_place"]
    assert check(facts, plans, generation, results["in_place"]) == []
    assert {p.env[RECOVERY_VAR] for p in plans} == {"in_place:3"}


def test_topological_order_is_torchtpus(all_results):
    """Our slice order and host placing are TorchTPU's (``_get_slice_host_coordinates``,
    ``_calculate_topological_node_rank``) on v4/v5p and v5e/v6e shapes, and v7's 4th entry."""
    from ray_train_xla.planning.runtimes.native_tpu import host_position

    _, results = all_results
    cases = topology_cases()
    assert len(results["topology"]) == len(cases)
    for case, r in zip(cases, results["topology"]):
        assert [tuple(h) for h in r["hosts"]] == slice_hosts(case["topology"])
        assert r["node_rank"] == host_position(case["coords"], case["topology"])


def test_an_environment_that_cannot_be_built_fails_unless_skipped(tmp_path, monkeypatch):
    """The contract is never silently absent: a venv that cannot be built (here: its place is
    under a file) fails the tests that need it, naming the way to skip them."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(sys.modules[__name__], "VENV", str(blocker / "venv"))
    with pytest.raises(BaseException) as info:  # a skip is a BaseException too: caught here
        torch_tpu_python()
    assert info.type is pytest.fail.Exception, info.type  # failed, not skipped
    assert "cannot build the torch-tpu environment" in str(info.value)
    assert f"set {SKIP_VAR}=1 to skip them" in str(info.value)
    assert not skipped()
    for value, skip in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv(SKIP_VAR, value)
        assert skipped() is skip


def test_the_constants_the_planner_copies_are_torchtpus(all_results):
    """What the plan copies from torch-tpu equals the installed torch-tpu's own values: devices
    per chip by generation and the v7 local topologies (``hardware.get_devices_per_chip``,
    ``hardware._V7_TOPOLOGY``), each generation's PCI device id and name and Google's vendor id
    (``_PCI_DEVICE_ID_TO_NAME``, ``_GOOGLE_PCI_VENDOR_ID``: ``doctor`` counts devices by them),
    the one-host topologies of each generation (``_TOPOLOGY_BY_TPU_PCI_DEVICE_ID``, for the chip
    counts a host of it holds), the chips of a host of a multi-host slice (``_CHIPS_PER_HOST``)
    and the slicebuilder base port (``TORCH_TPU_BASE_PORT``'s default, as its launcher numbers
    the ports). MegaScale's base port (8080) lives in compiled code and is not compared."""
    from ray_train_xla.planning.hardware import (
        GOOGLE_PCI_VENDOR,
        MULTI_HOST_CHIPS,
        tpu_generation_of_pci,
        tpu_generation_spec,
    )
    from ray_train_xla.planning.runtimes.native_tpu import (
        BASE_PORT,
        CHIPS_PER_HOST,
        HOST_GRIDS,
        V7_HOST_GRIDS,
    )
    from ray_train_xla.planning.runtimes.tpu import devices_per_chip, tpu_slice

    _, results = all_results
    theirs = results["hardware"]
    assert theirs["devices_per_chip"]["v7"] == 2  # what the v7x cases above rest on
    for generation, count in theirs["devices_per_chip"].items():
        assert devices_per_chip(f"{generation}-8") == count, generation
    assert {int(k): v for k, v in theirs["v7_topology"].items()} == V7_HOST_GRIDS
    for spelling in ("tpu7x-32", "v7x-32", "TPU-V7X"):
        assert devices_per_chip(spelling) == 2
    assert theirs["pci_vendor"] == GOOGLE_PCI_VENDOR
    assert tuple(theirs["chips_per_host"]) == CHIPS_PER_HOST == MULTI_HOST_CHIPS
    assert set(theirs["topologies"]) == set(theirs["pci_names"])
    for pci, name in theirs["pci_names"].items():  # "TPU v5e"
        gen = tpu_generation_spec(name.split()[-1])
        assert gen is not None and gen.pci_device_id == pci and tpu_generation_of_pci(pci) is gen
        table = {int(k): v for k, v in theirs["topologies"][pci].items()}
        if gen.devices_per_chip > 1:
            assert table == V7_HOST_GRIDS
            continue
        ours = {c: HOST_GRIDS[c] for c in table if c <= gen.single_host_chips}
        assert ours == {c: v for c, v in table.items() if c <= gen.single_host_chips}, name
        for chips, shape in gen.topologies.items():  # the one-host slices of the generation
            layout = tpu_slice(gen.accelerator_type(chips))
            if layout.hosts == 1 and chips in table:
                assert layout.comma == table[chips] == tpu_slice("", shape).comma, (name, shape)
    ports = results["default_ports"]["env"]["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    assert [int(a.rsplit(":", 1)[1]) for a in ports[:4]] == [BASE_PORT + i for i in range(4)]


def test_the_private_names_of_torch_tpu_are_there():
    """The torch-tpu names the source uses (docs/architecture.md, "Private names"; the others
    are checked by ``test_torch_internals.py``): the loader Ray's ``tpu_dist`` path calls, and
    the module of the chip-coordinate query run as ``python -m``."""
    from test_torch_internals import private_names

    names = sorted(k for k in private_names() if k.startswith("torch_tpu"))
    assert names == ["torch_tpu._internal.distributed.distributed", "torch_tpu._loader"], names
    code = ("import importlib.util, torch_tpu._loader as loader; assert callable(loader.load); "
            "assert importlib.util.find_spec('torch_tpu._internal.distributed.distributed')")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = subprocess.run([torch_tpu_python(), "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_spec_states_the_wheel_s_requirements_and_the_libtpu_installed():
    """docs/native-tpu-spec.md's torch and libtpu requirements are the wheel's Requires-Dist,
    and every libtpu version it names is the one pip installed with it."""
    code = ("import importlib.metadata as m, json; print(json.dumps({'requires': "
            "m.requires('torch-tpu'), 'python': m.metadata('torch-tpu')['Requires-Python'], "
            "'libtpu': m.version('libtpu')}))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = subprocess.run([torch_tpu_python(), "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = json.loads(out.stdout)
    with open(os.path.join(os.path.dirname(HERE), "docs", "native-tpu-spec.md"), encoding="utf-8") as f:
        spec = " ".join(f.read().split())
    import re

    for name in ("torch", "libtpu"):
        (requirement,) = [r.replace(" ", "") for r in wheel["requires"]
                          if re.match(rf"{name}\s*[<>=]", r)]
        assert f"`{requirement}`" in spec, requirement
    assert f"Requires Python {wheel['python'].replace('>=', '>= ')}" in spec
    assert set(re.findall(r"libtpu (\d+\.\d+\.\d+)", spec)) == {wheel["libtpu"]}
