"""``ray-train-xla check``'s figures and report: pure functions, no Ray, no torch.

:func:`bus_bandwidth` follows nccl-tests' definitions (``doc/PERFORMANCE.md`` of
NVIDIA/nccl-tests): ``algbw = size / time``, where size is the whole buffer (all_gather's
output, reduce_scatter's input), and ``busbw = algbw x factor``, the factor being ``2(n-1)/n``
for all_reduce and ``(n-1)/n`` for all_gather and reduce_scatter, so that busbw compares with
the hardware's link bandwidth (:data:`PUBLISHED`, with sources) whatever the number of ranks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

GB = 1e9  # bandwidths in GB/s (10^9 bytes), as nccl-tests prints them

BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def bus_bandwidth(op: str, size_bytes: int, seconds: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of ``op`` moving ``size_bytes`` over ``ranks`` ranks in
    ``seconds``, as nccl-tests defines them."""
    if seconds <= 0:
        return float("inf"), float("inf")
    algbw = size_bytes / seconds / GB
    return algbw, algbw * BUS_FACTORS[op](ranks)


@dataclass(frozen=True)
class Published:
    """One published interconnect figure: ``gb_s`` is what busbw compares with (GB/s, one
    direction); ``as_published`` the figure as its source gives it."""

    kind: str  # "instance" (EC2 instance type prefixes) or "tpu" (TPU accelerator type prefixes)
    prefixes: tuple[str, ...]
    scope: str  # "within a node" or "across nodes"
    gb_s: float
    as_published: str
    source: str


_TRN1 = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trn1-arch.html"
_TRN2 = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trn2-arch.html"
_GIB = 1.073741824
# Longest prefix first (trn1n before trn1). TPU ICI figures are published as bidirectional
# totals per chip: busbw compares with half. Within one TPU slice hosts talk over ICI too.
PUBLISHED: tuple[Published, ...] = (
    Published("instance", ("trn1n.",), "within a node", 768 * _GIB,
              "NeuronLink-v2 768 GiB/s per device", _TRN1),
    Published("instance", ("trn1n.",), "across nodes", 1600 / 8, "EFA 1,600 Gbps per instance",
              _TRN1),
    Published("instance", ("trn1.",), "within a node", 384 * _GIB,
              "NeuronLink-v2 384 GiB/s per device", _TRN1),
    Published("instance", ("trn1.",), "across nodes", 800 / 8, "EFA 800 Gbps per instance", _TRN1),
    Published("instance", ("trn2",), "within a node", 1024,
              "NeuronLink-v3 1,024 GB/s per chip within an instance", _TRN2),
    Published("instance", ("trn2",), "across nodes", 3200 / 8, "EFAv3 3,200 Gbps per instance",
              _TRN2),
    Published("tpu", ("v5litepod", "v5e"), "any", 400 / 2, "ICI 400 GBps per chip, bidirectional",
              "https://docs.cloud.google.com/tpu/docs/v5e"),
    Published("tpu", ("v5p",), "any", 1200 / 2, "ICI 1,200 GBps per chip, bidirectional",
              "https://docs.cloud.google.com/tpu/docs/v5p"),
    Published("tpu", ("v6e",), "any", 800 / 2, "ICI 800 GBps per chip, bidirectional",
              "https://docs.cloud.google.com/tpu/docs/v6e"),
    Published("tpu", ("tpu7x", "v7x"), "any", 1200 / 2, "ICI 1,200 GB/s per chip, bidirectional",
              "https://docs.cloud.google.com/tpu/docs/tpu7x"),
)


def published_for(instance_type: str, tpu_type: str, scope: str) -> Published | None:
    """The figure busbw of ``scope`` compares with on this hardware; None when unknown (the CPU,
    TPU v4, whose per-chip figure Google does not publish, an instance type not listed)."""
    # Ray reports a TPU host's type as "TPU-V6E", GKE and plan as "v6e-16".
    tpu_type = tpu_type.lower().removeprefix("tpu-")
    for p in PUBLISHED:
        name = instance_type.lower() if p.kind == "instance" else tpu_type
        if name and name.startswith(p.prefixes) and p.scope in (scope, "any"):
            return p
    return None


# ---- world -----------------------------------------------------------------------------------

def _without_ports(value: str) -> str:
    return ",".join(part.rsplit(":", 1)[0] for part in value.split(","))


def _own_core(planned: str, have: Mapping[str, str]) -> str | None:
    """torch_xla's Neuron start-up (``remap_visible_cores``, at ``import torch_xla``) narrows
    the node's ``NEURON_RT_VISIBLE_CORES`` to the worker's own core, the one at its local rank
    (tests/test_accelerator_contracts.py runs it on the plans)."""
    cores = planned.split(",")
    local = have.get("LOCAL_RANK", "")
    if len(cores) > 1 and local.isdigit() and int(local) < len(cores):
        return cores[int(local)]
    return None


def compare_world(observed: Sequence[Mapping[str, str]],
                  planned: Sequence[Mapping[str, str]]) -> list[str]:
    """Every difference between what each worker has (``observed``, rank order) and the plan
    (``planned``), one line each: a variable with another value, or missing."""
    problems = []
    if len(observed) != len(planned):
        problems.append(f"{len(observed)} workers answered, the plan has {len(planned)}")
    for rank, (have, want) in enumerate(zip(observed, planned)):
        for key in sorted(want):
            got, value = have.get(key), want[key]
            if key == "TORCH_TPU_SLICEBUILDER_ADDRESSES" and got is not None:
                got, value = _without_ports(got), _without_ports(value)  # ports: free at start
            if got is None:
                problems.append(f"rank {rank}: {key} is not set; the plan says {value!r}")
            elif got != value and not (key == "NEURON_RT_VISIBLE_CORES"
                                       and got == _own_core(value, have)):
                problems.append(f"rank {rank}: {key}={got!r}; the plan says {value!r}")
    return problems


