"""The benchmark still runs: ``benchmarks/run.py --quick`` once, its outputs checked (no timings
asserted: the numbers are measurements, not contracts)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = {"startup_1w_ours", "startup_1w_ray_xla", "throughput", "throughput_mp_loader",
           "recompile", "grad_sync_step",
           "grad_sync_comm"}


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def test_quick_benchmark_writes_every_figure(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=540, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["figure"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == FIGURES
    for name, r in rows.items():
        if name == "startup_1w_ray_xla":  # quick mode never runs Ray's config (it pkills)
            assert "pkill" in r["error"] and r["a_median"] is None and is_number(r["b_median"])
            continue
        assert is_number(r["a_median"]) and is_number(r["b_median"]), r
        assert is_number(r["ratio"]) and r["ratio"] > 0, r
    assert rows["recompile"]["a_after_warmup"] >= 0 and rows["recompile"]["b_after_warmup"] >= 0
    assert set(rows["grad_sync_step"]["split"]) == {"bucketed", "per_param"}
    # One summary line per figure, ending with its ratio.
    summary = [line for line in proc.stdout.splitlines() if line.split(":")[0] in FIGURES]
    assert len(summary) == len(FIGURES) and all("ratio" in line for line in summary)
    table = (out / "results.md").read_text()
    assert all(f"| {name} |" in table for name in FIGURES)
    png = (out / "ratios.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
