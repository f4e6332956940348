"""Neuron planning, and the planned environment fed to torch_xla's own Neuron init."""

import json
import os
import subprocess
import sys

import pytest

from ray_train_xla import TorchXLAConfig, XLAConfigError
from ray_train_xla.planning import Rendezvous, plan
from ray_train_xla.planning.topology import Topology, WorkerFacts, described_facts
from ray_train_xla.startup.neuron_compile import DEFAULT_CACHE_URL, explicit_cache_dir, resolve_cache_url

HERE = os.path.dirname(os.path.abspath(__file__))
RDZV = Rendezvous(master_addr="10.0.0.1", master_port=29500, run_id="r", extra_ports=(29611,))


def neuron_facts(cores_per_node, **kw):
    """Facts for nodes whose workers got the given Ray core ids (one list per node)."""
    facts = []
    for n, cores in enumerate(cores_per_node):
        for local, core in enumerate(cores):
            facts.append(WorkerFacts(node_id=f"n{n}", node_ip=f"10.0.0.{n + 1}", pid=100 + local,
                                     accelerator_ids={"neuron_cores": (str(core),)}, **kw))
    return facts


def neuron_plan(facts, **config):
    topo = Topology.from_facts(facts, "neuron_cores")
    return plan(topo, TorchXLAConfig(device="neuron", **config), RDZV, "neuron", facts)


TOPOLOGIES = {
    "1x2": [[0, 1]],
    "1x32": [list(range(32))],
    "2x4": [[0, 1, 2, 3], [0, 1, 2, 3]],
    # 2 x trn1.32xlarge, 32 workers with one neuron_cores each (the public Llama-2 example)
    "2x32": [list(range(32)), list(range(32))],
    "non-contiguous": [[5, 2, 7], [3, 0]],
}


def run_torch_xla_neuron_init(envs):
    """torch_xla's configure_pjrt_environment() on each env, each in a fresh forked process."""
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "contracts", "neuron_configure.py")],
        input=json.dumps(envs), capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


# The single-core env Ray Train V2 gives a worker of a 2-worker node, without our node list.
RAY_ONLY_ENV = dict(neuron_plan(neuron_facts([[0, 1]]))[1].env, NEURON_RT_VISIBLE_CORES="1")


@pytest.fixture(scope="module")
def contract_results():
    """All topologies through one runner (torch_xla is imported once, then forked per worker)."""
    plans = {name: neuron_plan(neuron_facts(cores)) for name, cores in TOPOLOGIES.items()}
    envs = [p.env for name in TOPOLOGIES for p in plans[name]] + [RAY_ONLY_ENV]
    results = run_torch_xla_neuron_init(envs)
    by_name, i = {}, 0
    for name in TOPOLOGIES:
        by_name[name] = (plans[name], results[i:i + len(plans[name])])
        i += len(plans[name])
    by_name["ray-only"] = results[-1]
    return by_name


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_torch_xla_neuron_init_accepts_the_plan(name, contract_results):
    plans, results = contract_results[name]
    assigned = [str(c) for node in TOPOLOGIES[name] for c in node]
    assert len(results) == len(plans) == len(assigned)
    for p, res, core in zip(plans, results, assigned):
        assert res["ok"], (p.place, res)
        env = res["env"]
        assert env["NEURON_RT_VISIBLE_CORES"] == core  # exactly the core Ray assigned
        assert env["NEURON_PJRT_PROCESS_INDEX"] == p.env["RANK"]
        assert env["PJRT_LOCAL_PROCESS_RANK"] == p.env["LOCAL_RANK"]
        assert env["NEURON_PJRT_WORLD_SIZE"] == str(len(assigned))
    assert {r["env"]["NEURON_RT_ROOT_COMM_ID"] for r in results} == {"10.0.0.1:29611"}


def test_ray_v2_alone_breaks_torch_xla_neuron_init(contract_results):
    # The failure the node-local list fixes: one core visible, LOCAL_WORLD_SIZE=2.
    res = contract_results["ray-only"]
    assert not res["ok"] and "is not equal to count 1" in res["error"]


