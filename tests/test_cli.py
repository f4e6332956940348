"""The ray-train-xla command: --help everywhere, plan output (table and JSON)."""

import json
import subprocess
import sys

import pytest

from ray_train_xla.tools.cli import build_parser, format_plan_table, main


@pytest.mark.parametrize("command", [[], ["demo"], ["plan"], ["doctor"]])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([*command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ray-train-xla")
    for word in {(): ["demo", "plan", "doctor"], ("demo",): ["--workers", "--iterations"],
                 ("plan",): ["--nodes", "--workers-per-node", "--json", "--cores-per-worker"],
                 ("doctor",): ["--cluster", "--json"]}[tuple(command)]:
        assert word in out


def test_plan_json_for_two_nodes_of_two_workers(capsys):
    assert main(["plan", "--device", "cpu", "--nodes", "2", "--workers-per-node", "2",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["local_rank"], r["node_rank"]) for r in rows] == [
        (0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    assert all(r["env"]["WORLD_SIZE"] == "4" and r["env"]["GROUP_WORLD_SIZE"] == "2"
               for r in rows)


def test_plan_table_lists_shared_variables_once_and_the_rest_per_worker(capsys):
    assert main(["plan", "--nodes", "2", "--workers-per-node", "3,1", "--env", "X=1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 workers. Shared by every worker:")
    assert "  X=1\n" in out and "  WORLD_SIZE=4\n" in out
    header = next(line for line in out.splitlines() if line.strip().startswith("rank"))
    assert "LOCAL_WORLD_SIZE" in header and "RANK" in header
    assert format_plan_table([{"rank": 0, "local_rank": 0, "node_rank": 0, "env": {"A": "1"}}])


def test_plan_reports_bad_input_without_a_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "ray_train_xla.tools.cli", "plan", "--device", "neuron",
         "--cores-per-worker", "2", "--workers-per-node", "2"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "num_workers=4" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "ray_train_xla.tools.cli", "plan",
                          "--workers-per-node", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "every node needs at least one worker" in bad.stderr
