"""``ray-train-xla plan --tp/--dp-replicate/--dp-shard``: the config's parallelism as plan sees it,
RAY_TRAIN_XLA_LAYOUT and each worker's coordinates in the layout (under SPMD, its devices'
ranks), and the refusals in plan's own flags. Pure: no Ray, no torch."""

from __future__ import annotations

import json

import pytest

from ray_train_xla.planning.contract import LAYOUT_VAR
from ray_train_xla.planning.layout import Layout
from ray_train_xla.tools.cli import main

NEURON = ["plan", "--device", "neuron", "--runtime", "native", "--nodes", "2",
          "--workers-per-node", "4"]


def _rows(capsys, args) -> list[dict]:
    assert main(args + ["--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("args,layout", [
    (NEURON + ["--tp", "2", "--dp-replicate", "2"], Layout(2, 2, 2)),
    (NEURON + ["--tp", "4"], Layout(1, 2, 4)),
    (NEURON + ["--dp-replicate", "2", "--dp-shard", "4"], Layout(2, 4, 1)),
    # TorchTPUConfig numbers ranks its own way: coordinates follow each worker's planned RANK.
    (["plan", "--device", "tpu", "--runtime", "native", "--accelerator-type", "v6e-16",
      "--nodes", "4", "--workers-per-node", "4", "--tp", "4"], Layout(1, 4, 4)),
])
def test_each_worker_gets_its_coordinates_from_its_rank(args, layout, capsys):
    rows = _rows(capsys, args)
    assert {r["env"][LAYOUT_VAR] for r in rows} == {layout.to_text()}
    for r in rows:
        rank = int(r["env"]["RANK"])
        assert r["layout"] == {**layout.coordinates(rank), "dp_rank": layout.dp_rank(rank)}
    # Every tensor-parallel group is on one node.
    by_rank = {int(r["env"]["RANK"]): r["node_rank"] for r in rows}
    for r in rows:
        assert {by_rank[peer] for peer in layout.group(int(r["env"]["RANK"]), "tp")} == \
            {r["node_rank"]}
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"  {LAYOUT_VAR}={layout.to_text()}" in out  # shared by every worker
    assert f"Layout: {layout.describe()} ({LAYOUT_VAR}; each worker's coordinates" in out
    lines = out.splitlines()
    header = lines[lines.index("Per worker:") + 1].split()
    assert header[:7] == ["rank", "local", "node", "dp_replicate", "dp_shard", "tp", "dp_rank"]
    for line, r in zip(lines[lines.index("Per worker:") + 2:], rows):
        cells = dict(zip(header, line.split()))
        assert {k: int(cells[k]) for k in r["layout"]} == r["layout"]


def test_without_a_layout_nothing_changes(capsys):
    rows = _rows(capsys, NEURON)
    assert all("layout" not in r and LAYOUT_VAR not in r["env"] for r in rows)
    assert main(NEURON) == 0
    assert "Layout:" not in capsys.readouterr().out


def test_an_spmd_worker_holds_a_range_of_the_layouts_devices(capsys):
    args = ["plan", "--device", "tpu", "--accelerator-type", "v6e-16", "--nodes", "4", "--spmd",
            "--accelerators-per-worker", "4", "--tp", "4"]
    rows = _rows(capsys, args)
    assert [r["layout"] for r in rows] == [{"first_device": 4 * i, "devices": 4}
                                          for i in range(4)]
    assert {r["env"][LAYOUT_VAR] for r in rows} == {"dp_replicate=1,dp_shard=4,tp=4"}
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Layout: FSDP 4 x TP 4 (RAY_TRAIN_XLA_LAYOUT; each worker holds several devices" in out
    lines = out.splitlines()
    header = lines[lines.index("Per worker:") + 1].split()
    assert header[:4] == ["rank", "local", "node", "devices"]
    assert [line.split()[3] for line in lines[lines.index("Per worker:") + 2:][:4]] == \
        ["0-3", "4-7", "8-11", "12-15"]


@pytest.mark.parametrize("args,says", [
    # A tensor-parallel group across nodes.
    (NEURON + ["--tp", "8"], ["error: the layout: --tp 8 puts ranks 0 to 7 in one "
                              "tensor-parallel group across 2 nodes", "Use --tp among [1, 2, 4]",
                              "a multiple of --tp (--workers-per-node"]),
    # Sizes that do not divide the devices.
    (NEURON + ["--tp", "3"], ["--dp-replicate 1 --dp-shard -1 --tp 3 needs a multiple of 3 "
                              "devices, but the job has 8", "(--tp among [1, 2, 4, 8])"]),
    (NEURON + ["--tp", "2", "--dp-shard", "2"], ["makes 4 devices, but the job has 8: leave "
                                                 "--dp-shard -1"]),
    # TorchXLAConfig takes a layout only under SPMD.
    (["plan", "--device", "neuron", "--workers-per-node", "4", "--tp", "2"],
     ["the layout (--tp, --dp-replicate) is not valid with TorchXLAConfig: expected it only "
      "with --spmd", "pass --spmd, or use --runtime "
      "native"]),
])
def test_bad_layouts_are_refused_in_plans_flags(args, says, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    for word in says:
        assert word in err, err
    for api in ("ScalingConfig", "spmd=True", "parallelism=", "tp="):
        assert api not in err, err
