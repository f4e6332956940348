"""Every error a user can cause is one line on stderr and a non-zero exit, never a traceback:
2 for usage and configuration errors, 1 for a command that ran and failed."""

import json
import os
import subprocess
import sys

import pytest

import ray_train_xla
from ray_train_xla.tools.cli import main


def one_error_line(capsys, argv, code):
    """Run ``ray-train-xla argv`` in this process; the single line it printed on stderr."""
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ray-train-xla") and ": error: " in lines[0], lines[0]
    return lines[0]


def run_cli(*args, timeout=120):
    """Run the command in a fresh interpreter, as a user would."""
    return subprocess.run([sys.executable, "-m", "ray_train_xla.tools.cli", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, AWS_EC2_METADATA_DISABLED="true"))


def assert_one_line(proc, code):
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


# ---- usage and configuration errors: exit 2 ----

@pytest.mark.parametrize("argv, words", [
    # argument types are named in words, not by their function's name
    (["plan", "--nodes", "abc"], ["--nodes", "'abc' is not a positive integer"]),
    (["plan", "--nodes", "0"], ["'0' is not a positive integer"]),
    (["demo", "--workers", "0"], ["ray-train-xla demo: error:", "--workers", "positive integer"]),
    (["doctor", "--timeout", "abc"], ["--timeout", "'abc' is not a positive number of seconds"]),
    (["doctor", "--timeout", "inf"], ["'inf' is not a positive number of seconds"]),
    (["consolidate", "a", "b", "--timeout", "-1"], ["'-1' is not a positive number of seconds"]),
    # ports are range-checked, including the one the Neuron runtimes derive (MASTER_PORT + 1)
    (["plan", "--master-port", "-5"], ["--master-port", "'-5' is not a port number (1 to 65535)"]),
    (["plan", "--master-port", "70000"], ["'70000' is not a port number"]),
    (["plan", "--device", "neuron", "--master-port", "65535"], ["must be at most 65534"]),
    (["plan", "--device", "neuron", "--runtime", "native", "--master-port", "-5"],
     ["not a port number"]),
    (["plan", "--device", "neuron", "--runtime", "native", "--master-port", "65535"],
     ["must be at most 65534"]),
    # a per-node list that contradicts --nodes
    (["plan", "--workers-per-node", "4,2", "--nodes", "3"],
     ["--workers-per-node 4,2 lists 2 nodes but --nodes is 3"]),
    (["plan", "--workers-per-node", "0"], ["every node needs at least one worker"]),
    # planned variables are refused, naming the variable and what sets it
    (["plan", "--env", "WORLD_SIZE=7", "--env", "RAY_TRAIN_XLA_PG_BACKEND=nccl"],
     ["TorchXLAConfig.env['WORLD_SIZE']", "ScalingConfig"]),
    (["plan", "--env", "RAY_TRAIN_XLA_PG_BACKEND=nccl"],
     ["RAY_TRAIN_XLA_PG_BACKEND", "set by the config itself"]),
    (["plan", "--runtime", "native", "--device", "neuron", "--env", "MASTER_PORT=1"],
     ["TorchNeuronConfig.env['MASTER_PORT']"]),
    (["plan", "--env", "FOO"], ["--env", "expected KEY=VALUE, got 'FOO'"]),
    # choices and combinations
    (["plan", "--device", "gpu"], ["--device", "invalid choice: 'gpu'"]),
    (["plan", "--runtime", "native", "--spmd"], ["TorchNeuronConfig.spmd=True"]),
    (["plan", "--runtime", "xrt", "--device", "tpu"], ["TorchXLAConfig.runtime='xrt'"]),
    (["plan", "--device", "neuron", "--cpu-devices-per-worker", "2"],
     ["cpu_devices_per_worker=2"]),
    (["plan", "--device", "tpu", "--workers-per-node", "2", "--spmd"],
     ["has 2 workers", "--spmd is not valid", "--workers-per-node 1 --accelerators-per-worker"]),
    # the backend's refusals, in plan's own flags: the flag that is wrong, then the fix
    (["plan", "--device", "tpu", "--accelerators-per-worker", "2"],
     ["--accelerators-per-worker 2 is not valid with --device tpu",
      "use --accelerators-per-worker 1, or --spmd"]),
    (["plan", "--device", "neuron", "--accelerators-per-worker", "2"],
     ["--accelerators-per-worker 2 is not valid with --device neuron",
      "Use --nodes 1 --workers-per-node 2 instead"]),
    (["plan", "--device", "neuron", "--runtime", "native", "--accelerators-per-worker", "4"],
     ["--accelerators-per-worker 4 is not valid with --device neuron --runtime native"]),
    (["plan", "--device", "tpu", "--workers-per-node", "4,2"],
     ["--workers-per-node 4,2 is not valid with --device tpu"]),
    (["plan", "--device", "tpu", "--nodes", "8", "--accelerators-per-worker", "4", "--spmd",
      "--tpu-process-bounds", "1,1,4"], ["--tpu-process-bounds 1,1,4 is not valid"]),
    (["plan", "--device", "tpu", "--accelerator-type", "tpu7x-32", "--nodes", "4",
      "--workers-per-node", "4"], ["Use --nodes 4 --workers-per-node 8"]),
    (["plan", "--device", "neuron", "--accelerator-type", "trn2.48xlarge",
      "--workers-per-node", "200"], ["--workers-per-node 200 is not valid", "at most "
                                      "--workers-per-node 64"]),
    (["plan", "--device", "tpu", "--accelerator-type", "v9z-16"],
     ["--accelerator-type v9z-16 is not valid", "not of a generation this package knows"]),
    (["plan", "--device", "neuron", "--accelerator-type", "trn9"],
     ["'trn9' is not a Trainium instance this package knows"]),
    # demo: every flag goes with a mode, refused before Ray starts
    (["demo", "--train", "--sharded"], ["--sharded: not allowed with argument --train"]),
    (["demo", "--steps", "5"], ["--steps goes with --train or --sharded, not the seed check"]),
    (["demo", "--storage-path", "x"], ["--storage-path goes with --train or --sharded"]),
    (["demo", "--train", "--iterations", "3"], ["--iterations does not go with --train"]),
    (["demo", "--train", "--devices", "2"], ["--devices does not go with --train", "--sharded"]),
    (["demo", "--sharded", "--iterations", "3"], ["--iterations does not go with --sharded"]),
    (["demo", "--sharded", "--workers", "2"], ["--workers 2 with --device cpu", "one worker"]),
    (["demo", "--tpu-topology", "2x2"], ["--tpu-topology describes a TPU slice", "--device tpu"]),
    (["demo", "--train", "--config", "neuron", "--device", "neuron", "--accelerator-type",
      "TPU-V6E"], ["--accelerator-type describes a TPU slice"]),
    (["demo", "--config", "tpu", "--device", "tpu", "--workers", "4"],
     ["--device tpu with 4 workers needs --tpu-topology and --accelerator-type"]),
    (["demo", "--sharded", "--config", "xla", "--device", "tpu", "--workers", "2",
      "--tpu-topology", "4x4"], ["needs --tpu-topology and --accelerator-type"]),
    # demo --config: an accelerator needs its stack named; a config runs on its own devices
    (["demo", "--device", "neuron"], ["--device neuron: give the stack", "--config xla",
                                      "--config neuron (native TorchNeuron"]),
    (["demo", "--device", "tpu"], ["--config xla (torch_xla) or --config tpu"]),
    (["demo", "--config", "tpu", "--device", "neuron"],
     ["--config tpu (TorchTPUConfig) runs on --device cpu or tpu, not neuron"]),
    (["demo", "--sharded", "--config", "neuron", "--devices", "2"],
     ["--devices goes with --sharded under --config xla", "give --workers"]),
    # sizes that would exhaust memory
    (["plan", "--nodes", "99999999999"], ["99999999999 workers", "at most 100000"]),
    (["plan", "--workers-per-node", "99999999999,1"], ["at most 100000"]),
    (["plan", "--device", "neuron", "--accelerators-per-worker", "99999999"], ["at most 1000000"]),
    # check: refused before Ray starts (check --help says so: exit status 2)
    (["check", "--config", "neuron", "--device", "tpu"], ["--config neuron runs on --device"]),
    (["check", "--device", "tpu", "--workers", "2"], ["--device tpu with 2 workers needs --tpu-topology"]),
    (["check", "--max-bytes", "4"], ["--max-bytes", "at least 8 bytes"]),
    # unknown commands and options name the parser they belong to
    (["doctor", "--bogus"], ["ray-train-xla doctor: error: unrecognized arguments: --bogus"]),
    (["bogus"], ["ray-train-xla: error:", "invalid choice: 'bogus'"]),
    (["consolidate", "only-one"], ["required: OUT"]),
])
def test_usage_and_configuration_errors_are_one_line_exit_2(capsys, argv, words):
    line = one_error_line(capsys, argv, 2)
    for word in words:
        assert word in line, line
    assert "_positive" not in line and "_port" not in line  # no internal names