def test_node_local_core_lists_and_root_comm_port():
    plans = neuron_plan(neuron_facts([[5, 2, 7], [3, 0]]))
    assert [p.env["NEURON_RT_VISIBLE_CORES"] for p in plans] == ["5,2,7"] * 3 + ["3,0"] * 2
    for p in plans:
        assert p.env["PJRT_DEVICE"] == "NEURON"
        assert p.env["NEURON_RT_ROOT_COMM_ID"] == "10.0.0.1:29611"
        assert p.env["NEURON_RT_ROOT_COMM_ID"] != f"10.0.0.1:{p.env['MASTER_PORT']}"
        assert "62182" not in p.env["NEURON_RT_ROOT_COMM_ID"]
        assert p.env["TORCHELASTIC_RUN_ID"] == "r"
        assert p.env["RAY_TRAIN_XLA_PG_BACKEND"] == "xla"
        assert p.env["RAY_TRAIN_XLA_INIT_METHOD"] == "xla://"


def test_ipv6_master_is_bracketed():
    topo = Topology.from_facts(neuron_facts([[0]]), "neuron_cores")
    rdzv = Rendezvous(master_addr="fd00::2", master_port=1, run_id="r", extra_ports=(2,))
    (p,) = plan(topo, TorchXLAConfig(device="neuron"), rdzv, "neuron")
    assert p.env["NEURON_RT_ROOT_COMM_ID"] == "[fd00::2]:2"


@pytest.mark.parametrize(
    "efa,has_efa,expected",
    [(None, True, True), (None, False, False), (True, False, True), (False, True, False)],
)
def test_efa_variables_only_where_wanted(efa, has_efa, expected):
    (p,) = neuron_plan(neuron_facts([[0]], has_efa=has_efa), efa=efa)
    efa_vars = {k: p.env.get(k) for k in ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA",
                                          "FI_EFA_FORK_SAFE")}
    if expected:
        assert efa_vars == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1",
                            "FI_EFA_FORK_SAFE": "1"}
    else:
        assert set(efa_vars.values()) == {None}


def test_socket_interface_is_detected_unless_the_user_set_it():
    (p,) = neuron_plan(neuron_facts([[0]], network_interface="ens5"))
    assert p.env["CCOM_SOCKET_IFNAME"] == p.env["NCCL_SOCKET_IFNAME"] == "ens5"
    (p,) = neuron_plan(neuron_facts([[0]], network_interface="ens5",
                                    preset_env={"CCOM_SOCKET_IFNAME": "eth0"}))
    assert "CCOM_SOCKET_IFNAME" not in p.env  # the worker keeps its own eth0
    assert p.env["NCCL_SOCKET_IFNAME"] == "ens5"
    (p,) = neuron_plan(neuron_facts([[0]]))
    assert "CCOM_SOCKET_IFNAME" not in p.env


def test_compile_cache_and_parallel_compile_variables():
    (p,) = neuron_plan(neuron_facts([[0]]), compile_cache="s3://bucket/cache",
                       neuron_parallel_compile=True)
    assert p.env["NEURON_COMPILE_CACHE_URL"] == "s3://bucket/cache"
    assert (p.env["NEURON_EXTRACT_GRAPHS_ONLY"], p.env["NEURON_PARALLEL_COMPILE"],
            p.env["NEURON_FALL_BACK_TO_NULL_NEFF"]) == ("1", "1", "1")
    (q,) = neuron_plan(neuron_facts([[0]]))
    assert "NEURON_EXTRACT_GRAPHS_ONLY" not in q.env and "NEURON_COMPILE_CACHE_URL" not in q.env


def test_several_cores_per_worker_are_rejected_with_the_fix():
    facts = [WorkerFacts(node_id="n", node_ip="10.0.0.1", pid=i,
                         accelerator_ids={"neuron_cores": (str(2 * i), str(2 * i + 1))})
             for i in range(2)]
    with pytest.raises(XLAConfigError) as info:
        neuron_plan(facts)
    message = str(info.value)
    assert "2 neuron_cores per worker" in message
    assert "resources_per_worker={'neuron_cores': 1} and num_workers=4" in message


def test_workers_without_cores_among_workers_with_cores_are_rejected():
    facts = neuron_facts([[0]]) + [WorkerFacts(node_id="n0", node_ip="10.0.0.1", pid=9)]
    with pytest.raises(XLAConfigError, match=r"workers \[1\] were given no neuron_cores"):
        neuron_plan(facts)


