"""`ray-train-xla doctor`: the CLI in a subprocess, on this machine and against a real Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ray_train_xla.tools import doctor


def start_doctor(*args: str, env: dict | None = None) -> subprocess.Popen:
    """Start the CLI as a user would."""
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("PJRT_DEVICE", "NEURON_RT_VISIBLE_CORES", "XLA_PERSISTENT_CACHE_PATH")}
    full_env.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "ray_train_xla.tools.cli", "doctor", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env)


def fake_dist(site, name: str, version: str) -> dict:
    """The environment of a CLI that sees ``name`` installed at ``version``: a metadata-only
    dist-info in ``site``, put first on PYTHONPATH (so it shadows the real one; nothing is
    imported from it as long as the load check is off)."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH"))
                                          if p)}


def finish(proc: subprocess.Popen, timeout: float = 240):
    """(exit code, stdout, stderr) of a started CLI."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def run_doctor(*args: str, env: dict | None = None, timeout: float = 240):
    """Run the CLI as a user would; return (exit code, stdout, stderr)."""
    return finish(start_doctor(*args, env=env), timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every local run of the CLI below, started together (each pays its own imports)."""
    tmp = tmp_path_factory.mktemp("doctor")
    not_a_dir = tmp / "file"
    not_a_dir.write_text("")
    procs = {
        "table": start_doctor(),
        "mismatch": start_doctor("--no-load-check",
                                 env=fake_dist(tmp / "site", "torch_xla", "2.8.0")),
        "bad-env": start_doctor(
            "--no-load-check", "--json",
            env={"NEURON_RT_VISIBLE_CORES": "0-1",
                 "XLA_PERSISTENT_CACHE_PATH": str(not_a_dir / "c"), "PJRT_DEVICE": "CPU"}),
        "new-cache": start_doctor("--no-load-check", "--json",
                                  env={"XLA_PERSISTENT_CACHE_PATH": str(tmp / "a" / "b")}),
        "json": start_doctor("--no-load-check", "--json"),
        # A torch no config supports, and one only the native configs do.
        "torch-2.7": start_doctor("--no-load-check", "--json",
                                  env=fake_dist(tmp / "site27", "torch", "2.7.0")),
        "torch-2.14": start_doctor("--no-load-check", "--json",
                                   env=fake_dist(tmp / "site214", "torch", "2.14.1")),
        "unreachable": start_doctor("--no-load-check", "--cluster", "127.0.0.1:1",
                                    "--timeout", "3"),
    }
    try:
        return {name: finish(proc) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()


def rows_of(stdout: str) -> dict[str, list[str]]:
    """Table lines by check name (the first column), fix lines attached to the row above."""
    out: dict[str, list[str]] = {}
    last = None
    for line in stdout.splitlines():
        if line.lstrip().startswith("fix: ") and last:
            out[last].append(line.strip())
            continue
        for name in sorted(CHECK_NAMES, key=len, reverse=True):
            if line.startswith(name + " "):
                last = name
                out.setdefault(name, []).append(line)
                break
    return out


CHECK_NAMES = ("python", "torch/torch_xla", "torch_xla loads", "torch-neuronx", "libneuronxla", "device",
               "neuron devices", "NEURON_RT_VISIBLE_CORES", "EFA", "TPU chips", "compile cache",
               "free ports", "CPU collectives")


def test_table_on_this_machine(runs):
    code, out, err = runs["table"]
    assert code == 0, out + err
    assert out.splitlines()[0].split()[:4] == ["check", "node", "status", "detail"]
    rows = rows_of(out)
    assert set(CHECK_NAMES) <= set(rows), out
    assert " OK " in rows["torch/torch_xla"][0]
    assert " OK " in rows["torch_xla loads"][0] and "import torch_xla works" in out
    for name in ("neuron devices", "torch-neuronx", "libneuronxla", "EFA"):
        assert " FAIL " not in rows[name][0], rows[name]
    assert "not present" in rows["neuron devices"][0]
    assert "device='auto' -> cpu" in rows["device"][0]
    assert "xm collectives" in rows["CPU collectives"][0]
    assert "xr.world_size()/global_ordinal() are Ray's" in rows["CPU collectives"][0]
    assert "0 FAIL" in out.splitlines()[-1]


def test_a_torch_outside_every_configs_range_fails_and_the_range_is_named(runs):
    """The configs' torch ranges (planning/versions.py): 2.7 is in none; 2.14 serves the native
    configs only; the installed torch is reported with the configs it serves."""
    rows = {}
    for name in ("torch-2.7", "torch-2.14", "json"):
        code, out, _ = runs[name]
        rows[name] = {r["check"]: r for r in json.loads(out)["checks"]}["torch"]
    old, native, here = rows["torch-2.7"], rows["torch-2.14"], rows["json"]
    assert old["status"] == "FAIL" and "torch 2.7.0: no config supports it" in old["detail"], old
    assert "TorchXLAConfig 2.9; TorchNeuronConfig 2.9-2.14; TorchTPUConfig 2.9-2.14" in old["detail"]
    assert "torch-xla 2.9.0 for TorchXLAConfig" in old["fix"]
    assert native["status"] == "OK", native
    assert native["detail"].startswith("torch 2.14.1: TorchNeuronConfig, TorchTPUConfig ("), native
    import torch

    assert here["status"] == "OK" and here["detail"].startswith(f"torch {torch.__version__.split('+')[0]}")


def test_forced_mismatch_fails_with_fix(runs):
    code, out, _ = runs["mismatch"]
    assert code == 1, out
    row = rows_of(out)["torch/torch_xla"]
    assert " FAIL " in row[0] and "torch_xla 2.8.0" in row[0]
    assert row[1].startswith("fix: ") and "torch==2.8.*" in row[1] and "torch-xla==2.9.*" in row[1]


def test_warnings_and_failures_from_the_environment(runs):
    # NEURON_RT_VISIBLE_CORES=0-1, a cache path under a file, PJRT_DEVICE=CPU.
    code, out, _ = runs["bad-env"]
    report = json.loads(out)
    by_check = {r["check"]: r for r in report["checks"]}
    assert code == 1 and report["ok"] is False
    assert by_check["NEURON_RT_VISIBLE_CORES"]["status"] == "WARN"
    assert by_check["NEURON_RT_VISIBLE_CORES"]["fix"]
    assert by_check["compile cache"]["status"] == "FAIL" and by_check["compile cache"]["fix"]
    assert "PJRT_DEVICE=CPU" in by_check["device"]["detail"]
    # A writable, not yet existing cache path is fine.
    code, out, _ = runs["new-cache"]
    cache = next(r for r in json.loads(out)["checks"] if r["check"] == "compile cache")
    assert code == 0 and cache["status"] == "OK" and "does not exist yet" in cache["detail"]


def test_json_fields(runs):
    code, out, _ = runs["json"]
    report = json.loads(out)
    assert code == 0 and report["ok"] is True
    assert report["checks"]
    for row in report["checks"]:
        assert set(row) == {"check", "node", "status", "detail", "fix"}
        assert row["status"] in ("OK", "WARN", "FAIL")
        assert row["node"] == "driver"
        assert bool(row["fix"]) == (row["status"] != "OK")


def test_pairing_rules():
    # torch_xla declares no torch pin: major.minor equality decides.
    ok, how = doctor.pairing("torch_xla", "2.9.0", "2.9.1+cpu")
    assert ok and "pairs with torch 2.9.x" in how
    assert not doctor.pairing("torch_xla", "2.9.0", "2.10.0")[0]


def test_cluster_unreachable_is_a_bounded_fail(runs):
    code, out, _ = runs["unreachable"]  # --cluster 127.0.0.1:1 --timeout 3
    assert code == 1
    row = rows_of_cluster(out)["ray cluster"]
    assert " FAIL " in row[0] and row[1].startswith("fix: ")


def rows_of_cluster(stdout: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    last = None
    for line in stdout.splitlines():
        if line.lstrip().startswith("fix: ") and last:
            out[last].append(line.strip())
        elif line.startswith("ray cluster "):
            last = "ray cluster"
            out[last] = [line]
        else:
            last = None
    return out


@pytest.fixture(scope="module")
def two_node_cluster():
    """Two Ray nodes on this machine; the second advertises 2 neuron_cores it does not have."""
    from ray.cluster_utils import Cluster

    cluster = Cluster()
    try:
        cluster.add_node(num_cpus=1, include_dashboard=False)
        cluster.add_node(num_cpus=1, resources={"neuron_cores": 2}, include_dashboard=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


@pytest.mark.ray
def test_cluster_one_row_set_per_node(two_node_cluster):
    code, out, err = run_doctor("--cluster", two_node_cluster.address, "--json",
                                "--timeout", "150", timeout=400)
    assert out.startswith("{"), err[-3000:]
    report = json.loads(out)
    checks = report["checks"]
    nodes = {r["node"] for r in checks} - {"driver", "cluster"}
    assert len(nodes) == 2, checks
    by_node = {n: {r["check"]: r for r in checks if r["node"] == n} for n in nodes}
    for rows in by_node.values():
        assert {"torch/torch_xla", "torch_xla loads", "device", "neuron devices", "EFA",
                "TPU chips", "compile cache", "same as driver"} <= set(rows)
        assert rows["torch/torch_xla"]["status"] == "OK"
        assert rows["torch_xla loads"]["status"] == "OK"
        assert rows["same as driver"]["status"] == "OK"
    neuron = next(n for n in nodes if "neuron_cores=2" in by_node[n]["neuron devices"]["detail"])
    plain = next(n for n in nodes if n != neuron)
    # The node that advertises NeuronCores without devices is flagged; auto resolves per node.
    assert by_node[neuron]["neuron devices"]["status"] == "FAIL"
    assert by_node[neuron]["neuron devices"]["fix"]
    assert "-> neuron" in by_node[neuron]["device"]["detail"]
    assert by_node[neuron]["torch-neuronx"]["status"] == "FAIL"
    assert by_node[neuron]["EFA"]["status"] == "WARN"  # a Neuron node of several, without EFA
    assert "neuron-compile-cache" in by_node[neuron]["compile cache"]["detail"]
    assert by_node[plain]["neuron devices"]["status"] == "OK"
    assert "-> cpu" in by_node[plain]["device"]["detail"]
    # Ports are checked once, on the head.
    assert [n for n in nodes if "free ports" in by_node[n]] == [n for n in nodes if "(head)" in n]
    assert any(r["check"] == "CPU collectives" for r in checks)
    assert code == 1 and report["ok"] is False, err


def test_device_files_are_counted(tmp_path):
    for name in ("neuron0", "neuron1", "neuron_monitor", "accel0", "accel1"):
        (tmp_path / name).write_text("")
    (tmp_path / "vfio").mkdir()
    assert [os.path.basename(p) for p in doctor.neuron_devices(str(tmp_path))] == [
        "neuron0", "neuron1"]
    assert len(doctor.tpu_chips(str(tmp_path))) == 2
    for name in ("accel0", "accel1"):
        (tmp_path / name).unlink()
    for name in ("0", "1", "2", "vfio"):
        (tmp_path / "vfio" / name).write_text("")
    assert [os.path.basename(p) for p in doctor.tpu_chips(str(tmp_path))] == ["0", "1", "2"]


def test_tpu_devices_per_chip_from_the_pci_bus(tmp_path, monkeypatch):
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    for n, (vendor, device) in enumerate([("0x8086", "0x0076"), ("0x1ae0", "0x006f")]):
        (tmp_path / str(n)).mkdir()
        (tmp_path / str(n) / "vendor").write_text(vendor + "\n")
        (tmp_path / str(n) / "device").write_text(device + "\n")
    assert doctor.tpu_devices_per_chip(str(tmp_path)) == 1  # v6e; 0x0076 of another vendor
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "tpu7x-32")
    assert doctor.tpu_devices_per_chip(str(tmp_path)) == 2
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE")
    (tmp_path / "1" / "device").write_text("0x0076\n")  # TPU v7
    assert doctor.tpu_devices_per_chip(str(tmp_path)) == 2


def test_help_names_the_options(capsys):
    from ray_train_xla.tools.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["doctor", "--help"])
    text = capsys.readouterr().out
    for option in ("--cluster [ADDRESS]", "--timeout SECONDS", "--json", "--no-load-check"):
        assert option in text
    assert build_parser().parse_args(["doctor", "--cluster"]).cluster == "auto"
    assert build_parser().parse_args(["doctor"]).cluster is None


def test_check_node_runs_the_table_in_order(monkeypatch):
    """check_node runs every function of NODE_CHECKS in order, on shared facts, and keeps a fix
    only on a non-OK row: adding a check is adding a function and a row of the table."""
    seen = []

    def first(ctx, facts):
        seen.append(("first", facts.versions["torch"]))
        return [("first", doctor.OK, "fine", "ignored fix"), ("second", doctor.WARN, "hm", "do x")]

    def last(ctx, facts):
        seen.append(("last", facts.versions["torch"]))
        return [("last", doctor.FAIL, "bad", "do y")]

    monkeypatch.setattr(doctor, "NODE_CHECKS", (first, last))
    rows = doctor.check_node(doctor.NodeContext(node="n1"))
    assert seen == [("first", doctor.installed_version("torch"))] + [
        ("last", doctor.installed_version("torch"))]
    assert rows == [doctor.Check("first", "n1", "OK", "fine", ""),
                    doctor.Check("second", "n1", "WARN", "hm", "do x"),
                    doctor.Check("last", "n1", "FAIL", "bad", "do y")]


def _facts(**versions):
    base = {"torch": "2.14.1", "torch_xla": None, "torch-neuronx": None, "libneuronxla": None}
    torch_tpu = versions.pop("torch_tpu", None)
    native = versions.pop("native_neuronx", False)
    return doctor.NodeFacts(versions={**base, **versions}, torch_tpu=torch_tpu,
                            native_neuronx=native, nc_devices=(), chips=(), ray_cores=None,
                            ray_tpus=None)


@pytest.mark.parametrize("facts, python, status, words", [
    # Native TorchNeuron (Neuron SDK 2.34) has wheels for Python 3.12 to 3.14 only.
    (dict(native_neuronx=True, **{"torch-neuronx": "2.14.3.1"}), "3.11.7", "FAIL",
     ["native TorchNeuron", "3.12 to 3.14", "not 3.11.7"]),
    (dict(native_neuronx=True, **{"torch-neuronx": "2.14.3.1"}), "3.12.1", "OK", ["3.12-3.14"]),
    # The XLA SDK's torch-neuronx 2.9: 3.10 to 3.12.
    (dict(torch="2.9.0", torch_xla="2.9.0", **{"torch-neuronx": "2.9.0.2.11"}), "3.13.0", "FAIL",
     ["Trainium XLA SDK", "3.10 to 3.12"]),
    (dict(torch_tpu="0.2.0"), "3.10.14", "FAIL", ["native TorchTPU", "3.11 to 3.14"]),
    (dict(torch_tpu="0.2.0"), "3.14.0", "OK", ["native TorchTPU"]),
    (dict(torch="2.9.0", torch_xla="2.9.0"), "3.14.0", "FAIL", ["torch_xla", "3.10 to 3.13"]),
    ({}, "3.14.0", "OK", ["no device stack"]),
    ({}, "3.9.18", "FAIL", ["older than 3.10"]),
])
def test_python_is_checked_against_the_stack_the_node_has(facts, python, status, words):
    """doctor's python row: the node's Python against the stack its packages make
    (planning/versions.py STACKS), with a fix on a failure."""
    [(name, got, detail, fix)] = doctor.check_python(doctor.NodeContext(node="n"), _facts(**facts),
                                                     python=python)
    assert name == "python" and got == status, detail
    for word in words:
        assert word in detail, detail
    assert bool(fix) == (status == "FAIL")