def test_plan_refusals_name_plans_flags_not_the_apis(capsys):
    """What the backend would refuse, plan refuses in its own flags: never ScalingConfig's
    fields, and never blamed on the device when the workers or the slice are wrong."""
    for argv in (["--device", "tpu", "--accelerators-per-worker", "2"],
                 ["--device", "tpu", "--workers-per-node", "2", "--spmd"],
                 ["--device", "tpu", "--workers-per-node", "3"],
                 ["--device", "tpu", "--workers-per-node", "4,2"],
                 ["--device", "tpu", "--nodes", "8", "--accelerators-per-worker", "4", "--spmd"],
                 ["--device", "tpu", "--accelerator-type", "v6e-16", "--nodes", "2"],
                 ["--device", "tpu", "--runtime", "native", "--accelerator-type", "tpu7x-32",
                  "--nodes", "4", "--workers-per-node", "4"],
                 ["--device", "tpu", "--runtime", "native", "--workers-per-node", "3"],
                 ["--device", "neuron", "--accelerators-per-worker", "2"],
                 ["--device", "neuron", "--runtime", "native", "--accelerators-per-worker", "2"]):
        line = one_error_line(capsys, ["plan", *argv], 2)
        for api in ("num_workers", "resources_per_worker", "ScalingConfig", "device='tpu'",
                    "device='neuron'", "spmd=True", "tpu_process_bounds"):
            assert api not in line, (argv, line)


