"""Native TorchNeuron (TorchNeuronConfig) without Ray: options, the plan, the plan checked by the
torch-neuronx double's contract for 1x2, 2x4 and 2x32 as Train V2 and V1 hand workers over,
next to the environment Ray's plain ``TorchConfig(backend="neuron")`` produces."""

import json
import os
import subprocess
import sys

import pytest

from ray_train_xla import TorchNeuronConfig, TorchXLAConfig, XLAConfigError
from ray_train_xla.planning import Rendezvous, plan, resolve_device
from ray_train_xla.planning.options import NeuronOptions
from ray_train_xla.planning.topology import Topology, WorkerFacts
from ray_train_xla.tools.cli import main

from neuron_contract import process_error, runtime_view, world_problems

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.13

HERE = os.path.dirname(os.path.abspath(__file__))
RDZV = Rendezvous(master_addr="10.0.0.1", master_port=29500, run_id="r", extra_ports=(29611,))
SHAPES = {"1x2": (1, 2), "2x4": (2, 4), "2x32": (2, 32)}
ROOT_PORT = 40123  # the port the native init would pick on rank 0 when NEURON_RT_ROOT_COMM_ID is unset


def facts_for(nodes, per_node, first_core=0, efa=False):
    """Workers with one Ray core each; a node's cores start at ``first_core`` (another job may
    hold the lower ones)."""
    return [WorkerFacts(node_id=f"n{n}", node_ip=f"10.0.0.{n + 1}", pid=100 + i, has_efa=efa,
                        accelerator_ids={"neuron_cores": (str(first_core + i),)})
            for n in range(nodes) for i in range(per_node)]


def native_plan(facts, **options):
    config = NeuronOptions(device="neuron", **options)
    return plan(Topology.from_facts(facts, "neuron_cores"), config, RDZV, "neuron", facts)


def ray_preset(facts, v1):
    """NEURON_RT_VISIBLE_CORES as Ray leaves it on each worker before the backend starts: the
    worker's own core (actor start, ``_private/accelerators/neuron.py``), or on Train V1 the
    union of the node's cores sorted as strings (``train/_internal/backend_executor.py``,
    ``_share_resource_ids``)."""
    union = {}
    for f in facts:
        union.setdefault(f.node_id, []).extend(f.accelerator_ids["neuron_cores"])
    return [{"NEURON_RT_VISIBLE_CORES": ",".join(sorted(union[f.node_id]) if v1
                                                  else f.accelerator_ids["neuron_cores"])}
            for f in facts]


def ray_plain_env(facts, v1, init_method="env"):
    """The environment at ``init_process_group`` under Ray 2.60's plain
    ``TorchConfig(backend="neuron")`` (``train/torch/config.py``): MASTER_* only for
    ``init_method="env"``; V2 sets LOCAL_RANK, ... and ACCELERATE_TORCH_DEVICE=str(get_device())
    = "cpu" before the group, V1 only after it (``on_training_start``)."""
    envs = ray_preset(facts, v1)
    local = {}
    for f, env in zip(facts, envs):
        if init_method == "env":
            env.update(MASTER_ADDR=facts[0].node_ip, MASTER_PORT="29500")
        if not v1:
            peers = [g for g in facts if g.node_id == f.node_id]
            local[f.node_id] = local.get(f.node_id, -1) + 1
            env.update(LOCAL_RANK=str(local[f.node_id]), LOCAL_WORLD_SIZE=str(len(peers)),
                       ACCELERATE_TORCH_DEVICE="cpu")
    return envs


def views(facts, envs):
    """The double's view of every rank; host grouping by node IP (what its fallback uses)."""
    return [runtime_view(env, rank, f.node_id,
                         [i for i, g in enumerate(facts) if g.node_ip == f.node_ip], ROOT_PORT)
            for rank, (f, env) in enumerate(zip(facts, envs))]


