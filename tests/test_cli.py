"""The ray-train-xla command: --help everywhere, plan output (table and JSON)."""

import json
import subprocess
import sys

import pytest

from ray_train_xla.tools.cli import build_parser, main
from ray_train_xla.tools.plan import format_plan_table


@pytest.mark.parametrize("command", [[], ["demo"], ["plan"], ["doctor"], ["consolidate"],
                                     ["goodput"], ["profile"], ["check"]])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([*command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(" ".join(["usage: ray-train-xla", *command]))
    parser = build_parser()
    if command:  # every option of the command is listed, with its help
        parser = parser.command_parsers[command[0]]
        for action in parser._actions:
            for option in action.option_strings:
                assert option in out, option
            if action.help:  # (argparse wraps lines, also after hyphens)
                assert "".join(action.help.split()) in "".join(out.split()), action.help
    else:  # the top level lists every command with its one-line help, and the exit statuses
        for name, sub in parser.command_parsers.items():
            assert name in out and sub.description
        assert "Exit status: 0 success" in " ".join(out.split())


def test_one_name_for_each_option_across_commands_and_examples():
    """The accelerators a worker asks Ray for are --accelerators-per-worker in plan, check and
    the examples; check's --device names the field of each config it can run."""
    import os

    parser = build_parser()
    options = {cmd: {o for a in sub._actions for o in a.option_strings}
               for cmd, sub in parser.command_parsers.items()}
    assert "--accelerators-per-worker" in options["plan"] & options["check"]
    assert not any("--cores-per-worker" in o for o in options.values())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "examples", "finetune_hf.py"), encoding="utf-8") as f:
        assert '"--accelerators-per-worker"' in f.read()
    device = next(a for a in parser.command_parsers["check"]._actions if "--device" in a.option_strings)
    assert all(f"{c}.device" in device.help for c in ("TorchXLAConfig", "TorchNeuronConfig",
                                                      "TorchTPUConfig"))