def test_without_ray_cores_local_ranks_are_used():
    facts = described_facts([2])  # no accelerator ids
    topo = Topology.from_facts(facts)
    plans = plan(topo, TorchXLAConfig(device="neuron"), RDZV, "neuron", facts)
    assert [p.env["NEURON_RT_VISIBLE_CORES"] for p in plans] == ["0,1", "0,1"]


def test_xrt_plan_is_torchrun_contract_with_integer_strings():
    facts = neuron_facts([[0, 1], [0, 1]])
    plans = plan(Topology.from_facts(facts, "neuron_cores"),
                 TorchXLAConfig(device="neuron", runtime="xrt"), RDZV, "neuron", facts)
    for p in plans:
        env = p.env
        assert "PJRT_DEVICE" not in env  # XRT, not PJRT
        assert env["GROUP_WORLD_SIZE"] == "2" and env["WORLD_SIZE"] == "4"
        assert env["TORCHELASTIC_RUN_ID"] == "r"
        assert env["NEURON_RT_VISIBLE_CORES"] == "0,1"
        assert env["RAY_TRAIN_XLA_PG_BACKEND"] == "xla"
        assert env["RAY_TRAIN_XLA_INIT_METHOD"] == "env://"
    assert [p.env["GROUP_RANK"] for p in plans] == ["0", "0", "1", "1"]


def test_cache_url_precedence():
    assert explicit_cache_dir("--retry_failed_compilation --cache_dir=/fsx/c -O1") == "/fsx/c"
    assert explicit_cache_dir("--cache_dir /fsx/d") == "/fsx/d"
    assert resolve_cache_url({"NEURON_CC_FLAGS": "--cache_dir=/a",
                              "NEURON_COMPILE_CACHE_URL": "s3://b"}) == "/a"
    assert resolve_cache_url({"NEURON_COMPILE_CACHE_URL": "s3://b"}) == "s3://b"
    assert resolve_cache_url({}) == DEFAULT_CACHE_URL


def test_plan_cli_describes_neuron_topologies():
    import contextlib
    import io

    from ray_train_xla.tools.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", "--device", "neuron", "--nodes", "2", "--workers-per-node", "4",
                     "--accelerators-per-worker", "1", "--json"]) == 0
    rows = json.loads(buf.getvalue())
    assert len(rows) == 8
    assert [r["node_rank"] for r in rows] == [0] * 4 + [1] * 4
    assert {r["env"]["NEURON_RT_VISIBLE_CORES"] for r in rows} == {"0,1,2,3"}