@pytest.mark.parametrize("recovery", [{}, {"memory_every": 1, "recovery": "in_place"}],
                         ids=["restart", "in-place"])
@pytest.mark.parametrize("v1", [False, True], ids=["V2", "V1"])
@pytest.mark.parametrize("shape", SHAPES)
def test_native_plans_pass_the_contract(shape, v1, recovery):
    nodes, per_node = SHAPES[shape]
    facts = facts_for(nodes, per_node, first_core=2)
    plans = native_plan(facts, compile_cache="/fsx/neff", **recovery)
    if recovery:  # recovery in place: the budget planned too
        assert {p.env["RAY_TRAIN_XLA_RECOVERY"] for p in plans} == {"in_place:3"}
    envs = []
    for preset, p in zip(ray_preset(facts, v1), plans):
        preset.update(p.env)  # apply_env: the plan wins over what Ray left
        envs.append(preset)
    seen = views(facts, envs)
    assert world_problems(seen) == []
    for f, v in zip(facts, seen):
        assert v["visible_cores"] == list(f.accelerator_ids["neuron_cores"])  # Ray's core
        assert v["local_rank_source"] == "env" and v["root_comm_preset"]
        assert v["root_comm_id"] == "10.0.0.1:29611"
    assert {p.env["RAY_TRAIN_XLA_PG_BACKEND"] for p in plans} == {"neuron"}
    assert {p.env["RAY_TRAIN_XLA_INIT_METHOD"] for p in plans} == {"env://"}


@pytest.mark.parametrize("v1", [False, True], ids=["V2", "V1"])
def test_plain_ray_torch_config_fails_the_same_checks(v1):
    facts = facts_for(2, 32)
    problems = world_problems(views(facts, ray_plain_env(facts, v1)))
    text = "\n".join(problems)
    assert "TORCH_NEURONX_NEFF_CACHE_DIR is not one shared directory on 2 nodes" in text
    if v1:  # shared union, no LOCAL_RANK at init: every process sees its node's 32 cores
        assert sum("more than one device per process" in p for p in problems) == 64
        assert sum("LOCAL_RANK/LOCAL_WORLD_SIZE missing" in p for p in problems) == 64
        assert "NeuronCores claimed by several processes" in text
    else:  # initialises, but the device is the CPU
        assert "more than one device" not in text
        assert sum("ACCELERATE_TORCH_DEVICE='cpu' is not a neuron device" in p
                   for p in problems) == 64
    if not v1:  # init_method="tcp" exports no MASTER_ADDR: the root communicator is localhost
        tcp = "\n".join(world_problems(views(facts, ray_plain_env(facts, v1, "tcp"))))
        assert "NEURON_RT_ROOT_COMM_ID=localhost:40123 is a loopback address on 2 nodes" in tcp


def test_v1_union_sorted_as_strings_is_replaced_by_each_workers_core():
    facts = facts_for(1, 4, first_core=8)  # cores 8..11: V1 leaves "10,11,8,9" on every worker
    preset = ray_preset(facts, v1=True)
    assert {p["NEURON_RT_VISIBLE_CORES"] for p in preset} == {"10,11,8,9"}
    assert process_error(views(facts, preset)[0])  # as Ray leaves it: init would assert
    plans = native_plan(facts)
    assert [p.env["NEURON_RT_VISIBLE_CORES"] for p in plans] == ["8", "9", "10", "11"]
    assert [p.env["ACCELERATE_TORCH_DEVICE"] for p in plans] == [f"neuron:{i}" for i in range(4)]