def test_plan_json_for_two_nodes_of_two_workers(capsys):
    assert main(["plan", "--device", "cpu", "--nodes", "2", "--workers-per-node", "2",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["local_rank"], r["node_rank"]) for r in rows] == [
        (0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    assert [r["node_ip"] for r in rows] == ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
    for r in rows:
        env = r["env"]
        assert env["WORLD_SIZE"] == "4" and env["GROUP_WORLD_SIZE"] == "2"
        assert (env["RANK"], env["LOCAL_RANK"], env["NODE_RANK"], env["LOCAL_WORLD_SIZE"]) == (
            str(r["rank"]), str(r["local_rank"]), str(r["node_rank"]), "2")
        assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29500"
        assert env["PJRT_DEVICE"] == "CPU" and r["accelerator_ids"] == []


def table_of(out: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """(variables shared by every worker, one dict per worker row) of plan's table."""
    lines = out.splitlines()
    at = lines.index("Per worker:")
    shared = dict(line.strip().split("=", 1) for line in lines[1:at])
    header, *rows = (line.split() for line in lines[at + 1:])
    return shared, [dict(zip(header, row)) for row in rows]


def test_plan_table_lists_shared_variables_once_and_the_rest_per_worker(capsys):
    assert main(["plan", "--nodes", "2", "--workers-per-node", "3,1", "--env", "X=1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 workers. Shared by every worker:\n")
    shared, workers = table_of(out)
    assert shared["X"] == "1" and shared["WORLD_SIZE"] == "4" and shared["MASTER_ADDR"] == "10.0.0.1"
    assert [(w["rank"], w["local"], w["node"]) for w in workers] == [
        ("0", "0", "0"), ("1", "1", "0"), ("2", "2", "0"), ("3", "0", "1")]
    assert [w["LOCAL_WORLD_SIZE"] for w in workers] == ["3", "3", "3", "1"]
    for w in workers:
        assert (w["RANK"], w["LOCAL_RANK"], w["NODE_RANK"]) == (w["rank"], w["local"], w["node"])
    # A variable is in one place only: shared, or a column.
    assert not set(shared) & set(workers[0])


def test_plan_says_the_peak_mfu_is_taken_against(capsys):
    """--peak-tflops is the config's field (planned for every worker); without it the last line
    gives the published peak of --accelerator-type, at the LNC that --env gives on Neuron."""
    assert main(["plan", "--device", "neuron", "--runtime", "native", "--workers-per-node", "2",
                 "--peak-tflops", "80"]) == 0
    out = capsys.readouterr().out
    assert "  RAY_TRAIN_XLA_PEAK_TFLOPS=80.0\n" in out
    assert out.splitlines()[-1] == "MFU peak: 80 TFLOP/s per device (--peak-tflops)"
    assert main(["plan", "--device", "neuron", "--accelerator-type", "trn2.48xlarge",
                 "--env", "NEURON_LOGICAL_NC_CONFIG=1"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("MFU peak: 79 TFLOP/s per device, the published bf16 peak of a "
                           "Trainium2 physical NeuronCore-v3 (LNC=1) (https://")
    assert main(["plan", "--device", "tpu", "--nodes", "4", "--workers-per-node", "4",
                 "--accelerator-type", "v6e-16"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("MFU peak: 918 TFLOP/s per device")
    assert main(["plan", "--device", "cpu", "--workers-per-node", "2"]) == 0  # measured on workers
    out = capsys.readouterr().out
    assert "MFU peak" not in out and "RAY_TRAIN_XLA_PEAK_TFLOPS" not in out
    assert main(["plan", "--peak-tflops", "inf"]) == 2
    assert "'inf' is not a positive number" in capsys.readouterr().err


def test_plan_table_format():
    # Shared variables once, sorted; the others as aligned columns, "-" where a worker has none.
    rows = [{"rank": 0, "local_rank": 0, "node_rank": 0, "env": {"B": "x", "A": "1", "C": "y"}},
            {"rank": 1, "local_rank": 0, "node_rank": 1, "env": {"A": "1", "B": "long"}}]
    assert format_plan_table(rows).splitlines() == [
        "2 workers. Shared by every worker:",
        "  A=1",
        "Per worker:",
        "  rank  local  node  B     C",
        "  0     0      0     x     y",
        "  1     0      1     long  -",
    ]


def test_plan_reports_bad_input_without_a_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "ray_train_xla.tools.cli", "plan", "--device", "neuron",
         "--accelerators-per-worker", "2", "--workers-per-node", "2"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("ray-train-xla plan: error: ")
    assert out.stderr.count("\n") == 1  # one line, no traceback
    # plan's own flags, not ScalingConfig's
    assert "--accelerators-per-worker 2 is not valid with --device neuron" in out.stderr
    assert "Use --nodes 1 --workers-per-node 4 instead" in out.stderr
    assert "num_workers" not in out.stderr and "resources_per_worker" not in out.stderr
    bad = subprocess.run([sys.executable, "-m", "ray_train_xla.tools.cli", "plan",
                          "--workers-per-node", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("ray-train-xla plan: error: ")
    assert bad.stderr.count("\n") == 1 and "every node needs at least one worker" in bad.stderr


def test_examples_ask_ray_for_each_workers_accelerators():
    """The examples' and the demo's ScalingConfig (no Ray started): NeuronCores per worker on
    Neuron; on TPU, Ray Train V2's slice fields with TPU chips per worker; Ray's own refusal of
    a slice is a usage error."""
    from ray_train_xla import TorchXLAConfig, check_scaling_config
    from ray_train_xla.tools.examples.cluster import ExampleUsageError, scaling_config

    cpu = scaling_config("cpu", 2)
    assert cpu.num_workers == 2 and not cpu.resources_per_worker and not cpu.use_tpu
    assert scaling_config("neuron", 4).resources_per_worker == {"neuron_cores": 1}
    assert scaling_config("neuron", 2, 32).resources_per_worker == {"neuron_cores": 32}
    tpu = scaling_config("tpu", 16, 1, "4x4", "TPU-V6E")
    assert (tpu.use_tpu, tpu.topology, tpu.accelerator_type, tpu.resources_per_worker) == (
        True, "4x4", "TPU-V6E", {"TPU": 1})
    assert check_scaling_config(tpu, TorchXLAConfig(device="tpu")) == (16, 16)
    spmd = scaling_config("tpu", 4, 4, "4x4", "TPU-V6E")  # one SPMD worker per host of 4 chips
    assert spmd.resources_per_worker == {"TPU": 4}
    with pytest.raises(ExampleUsageError, match="must be a multiple of 16"):
        scaling_config("tpu", 8, 1, "4x4", "TPU-V6E")
    with pytest.raises(ExampleUsageError, match="needs --tpu-topology and --accelerator-type"):
        scaling_config("tpu", 2)


def test_check_help_names_every_exit_status_it_returns(capsys):
    """check returns 0 (every step passed), 1 (a step failed) and 2 (refused before any worker
    starts: tests/test_cli_errors.py), and its --help says all three."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Exits 0 only when every step passes, 1 when one fails, 2 when the check cannot run" in text