# ---- the report ------------------------------------------------------------------------------

STATUS = {True: "PASS", False: "FAIL", None: "NOT RUN"}


def to_table(result: Mapping[str, Any]) -> str:
    """The terminal table: one row per step."""
    rows = [("step", "status", "seconds", "what was found")] + [
        (step["name"], STATUS[step.get("ok")],
         "" if step.get("seconds") is None else f"{step['seconds']:.1f}", step.get("summary", ""))
        for step in result["steps"]]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    verdict = "PASS: every step passed" if result["ok"] else \
        f"FAIL: {', '.join(s['name'] for s in result['steps'] if s.get('ok') is not True)}"
    return "\n".join(lines + ["", verdict])


def to_markdown(result: Mapping[str, Any]) -> str:
    """``report.md``: versions, topology, every step with its figures, the planned environment,
    and the log tail of each failing worker."""
    lines = [f"# ray-train-xla check: {'PASS' if result['ok'] else 'FAIL'}", "",
             f"- config: `{result['config']}`, device `{result['device']}`, "
             f"{result['workers']} workers on {result['nodes']} node(s)",
             f"- started {result['started']}, {result['seconds']:.1f} s in all", ""]
    lines += ["## Versions", "", "| package | driver | workers |", "|---|---|---|"]
    worker_versions = result.get("worker_versions") or {}
    for name in sorted(set(result["versions"]) | set(worker_versions)):
        lines.append(f"| {name} | {result['versions'].get(name, '-')} | "
                     f"{worker_versions.get(name, '-')} |")
    lines += ["", "## Steps", "", "```", to_table(result), "```", ""]
    for step in result["steps"]:
        lines += [f"### {step['name']}: {STATUS[step.get('ok')]}", "", step.get("summary", ""), ""]
        lines += [f"- {p}" for p in step.get("failures", [])]
        if step["name"] == "world" and step.get("workers"):
            lines += ["", "| rank | local | node | device | hostname |", "|---|---|---|---|---|"]
            lines += [f"| {w['rank']} | {w['local_rank']} | {w['node_rank']} | {w['device']} | "
                      f"{w['hostname']} |" for w in step["workers"]]
        if step["name"] == "compute" and step.get("rows"):
            lines += ["", f"| rank | {step['dtype']} matmul TFLOP/s | peak TFLOP/s | share |",
                      "|---:|---:|---:|---:|"]
            lines += [f"| {r['rank']} | {r['tflops']:.4g} | "
                      + (f"{r['peak_tflops']:.4g} | {100 * r['share']:.1f}% |" if r["share"]
                         is not None else "- | - |") for r in step["rows"]]
        if step["name"] == "bandwidth" and step.get("rows"):
            lines += [f"- {c}" for c in step.get("comparisons", [])]
            lines += ["", "| scope | op | bytes | ranks | time (us) | algbw (GB/s) | busbw (GB/s) |",
                      "|---|---|---:|---:|---:|---:|---:|"]
            lines += [f"| {r['scope']} | {r['op']} | {r['bytes']} | {r['ranks']} | "
                      f"{r['seconds'] * 1e6:.1f} | {r['algbw']:.4g} | {r['busbw']:.4g} |"
                      for r in step["rows"]]
        lines.append("")
    if result.get("planned_env"):
        lines += ["## Planned environment", "", "```"]
        for rank, env in enumerate(result["planned_env"]):
            lines.append(f"# rank {rank}")
            lines += [f"{k}={v}" for k, v in sorted(env.items())]
        lines += ["```", ""]
    for failed in result.get("failing_workers", []):
        lines += [f"## Log of rank {failed['rank']} ({failed['step']})", "",
                  f"{failed['error']}", "", "```", failed.get("log_tail") or "(no log)", "```", ""]
    return "\n".join(lines)


def write_report(result: Mapping[str, Any], out_dir: str) -> dict[str, str]:
    """``report.json``, ``report.md`` and (with matplotlib) ``bandwidth.png`` under ``out_dir``;
    returns {kind: path} of what was written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "report.json"), "md": os.path.join(out_dir, "report.md")}
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(paths["md"], "w") as f:
        f.write(to_markdown(result))
    rows = next((s.get("rows") for s in result["steps"] if s["name"] == "bandwidth"), None)
    if rows:
        try:
            paths["png"] = draw_bandwidth(rows, os.path.join(out_dir, "bandwidth.png"))
        except ImportError:
            pass
    return paths


def draw_bandwidth(rows: Sequence[Mapping[str, Any]], path: str) -> str:
    """busbw against size, one line per collective (and scope); log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scope in dict.fromkeys(r["scope"] for r in rows):
        for op in dict.fromkeys(r["op"] for r in rows):
            points = [(r["bytes"], r["busbw"]) for r in rows if r["scope"] == scope and r["op"] == op]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=f"{op} ({scope})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title("ray-train-xla check: collective bus bandwidth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