def test_plan_variables():
    facts = facts_for(2, 2, efa=True)
    plans = native_plan(facts, compile_cache="/fsx/neff", env={"NEURON_CC_FLAGS": "-O1"})
    env = plans[3].env
    assert env["TORCH_NEURONX_NEFF_CACHE_DIR"] == "/fsx/neff"
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_FORK_SAFE"] == "1"
    assert env["NEURON_CC_FLAGS"] == "-O1"
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["RANK"]) == ("1", "2", "3")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29500")
    assert "PJRT_DEVICE" not in env and "NEURON_COMPILE_CACHE_URL" not in env  # no XLA variables
    no_efa = native_plan(facts_for(2, 2), efa=False)[0].env
    assert "FI_PROVIDER" not in no_efa and "TORCH_NEURONX_NEFF_CACHE_DIR" not in no_efa
    cpu = plan(Topology.from_facts(facts), NeuronOptions(device="cpu"), RDZV, "cpu", facts)
    assert {(p.env["RAY_TRAIN_XLA_PG_BACKEND"], p.env["ACCELERATE_TORCH_DEVICE"]) for p in cpu} == {
        ("gloo", "cpu")}
    assert not any(k.startswith(("NEURON_", "PJRT")) for k in cpu[0].env)
    # Transformers/Accelerate keep off torch_xla on native workers (and their CPU twin), unless
    # env sets it back; XLA plans leave it alone.
    assert {p.env["USE_TORCH_XLA"] for p in plans + cpu} == {"0"}
    assert native_plan(facts, env={"USE_TORCH_XLA": "1"})[0].env["USE_TORCH_XLA"] == "1"
    xla = plan(Topology.from_facts(facts), TorchXLAConfig(device="cpu"), RDZV, "cpu", facts)
    assert "USE_TORCH_XLA" not in xla[0].env


def test_auto_device_and_refusals():
    assert resolve_device("auto", facts_for(1, 2), "native") == "neuron"
    assert resolve_device("auto", [WorkerFacts("n", "1.2.3.4", 1)], "native") == "cpu"
    many = [WorkerFacts("n", "10.0.0.1", 1, accelerator_ids={"neuron_cores": ("0", "1")})]
    with pytest.raises(XLAConfigError, match=r"2 neuron_cores per worker.*"
                       r"resources_per_worker=\{'neuron_cores': 1\} and num_workers=2"):
        native_plan(many)


@pytest.mark.parametrize("kwargs, match", [
    ({"device": "tpu"}, "TorchNeuronConfig.device='tpu' is not valid: expected one of 'auto', "
     "'neuron', 'cpu'"),
    ({"compile_cache": "s3://bucket/neff"}, "TorchNeuronConfig.compile_cache='s3://bucket/neff'"),
    ({"timeout_s": 0}, "TorchNeuronConfig.timeout_s=0"),
    ({"efa": "yes"}, "TorchNeuronConfig.efa='yes'"),
    ({"env": {"A=B": "1"}}, "TorchNeuronConfig.env="),
    ({"backend": "nccl"}, "TorchNeuronConfig.backend='nccl'.*'neuron' process group"),
])
def test_config_errors_name_field_value_and_choices(kwargs, match):
    with pytest.raises(XLAConfigError, match=match):
        TorchNeuronConfig(**kwargs)


def test_config_is_keyword_only_and_checked_again_at_start():
    with pytest.raises(TypeError):
        TorchNeuronConfig("neuron")
    config = TorchNeuronConfig(device="cpu")
    config.device = "gpu"
    with pytest.raises(XLAConfigError, match="device='gpu'"):
        config.validate()  # what the backend's on_start runs first