def test_spmd_gives_one_worker_per_node_all_its_cores():
    facts = [WorkerFacts(node_id=f"n{n}", node_ip=f"10.0.0.{n + 1}", pid=1,
                         accelerator_ids={"neuron_cores": tuple(str(i) for i in range(4))})
             for n in range(2)]
    plans = neuron_plan(facts, spmd=True)
    for p in plans:
        assert p.env["NEURON_RT_VISIBLE_CORES"] == "0,1,2,3"
        assert p.env["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == "4,4"
        assert p.env["NEURON_PJRT_PROCESS_INDEX"] == p.env["RANK"]
        assert p.env["RAY_TRAIN_XLA_SPMD"] == "1"
        assert "NEURON_PJRT_WORLD_SIZE" not in p.env
    with pytest.raises(XLAConfigError, match="one worker per node"):
        neuron_plan(neuron_facts([[0, 1]]), spmd=True)


def test_trn1_llama_example_needs_no_hand_set_runtime_variables():
    # What that example set by hand is planned; only model-level variables remain the user's.
    plans = neuron_plan(neuron_facts([list(range(32))] * 2, has_efa=True,
                                     network_interface="eth0"))
    for p in plans:
        env = p.env
        assert env["NEURON_PJRT_WORLD_SIZE"] == "64"
        assert env["PJRT_LOCAL_PROCESS_COUNT"] == "32"
        assert env["CCOM_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth0"
        assert env["FI_PROVIDER"] == "efa"
        assert env["GROUP_RANK"] == str(p.place.node_rank)  # not the world size
        assert env["GROUP_WORLD_SIZE"] == "2"  # not "2.0"
        assert env["NEURON_RT_VISIBLE_CORES"] == ",".join(str(i) for i in range(32))


def plan_cli(capsys, *args):
    """``ray-train-xla plan --device neuron ARGS``: (exit status, stdout, stderr)."""
    from ray_train_xla.tools.cli import main

    code = main(["plan", "--device", "neuron", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("runtime", ["pjrt", "native", "xrt"])
def test_workers_per_node_are_checked_against_the_trainium_instance(capsys, runtime):
    """A trn2.48xlarge has 64 logical NeuronCores at LNC=2 (the default) and 128 at LNC=1:
    200 workers on one are refused on every runtime, naming plan's flags and the limit."""
    base = ["--runtime", runtime, "--nodes", "2", "--accelerator-type"]
    code, out, err = plan_cli(capsys, *base, "trn2.48xlarge", "--workers-per-node", "64", "--json")
    assert code == 0 and len(json.loads(out)) == 128, err
    code, _, err = plan_cli(capsys, *base, "trn2.48xlarge", "--workers-per-node", "200")
    assert code == 2
    assert ("--workers-per-node 200 is not valid with --accelerator-type trn2.48xlarge: a "
            "trn2.48xlarge node has 64 NeuronCores at NEURON_LOGICAL_NC_CONFIG=2 (16 Trainium2 x "
            "8 NeuronCore-v3 / 2)") in err
    assert "at most --workers-per-node 64 (128 at NEURON_LOGICAL_NC_CONFIG=1, set with --env)" in err
    assert "num_workers" not in err
    code, _, err = plan_cli(capsys, *base, "trn2.48xlarge", "--workers-per-node", "128",
                            "--env", "NEURON_LOGICAL_NC_CONFIG=1")
    assert code == 0, err
    for instance, fits in (("trn1.32xlarge", 32), ("trn1.2xlarge", 2), ("trn2.3xlarge", 4),
                           ("trn2", 64), ("trn3", 64)):
        assert plan_cli(capsys, *base, instance, "--workers-per-node", str(fits))[0] == 0
        code, _, err = plan_cli(capsys, *base, instance, "--workers-per-node", str(fits + 1))
        assert code == 2 and f"at most --workers-per-node {fits}" in err, err


def test_a_node_of_several_cores_per_worker_and_spmd_is_checked_too(capsys):
    code, _, err = plan_cli(capsys, "--accelerator-type", "trn1.32xlarge", "--workers-per-node",
                            "8", "--accelerators-per-worker", "8", "--spmd")
    assert code == 2 and "--spmd" in err  # several workers with --spmd: the runtime's refusal
    code, _, err = plan_cli(capsys, "--accelerator-type", "trn2.48xlarge", "--spmd",
                            "--accelerators-per-worker", "65")
    assert code == 2
    assert "--accelerators-per-worker 65 is not valid with --accelerator-type trn2.48xlarge" in err
    assert "at most --accelerators-per-worker 64" in err
    assert plan_cli(capsys, "--accelerator-type", "trn2.48xlarge", "--spmd",
                    "--accelerators-per-worker", "64")[0] == 0


@pytest.mark.parametrize("args, words", [
    (["--accelerator-type", "trn9"], ["'trn9' is not a Trainium instance this package knows",
                                      "trn1.2xlarge", "trn2.3xlarge", "trn2u.48xlarge", "trn3"]),
    (["--accelerator-type", "trn2.5xlarge"], ["'trn2.5xlarge' is not a Trainium instance"]),
    (["--accelerator-type", "inf2.48xlarge"], ["is not a Trainium instance"]),
    (["--accelerator-type", "trn1.32xlarge", "--env", "NEURON_LOGICAL_NC_CONFIG=2"],
     ["NEURON_LOGICAL_NC_CONFIG='2' is not valid on Trainium (trn1.32xlarge): expected 1"]),
    (["--accelerator-type", "v6e-16"], ["--accelerator-type describes a TPU slice"]),
])
def test_unknown_instances_and_lnc_values_are_refused(capsys, args, words):
    code, _, err = plan_cli(capsys, *args)
    assert code == 2
    for word in words:
        assert word in err, err