def test_plan_help_says_what_accelerator_type_does_on_each_runtime(capsys):
    assert main(["plan", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    help_text = text.split("--accelerator-type TYPE", 1)[1].split(" --tpu-process-bounds", 1)[0]
    for words in ("TPU (both runtimes)", "gives that type's standard topology (v6e-16: 4x4, 4 "
                  "hosts of 4 chips)", "the hosts and workers per host must fill the slice",
                  "an unknown type or a size that is not a slice of its generation is refused",
                  "Neuron (every runtime)", "trn2.48xlarge", "checked against its logical "
                  "NeuronCores at NEURON_LOGICAL_NC_CONFIG"):
        assert words in help_text, (words, help_text)


def test_a_workers_per_node_list_gives_the_number_of_nodes(capsys):
    assert main(["plan", "--workers-per-node", "4,2", "--json"]) == 0
    inferred = json.loads(capsys.readouterr().out)
    assert [r["node_rank"] for r in inferred] == [0, 0, 0, 0, 1, 1]
    assert {r["env"]["WORLD_SIZE"] for r in inferred} == {"6"}
    assert main(["plan", "--workers-per-node", "4,2", "--nodes", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == inferred


def test_ports_at_the_top_of_the_range(capsys):
    # CPU takes no port after MASTER_PORT; Neuron takes MASTER_PORT + 1.
    assert main(["plan", "--master-port", "65535", "--json"]) == 0
    assert {r["env"]["MASTER_PORT"] for r in json.loads(capsys.readouterr().out)} == {"65535"}
    assert main(["plan", "--device", "neuron", "--master-port", "65534", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["env"]["NEURON_RT_ROOT_COMM_ID"] for r in rows} == {"10.0.0.1:65535"}


def test_version_and_bare_command(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"ray-train-xla {ray_train_xla.__version__}\n"
    # Without a command: the full help on stdout, exit 0.
    assert main([]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("usage: ray-train-xla") and captured.err == ""
    for word in ("demo", "plan", "doctor", "consolidate", "--version", "Exit status"):
        assert word in captured.out
    assert main(["plan", "--help"]) == 0 and "--master-port PORT" in capsys.readouterr().out


def test_end_to_end_in_a_fresh_interpreter():
    line = assert_one_line(run_cli("plan", "--device", "neuron", "--runtime", "native",
                                   "--master-port", "-5"), 2)
    assert line.startswith("ray-train-xla plan: error: argument --master-port")
    bare = run_cli()
    assert bare.returncode == 0 and bare.stdout.startswith("usage: ray-train-xla")
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout == f"ray-train-xla {ray_train_xla.__version__}\n"


# ---- consolidate ----

@pytest.fixture
def replicated(tmp_path):
    import torch

    path = tmp_path / "replicated"
    path.mkdir()
    torch.save({"model": {"_orig_module.w": torch.ones(2, 3)}, "step": 3}, path / "checkpoint.pt")
    return path


def test_consolidate_a_missing_checkpoint(capsys, tmp_path):
    missing = tmp_path / "nonexistent"
    line = one_error_line(capsys, ["consolidate", str(missing), str(tmp_path / "out.safetensors")], 2)
    assert line == f"ray-train-xla consolidate: error: checkpoint {missing} does not exist"
    assert not (tmp_path / "out.safetensors").exists()
    line = one_error_line(capsys, ["consolidate", f"file://{missing}", str(tmp_path / "o")], 2)
    assert f"file://{missing} does not exist" in line


def test_consolidate_a_directory_that_is_not_a_checkpoint(capsys, tmp_path, replicated):
    other = tmp_path / "other"
    other.mkdir()
    for i in range(12):
        (other / f"file{i:02}.txt").write_text("")
    line = one_error_line(capsys, ["consolidate", str(other), str(tmp_path / "out.safetensors")], 2)
    assert "is neither a sharded checkpoint (no .metadata) nor a replicated one" in line
    assert "found file00.txt, file01.txt" in line and "and 4 more" in line
    assert "file11.txt" not in line  # shortened
    line = one_error_line(capsys, ["consolidate", str(replicated / "checkpoint.pt"),
                                   str(tmp_path / "out.safetensors")], 2)
    assert "is a file: name the checkpoint's directory" in line


def test_consolidate_a_checkpoint_without_a_model(capsys, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "no-model"
    path.mkdir()
    torch.save({"optimizer": {}}, path / "checkpoint.pt")
    line = one_error_line(capsys, ["consolidate", str(path), str(tmp_path / "out.safetensors")], 2)
    assert f"checkpoint {path} has no 'model' entry" in line
    sharded = tmp_path / "sharded-no-model"
    dcp.save({"optimizer": {"x": torch.zeros(4)}}, checkpoint_id=str(sharded), no_dist=True)
    line = one_error_line(capsys, ["consolidate", str(sharded), str(tmp_path / "out.safetensors")], 2)
    assert "has no 'model' entry" in line
    module = tmp_path / "module"
    module.mkdir()
    torch.save({"model": torch.nn.Linear(2, 2)}, module / "checkpoint.pt")
    line = one_error_line(capsys, ["consolidate", str(module), str(tmp_path / "out.safetensors")], 2)
    assert "'model' entry is a Linear, not a state dict" in line


def test_consolidate_a_corrupt_checkpoint(capsys, tmp_path):
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "corrupt"
    path.mkdir()
    (path / "checkpoint.pt").write_bytes(b"not a torch file")
    line = one_error_line(capsys, ["consolidate", str(path), str(tmp_path / "out.safetensors")], 1)
    assert f"cannot read checkpoint {path}: UnpicklingError" in line
    sharded = tmp_path / "sharded"
    dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=str(sharded), no_dist=True)
    shutil.copytree(sharded, tmp_path / "bad-shards")
    for name in os.listdir(tmp_path / "bad-shards"):
        if name.endswith(".distcp"):
            (tmp_path / "bad-shards" / name).write_bytes(b"xx")
    line = one_error_line(capsys, ["consolidate", str(tmp_path / "bad-shards"),
                                   str(tmp_path / "out.safetensors")], 1)
    assert "cannot read checkpoint" in line
    assert not (tmp_path / "out.safetensors").exists()
    # The intact sharded checkpoint consolidates.
    assert main(["consolidate", str(sharded), str(tmp_path / "out.safetensors"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sharded"] is True


def test_consolidate_to_an_output_that_cannot_be_written(capsys, tmp_path, replicated):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    out = a_file / "out.safetensors"  # its directory would have to replace a file
    line = one_error_line(capsys, ["consolidate", str(replicated), str(out)], 1)
    assert line.startswith(f"ray-train-xla consolidate: error: cannot write OUT {out}: "
                           f"cannot create directory")
    line = one_error_line(capsys, ["consolidate", str(replicated), str(tmp_path / "t.safetensors"),
                                   "--torch", str(out)], 1)
    assert f"cannot write --torch file {out}" in line
    assert not (tmp_path / "t.safetensors").exists()  # nothing written when one output fails
    line = one_error_line(capsys, ["consolidate", str(replicated), str(tmp_path)], 2)
    assert f"OUT {tmp_path} is a directory" in line
    same = str(tmp_path / "same")
    line = one_error_line(capsys, ["consolidate", str(replicated), same, "--torch", same], 2)
    assert f"--torch file {same} is OUT" in line
    if os.path.isdir("/proc/self"):  # a directory no file can be created in, even by root
        line = one_error_line(capsys, ["consolidate", str(replicated), "/proc/x.safetensors"], 1)
        assert "cannot write OUT /proc/x.safetensors: cannot create a file in /proc" in line
    assert sorted(os.listdir(tmp_path)) == ["a-file", "replicated"]  # no temporary file left


def test_consolidate_writes_its_outputs(capsys, tmp_path, replicated):
    from safetensors.torch import load_file

    out, pt = tmp_path / "sub" / "out.safetensors", tmp_path / "out.pt"
    assert main(["consolidate", str(replicated), str(out), "--torch", str(pt), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tensors"] == 1 and summary["parameters"] == 6 and summary["sharded"] is False
    assert list(load_file(str(out))) == ["w"]
    assert sorted(os.listdir(tmp_path / "sub")) == ["out.safetensors"]  # no temporary file left
    assert pt.exists()


def test_consolidate_from_unreachable_storage_is_one_line_and_bounded(tmp_path):
    out = str(tmp_path / "out.safetensors")
    # memory:// is not a scheme Ray Train's Checkpoint (pyarrow) knows: a usage error.
    line = assert_one_line(run_cli("consolidate", "memory:///ckpt", out), 2)
    assert "Unrecognized filesystem type in URI: memory:///ckpt" in line
    # Without a network, s3:// fails as it resolves the bucket's region, and gs:// retries for
    # many minutes: --timeout bounds the first answer. With a network, both fail on the bucket.
    for uri in ("s3://nonexistent-bucket-xyz/ckpt", "gs://nonexistent-bucket-xyz/ckpt"):
        proc = run_cli("consolidate", uri, out, "--timeout", "2", timeout=90)
        assert proc.returncode in (1, 2), proc.stderr
        line = assert_one_line(proc, proc.returncode)
        assert line.startswith("ray-train-xla consolidate: error: ") and uri in line
    assert os.listdir(tmp_path) == []


# ---- demo: a failed run is one line ----

def test_a_failed_demo_run_is_one_line(capsys):
    from ray.exceptions import RayTaskError
    from ray.train import ControllerError, WorkerGroupError

    from ray_train_xla.errors import WorkerSetupError
    from ray_train_xla.tools.demo import _run_job

    cause = WorkerSetupError("worker rank 0: init_process_group failed: ModuleNotFoundError: x")
    remote = RayTaskError("init_process_group", "Traceback (most recent call last):\n  File "
                          "\"w.py\", line 1, in f\nWorkerSetupError: worker rank 0: ...", cause)
    for failure in (ControllerError(remote.as_instanceof_cause()),
                    WorkerGroupError("rank 0 failed:\nTraceback ...", {1: ValueError("later"),
                                                                       0: remote})):
        def job(failure=failure):
            raise failure

        assert _run_job("banner", job) is None
        captured = capsys.readouterr()
        assert captured.err == ("FAILED: WorkerSetupError: worker rank 0: init_process_group "
                                "failed: ModuleNotFoundError: x\n")