def test_plan_command_prints_the_native_plan(capsys):
    assert main(["plan", "--device", "neuron", "--runtime", "native", "--nodes", "2",
                 "--workers-per-node", "2", "--compile-cache", "/fsx/neff", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["env"]["NEURON_RT_VISIBLE_CORES"] for r in rows] == ["0", "1", "0", "1"]
    assert {r["env"]["NEURON_RT_ROOT_COMM_ID"] for r in rows} == {"10.0.0.1:29501"}
    assert {r["env"]["TORCH_NEURONX_NEFF_CACHE_DIR"] for r in rows} == {"/fsx/neff"}
    assert main(["plan", "--device", "neuron", "--runtime", "native", "--spmd"]) == 2
    assert "TorchNeuronConfig.spmd=True" in capsys.readouterr().err


WORKER_CHECKS = r"""
import os, sys
from ray_train_xla.startup import native_neuron as w
from ray_train_xla.errors import WorkerSetupError
os.environ.update(RANK="3", LOCAL_RANK="1", NEURON_RT_VISIBLE_CORES="0,1")
def run(step):
    try:
        step()
        print("ok")
    except WorkerSetupError as exc:
        print("error:", exc)
run(w.before_process_group)            # torch_neuronx not importable
sys.path.insert(0, sys.argv[1])
run(w.check_one_core)                  # two cores
os.environ["NEURON_RT_VISIBLE_CORES"] = "5"
run(w.before_process_group)            # fine
import torch_neuronx
torch_neuronx._lazy_init()             # something touched the runtime first
run(w.prepare_neuron_worker)
"""


def test_worker_errors_name_the_worker_and_the_fix():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", WORKER_CHECKS, os.path.join(HERE, "doubles")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 4, out.stdout
    assert lines[0].startswith("error: worker rank 3 (local rank 1, node ")
    assert "needs the native torch-neuronx" in lines[0] and "device='cpu'" in lines[0]
    assert "names 2 NeuronCores" in lines[1] and "{'neuron_cores': 1}" in lines[1]
    assert lines[2] == "ok"
    assert "already initialised" in lines[3] and "inside the training function" in lines[3]


def fake_native_neuronx(tmp_path, torch_spec):
    """An installed-looking native torch-neuronx (metadata only: no torch-xla requirement)."""
    info = tmp_path / "torch_neuronx-2.13.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-neuronx\nVersion: 2.13.0\n"
                                   f"Requires-Dist: torch{torch_spec}\n")
    return str(tmp_path)


@pytest.mark.parametrize("torch_spec, cache, status", [
    ("<2.9", "writable", "FAIL"),     # built for an older torch than any installed here
    (">=2.9", "writable", "OK"),
    (">=2.9", "/proc/neff", "FAIL"),  # the cache directory cannot be written
])
def test_doctor_checks_native_package_pin_and_cache(tmp_path, torch_spec, cache, status):
    site = fake_native_neuronx(tmp_path, torch_spec)
    cache_dir = str(tmp_path / "neff") if cache == "writable" else cache
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, os.environ.get("PYTHONPATH", "")]),
               TORCH_NEURONX_NEFF_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-m", "ray_train_xla.tools.cli", "doctor", "--no-load-check",
                          "--json"], capture_output=True, text=True, timeout=120, env=env)
    rows = {r["check"]: r for r in json.loads(out.stdout)["checks"]}
    native, neff = rows["native TorchNeuron"], rows["NEFF cache"]
    if cache == "writable":
        assert native["status"] == status, native
        assert f"torch-neuronx requires torch{torch_spec}" in native["detail"]
        assert neff["status"] == "OK" and cache_dir in neff["detail"]
    else:
        assert neff["status"] == "FAIL" and "compile_cache" in neff["fix"]
    assert rows["libneuronxla"]["status"] == "OK"  # not needed by native TorchNeuron


NATIVE_CORE = r"""
import contextlib, io, json, sys
from ray_train_xla import NeuronOptions
from ray_train_xla.tools.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    assert main(["plan", "--device", "neuron", "--runtime", "native", "--nodes", "2",
                 "--workers-per-node", "2", "--json"]) == 0
print("cores", [r["env"]["NEURON_RT_VISIBLE_CORES"] for r in json.loads(out.getvalue())])
print("loaded", sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "torch", "torch_xla")))
"""


def test_native_planning_needs_neither_ray_nor_torch():
    from test_core_imports import BLOCKED

    out = subprocess.run([sys.executable, "-c", BLOCKED + NATIVE_CORE], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "cores ['0', '1', '0', '1']" in out.stdout and "loaded []" in out.stdout
