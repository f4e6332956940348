"""Native TorchTPU (TorchTPUConfig) without Ray: options, the plan (hosts in TorchTPU's
topological order whatever Ray's node order, the worker-id fallback, multislice by slice name),
the refusals, and ``plan --device tpu --runtime native``. TorchTPU's own launch code checks the
same plans in test_native_tpu_contract.py."""

import json
import subprocess
import sys

import pytest

from ray_train_xla import TorchTPUConfig, XLAConfigError
from ray_train_xla.planning import Rendezvous, TPUOptions, plan, resolve_device
from ray_train_xla.planning.runtimes.native_tpu import NativeTPURuntime, slice_hosts
from ray_train_xla.planning.topology import Topology, WorkerFacts
from ray_train_xla.tools.cli import main

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.13

RDZV = Rendezvous(master_addr="?", master_port=29500, run_id="r", extra_ports=(29611,))
CHIPS = (2, 2, 1)


def host_facts(topology, order, per_host=4, slice_name="", ip_base=1, coords=True,
               worker_ids=True, first_chip=0, node_prefix="n", accelerator_type="",
               resource_per_chip=None):
    """Facts for the hosts of one slice as Ray lists them: Ray's node n is the slice's host
    ``order[n]`` (its position in TorchTPU's topological order); each host reports one chip's
    coordinates (its host coordinates times the chips per host, plus the chip's own offset).
    ``accelerator_type`` and ``resource_per_chip`` as Ray reports them (TPU v7x: "TPU-V7X", and
    2 where Ray counts devices; the ids are then device ids, ``per_host`` devices)."""
    hosts = slice_hosts(topology) if len(order) > 1 else [(0, 0, 0)]
    facts = []
    for n, position in enumerate(order):
        host = hosts[position]
        for local in range(per_host):
            chip = first_chip + local
            offset = (chip % 2, (chip // 2) % 2, 0)  # any chip of the host: the same host place
            facts.append(WorkerFacts(
                node_id=f"{node_prefix}{n}", node_ip=f"10.0.{ip_base}.{n + 1}", pid=100 + local,
                accelerator_ids={"TPU": (str(chip),)}, tpu_name=slice_name,
                tpu_topology=topology, tpu_worker_id=position if worker_ids else None,
                tpu_chip_coords=(tuple(h * c + o for h, c, o in zip(host, CHIPS, offset))
                                 if coords else None),
                free_port=40000 + 10 * n + local, tpu_accelerator_type=accelerator_type,
                tpu_resource_per_chip=resource_per_chip))
    return facts


def tpu_plan(facts, **options):
    return plan(Topology.from_facts(facts, "TPU"), TPUOptions(device="tpu", **options), RDZV,
                "tpu", facts)


SHUFFLED = [2, 0, 3, 1]  # Ray's node n is the slice's host SHUFFLED[n]


@pytest.mark.parametrize("topology", ["2x2x4", "4x4"], ids=["v5p", "v6e"])
def test_hosts_follow_torchtpu_order_not_rays(topology):
    facts = host_facts(topology, SHUFFLED)
    plans = tpu_plan(facts)
    by_host = {}
    for f, p in zip(facts, plans):
        env = p.env
        position = SHUFFLED[int(f.node_id[1:])]
        assert env["NODE_RANK"] == env["GROUP_RANK"] == str(position)
        chip = int(f.accelerator_ids["TPU"][0])
        assert env["LOCAL_RANK"] == str(chip) and env["RANK"] == str(4 * position + chip)
        assert env["TPU_VISIBLE_DEVICES"] == env["TPU_VISIBLE_CHIPS"] == str(chip)
        assert env["NNODES"] == "4" and env["WORLD_SIZE"] == "16"
        by_host[position] = f.node_ip
    master = by_host[0]
    addresses = plans[0].env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    assert [a.split(":")[0] for a in addresses] == [by_host[h] for h in range(4) for _ in range(4)]
    for f, p in zip(facts, plans):
        env = p.env
        assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == ",".join(addresses)  # same on all
        assert addresses[int(env["RANK"])] == f"{f.node_ip}:{f.free_port}"  # its own entry
        assert env["MASTER_ADDR"] == master
        assert env["TORCH_TPU_TOPOLOGY"] == ("2,2,4" if topology == "2x2x4" else "4,4,1")
        assert env["TORCH_TPU_INTERNAL_HANDSHAKE_PORT"] == "29611"
        assert "MEGASCALE_SLICE_ID" not in env and "TORCH_TPU_DEVICES_PER_HOST" not in env
    assert len({p.env["TORCH_TPU_XPROF_SESSION_ID"] for p in plans}) == 1
    runtime = NativeTPURuntime()
    topo = Topology.from_facts(facts, "TPU")
    assert facts[runtime.master_worker(topo)].node_ip == master  # ports are taken there


def test_worker_id_fallback_and_single_host():
    facts = host_facts("2x2x4", SHUFFLED, coords=False)
    assert [p.env["NODE_RANK"] for p in tpu_plan(facts)][::4] == ["2", "0", "3", "1"]
    one = host_facts("", [0], per_host=2, first_chip=2)  # chips 2 and 3 of one host
    plans = tpu_plan(one, compile_cache="/shared/tpu-cache")
    env = plans[1].env
    assert env["TORCH_TPU_TOPOLOGY"] == "1,2,1" and env["NODE_RANK"] == "0"
    assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == "localhost:40000,localhost:40001"
    assert (env["RANK"], env["LOCAL_RANK"], env["TPU_VISIBLE_DEVICES"]) == ("1", "1", "3")
    assert env["TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"] == "/shared/tpu-cache"
    assert env["ACCELERATE_TORCH_DEVICE"] == "tpu:0"
    assert (env["RAY_TRAIN_XLA_PG_BACKEND"], env["RAY_TRAIN_XLA_INIT_METHOD"]) == (
        "tpu_dist", "env://")


def test_multislice_by_slice_name():
    # Ray lists slice "b" first; its hosts shuffled too. Slice ids follow the names.
    facts = (host_facts("2x2x2", [1, 0], slice_name="b", ip_base=2, node_prefix="b")
             + host_facts("2x2x2", [0, 1], slice_name="a", ip_base=1, node_prefix="a"))
    plans = tpu_plan(facts)
    a0 = next(f.node_ip for f in facts if f.node_id == "a0")
    for f, p in zip(facts, plans):
        env = p.env
        slice_id = 0 if f.tpu_name == "a" else 1
        position = [1, 0][int(f.node_id[1:])] if f.tpu_name == "b" else int(f.node_id[1:])
        assert env["MEGASCALE_SLICE_ID"] == str(slice_id) and env["MEGASCALE_NUM_SLICES"] == "2"
        assert env["NODE_RANK"] == str(2 * slice_id + position)
        assert int(env["RANK"]) // 8 == slice_id and env["WORLD_SIZE"] == "16"
        assert env["MEGASCALE_COORDINATOR_ADDRESS"] == f"{a0}:8080" == f"{env['MASTER_ADDR']}:8080"
        assert env["MEGASCALE_PORT"] == str(8080 + 2 * int(env["LOCAL_RANK"]))
        hosts = {a.split(":")[0] for a in env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")}
        assert hosts == {g.node_ip for g in facts if g.tpu_name == f.tpu_name}  # per slice


@pytest.mark.parametrize("change, match", [
    (lambda fs: [f if f.node_id != "n1" else f.__class__(**{**f.__dict__, "tpu_chip_coords": None,
                                                             "tpu_worker_id": None}) for f in fs],
     r"10\.0\.1\.2 report neither.*Ray's node order is not the slice's"),
    (lambda fs: fs[:8], r"every chip of the slice in the job: the slice is \(topology 2x2x4: 4 "
     r"hosts of 4 chips\), the job has 2 hosts and 8 workers. Use ScalingConfig\(num_workers=16"),
    (lambda fs: [f.__class__(**{**f.__dict__, "tpu_topology": ""}) for f in fs],
     r"report no slice topology .*TorchTPU needs TORCH_TPU_TOPOLOGY of the whole slice"),
    (lambda fs: [f.__class__(**{**f.__dict__, "accelerator_ids": {"TPU": ("0", "1")}})
                 for f in fs], r"2 TPU chips per worker.*\{'TPU': 1\} and num_workers=32"),
    (lambda fs: fs + host_facts("2x2x2", [0, 1], slice_name="b", ip_base=2, node_prefix="b"),
     r"a TPU slice name on every host"),
])
def test_refusals_name_the_fix(change, match):
    with pytest.raises(XLAConfigError, match=match):
        tpu_plan(change(host_facts("2x2x4", SHUFFLED)))


V7X = {"per_host": 8, "accelerator_type": "TPU-V7X", "resource_per_chip": 2}


@pytest.mark.parametrize("facts, match", [
    # Ray counting per chip (its default) on v7x: each TPU: 1 worker holds a whole chip.
    (lambda: host_facts("2x2x4", SHUFFLED, per_host=4, accelerator_type="TPU-V7X",
                        resource_per_chip=1),
     r"2 devices and TorchTPU runs one process per device, but Ray counts TPU per chip on "
     r"10\.0\.1\.1.*RAY_TPU_RESOURCE_PER_CHIP=2"),
    # Part of a v7x slice: 2 of its 4 hosts.
    (lambda: host_facts("2x2x4", SHUFFLED, **V7X)[:16],
     r"every device of the slice.*4 hosts of 4 chips \(8 devices\)\), the job has 2 hosts and "
     r"16 workers. Use ScalingConfig\(num_workers=32"),
    # Two devices (a whole chip) per worker, Ray counting devices.
    (lambda: [f.__class__(**{**f.__dict__, "accelerator_ids": {"TPU": ("0", "1")}})
              for f in host_facts("2x2x4", SHUFFLED, **V7X)],
     r"2 TPU devices per worker.*one device per process"),
    (lambda: host_facts("", [0], **{**V7X, "per_host": 6}),
     r"2, 4 or 8 workers \(one device each"),
])
def test_v7x_refusals_name_the_fix(facts, match):
    with pytest.raises(XLAConfigError, match=match):
        tpu_plan(facts())


def test_v7x_plan_per_device():
    """A v7x host of 4 chips runs 8 workers, one per device: the device Ray assigned is the
    one TorchTPU sees; ranks, addresses and the 4-D topology count devices."""
    facts = host_facts("2x2x2", [1, 0], **V7X)
    plans = tpu_plan(facts)
    assert [p.env["NODE_RANK"] for p in plans] == ["1"] * 8 + ["0"] * 8
    for f, p in zip(facts, plans):
        env = p.env
        device = f.accelerator_ids["TPU"][0]
        assert env["TPU_VISIBLE_DEVICES"] == env["TPU_VISIBLE_CHIPS"] == device
        assert env["LOCAL_RANK"] == device and env["WORLD_SIZE"] == "16"
        assert env["RANK"] == str(8 * int(env["NODE_RANK"]) + int(device))
        assert env["TORCH_TPU_TOPOLOGY"] == "2,2,2,2"
        assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[int(env["RANK"])] == (
            f"{f.node_ip}:{f.free_port}")
    # one host: TorchTPU's own local topologies, by the devices
    for devices, topology in ((2, "1,1,1,2"), (4, "1,2,1,2"), (8, "2,2,1,2")):
        env = tpu_plan(host_facts("", [0], **{**V7X, "per_host": devices}))[0].env
        assert env["TORCH_TPU_TOPOLOGY"] == topology


def test_auto_device_and_config_errors():
    assert resolve_device("auto", host_facts("", [0], per_host=1), "native", "tpu") == "tpu"
    assert resolve_device("auto", [WorkerFacts("n", "1.2.3.4", 1)], "native", "tpu") == "cpu"
    cases = [({"device": "neuron"}, "TorchTPUConfig.device='neuron' is not valid: expected one "
              "of 'auto', 'tpu', 'cpu'"),
             ({"backend": "gloo"}, "TorchTPUConfig.backend='gloo'.*'tpu_dist' process group"),
             ({"env": {"TORCH_TPU_TOPOLOGY": "2,2,1"}}, "TORCH_TPU_TOPOLOGY is planned"),
             ({"env": {"TORCH_TPU_DEVICES_PER_HOST": "4"}}, "raylet"),
             ({"timeout_s": 0}, "TorchTPUConfig.timeout_s=0")]
    for kwargs, match in cases:
        with pytest.raises(XLAConfigError, match=match):
            TorchTPUConfig(**kwargs)
    config = TorchTPUConfig(device="cpu")
    config.device = "gpu"
    with pytest.raises(XLAConfigError, match="device='gpu'"):
        config.validate()


def test_plan_command_prints_the_native_tpu_plan(capsys):
    assert main(["plan", "--device", "tpu", "--runtime", "native", "--nodes", "4",
                 "--workers-per-node", "4", "--tpu-slices", "2", "--tpu-topology", "2x4",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["env"]["MEGASCALE_SLICE_ID"] for r in rows] == ["0"] * 8 + ["1"] * 8
    assert {r["env"]["TORCH_TPU_TOPOLOGY"] for r in rows} == {"2,4,1"}
    assert [r["env"]["RANK"] for r in rows] == [str(i) for i in range(16)]
    assert main(["plan", "--device", "tpu", "--runtime", "native", "--spmd"]) == 2
    assert "TorchTPUConfig.spmd=True" in capsys.readouterr().err
    assert main(["plan", "--device", "cpu", "--tpu-slices", "2"]) == 2


def test_native_tpu_planning_needs_neither_ray_nor_torch():
    from test_core_imports import BLOCKED

    code = BLOCKED + (
        "import contextlib, io, sys\n"
        "from ray_train_xla.tools.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['plan', '--device', 'tpu', '--runtime', 'native', '--nodes', '2',"
        " '--workers-per-node', '4']) == 0\n"
        "print('loaded', sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "loaded []" in out.stdout


def test_cpu_twin_plans_what_the_neuron_cpu_twin_plans():
    """TorchTPUConfig(device="cpu") plans exactly TorchNeuronConfig(device="cpu")'s environment
    (gloo on CPU, no TPU variables), so test_native_ray's CPU twin run covers it."""
    from ray_train_xla.planning import NeuronOptions

    facts = [WorkerFacts(f"n{n}", f"10.0.0.{n + 1}", 100 + i) for n in range(2) for i in range(2)]
    topology = Topology.from_facts(facts)
    ours = plan(topology, TPUOptions(device="cpu"), RDZV, "cpu", facts)
    neuron = plan(topology, NeuronOptions(device="cpu"), RDZV, "cpu", facts)
    assert [p.env for p in ours] == [p.env for p in neuron]
    assert {p.env["RAY_TRAIN_XLA_PG_BACKEND"] for p in ours} == {"gloo"}
    assert not any(k.startswith(("TPU_", "TORCH_TPU_")) for k in ours[0].env)


WORKER_CHECKS = r"""
import os, sys
from ray_train_xla.errors import WorkerSetupError
from ray_train_xla.startup import native_tpu as w
os.environ.update(RANK="3", LOCAL_RANK="1", TPU_VISIBLE_DEVICES="0,1", RAY_TRAIN_XLA_RUNTIME="native",
                  RAY_TRAIN_XLA_DEVICE="tpu")
def run(step):
    try:
        step()
        print("ok")
    except WorkerSetupError as exc:
        print("error:", exc)
run(w.before_process_group)            # torch_tpu not importable
sys.path.insert(0, sys.argv[1])
run(w.check_one_chip)                  # two chips
os.environ["TPU_VISIBLE_DEVICES"] = "5"
run(w.before_process_group)            # fine: tpu_dist registered
import torch, torch_tpu
torch_tpu._use_device()                # something used the device first
run(w.prepare_tpu_worker)
import ray_train_xla as rtx
print(rtx.get_device(), rtx.is_native() if hasattr(rtx, "is_native") else "")
rtx.sync(); rtx.toolkit.device.wait()
"""


def test_worker_steps_and_device_layer():
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", WORKER_CHECKS, os.path.join(here, "doubles")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 5, out.stdout
    assert lines[0].startswith("error: worker rank 3 (local rank 1, node ")
    assert "needs torch-tpu" in lines[0] and "device='cpu'" in lines[0]
    assert "TPU_VISIBLE_DEVICES='0,1' is not one chip" in lines[1]
    assert lines[2] == "ok"
    assert "already used in this process" in lines[3] and "inside the training function" in lines[3]
    assert lines[4].startswith("tpu:0")


def fake_dists(tmp_path, torch_spec, libtpu):
    """An installed-looking torch-tpu (metadata only), and libtpu when ``libtpu`` is a version."""
    info = tmp_path / "torch_tpu-0.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch-tpu\nVersion: 0.2.0\n"
        f"Requires-Dist: torch{torch_spec}\nRequires-Dist: libtpu>=0.0.50\n")
    if libtpu:
        lib = tmp_path / f"libtpu-{libtpu}.dist-info"
        lib.mkdir()
        (lib / "METADATA").write_text(f"Metadata-Version: 2.1\nName: libtpu\nVersion: {libtpu}\n")
    return str(tmp_path)


@pytest.mark.parametrize("torch_spec, libtpu, lib", [
    ("<=2.15.0,>=2.11.0", "0.0.51", "OK"),  # torch-tpu 0.2.0's pin: FAIL on torch 2.9
    (">=2.9", None, "FAIL"),
    (">=2.9", "0.0.40", "FAIL"),
])
def test_doctor_checks_torch_tpu_pin_and_libtpu(tmp_path, torch_spec, libtpu, lib):
    import os

    import torch
    from packaging.specifiers import SpecifierSet

    native = "OK" if torch.__version__.split("+")[0] in SpecifierSet(torch_spec) else "FAIL"

    site = fake_dists(tmp_path, torch_spec, libtpu)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "ray_train_xla.tools.cli", "doctor",
                          "--no-load-check", "--json"], capture_output=True, text=True,
                         timeout=120, env=env)
    rows = {r["check"]: r for r in json.loads(out.stdout)["checks"]}
    assert rows["native TorchTPU"]["status"] == native, rows["native TorchTPU"]
    assert f"torch-tpu requires torch{torch_spec}" in rows["native TorchTPU"]["detail"]
    assert rows["libtpu"]["status"] == lib, rows["libtpu"]
    assert "libtpu>=0.0.50" in rows["libtpu"]["detail"]
    if native == "FAIL":
        assert "environment of its own" in rows["native TorchTPU"]["fix"]


def test_chip_coordinate_query_is_torchtpus_once_per_node_and_bounded(tmp_path, monkeypatch):
    """The gather asks TorchTPU's own query (here the double's) in a child process, once per
    node (cached by node id), and gives up at the deadline, ending the child."""
    import os
    import time
    import uuid

    from ray_train_xla.startup.facts import tpu_chip_coords

    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.syspath_prepend(os.path.join(here, "doubles"))
    monkeypatch.setenv("RAY_RAYLET_PID", "4242")
    monkeypatch.setenv("RTX_TEST_TPU_COORDS", json.dumps({"4242": [2, 0, 3]}))
    monkeypatch.setenv("RTX_TEST_RECORD_DIR", str(tmp_path))
    node = uuid.uuid4().hex
    assert tpu_chip_coords(node, time.monotonic() + 60) == [2, 0, 3]
    assert tpu_chip_coords(node, time.monotonic() + 60) == [2, 0, 3]  # from the node's cache
    assert len(os.listdir(tmp_path / "coords-queries")) == 1
    monkeypatch.setenv("RTX_TEST_TPU_COORDS_HANG", "1")
    start = time.monotonic()
    assert tpu_chip_coords(uuid.uuid4().hex, time.monotonic() + 2) is None
    assert time.monotonic() - start < 10


def test_the_hosts_accelerator_type_gives_the_slice():
    """TorchTPUConfig reads the slice by the rules TorchXLAConfig uses: the hosts' accelerator
    type alone gives its standard topology, a topology must fit the type's generation, and a
    generation this package does not know is refused naming the known ones."""
    typed = [f.__class__(**{**f.__dict__, "tpu_topology": "", "tpu_accelerator_type": "v6e-16"})
             for f in host_facts("4x4", SHUFFLED)]
    plans = tpu_plan(typed)
    assert {p.env["TORCH_TPU_TOPOLOGY"] for p in plans} == {"4,4,1"}
    assert [p.env["NODE_RANK"] for p in plans][::4] == [str(s) for s in SHUFFLED]
    # Ray's TPU-V6E names the generation only: the topology gives the size.
    ray_named = host_facts("4x4", SHUFFLED, accelerator_type="TPU-V6E")
    assert tpu_plan(ray_named)[0].env["TORCH_TPU_TOPOLOGY"] == "4,4,1"
    for accelerator_type, topology, match in (
            ("TPU-V6E", "2x2x4", "'2x2x4' is 3-D but v6e slices are 2-D"),
            ("v6e-24", "", "not a v6e slice size"),
            ("TPU-V9Z", "4x4", r"not of a generation this package knows: expected one of v2, "
                               r"v3, v4, v5p, v5litepod, v6e, v7x")):
        facts = [f.__class__(**{**f.__dict__, "tpu_topology": topology,
                                "tpu_accelerator_type": accelerator_type})
                 for f in host_facts("4x4", SHUFFLED)]
        with pytest.raises(XLAConfigError, match=match) as info:
            tpu_plan(facts)
        assert str(info.value).startswith("the TPU slice the hosts report (accelerator type")
