"""What a sharded checkpoint costs the training loop: the save call, and the loop's time.

One process with 2 cores and one training thread (``torch.set_num_threads(1)``: the writer has
a core, as on real hosts), FSDP2 over a one-rank gloo group, about 190 MB of shards and AdamW
state; ``save_checkpoint``'s files written by the worker's background reporter into a local
temporary directory (the report itself is a no-op here: this measures the loop's side, not
Ray's). From the second save on, measured side by side in one run:

- **blocking snapshot** (``configure_reports(overlap_snapshots=False)``): the call's time
  against a plain copy of the same tensors into buffers allocated once (``copy_``), and
  against a synchronous ``torch.distributed.checkpoint.save`` of the same state to local disk;
- **overlapped** (the default): blocks of ``--every`` steps with a save half-way through, each
  ended once its write did, against blocks without and a control (two blocks without), in
  triples of every order; the extra time per save (the median difference, with its bootstrap
  interval) over ``dcp.save``'s time;
- **the loop**: with a save every ``--loop-every-s`` seconds (10) against none, its speed ratio
  (blocks of that many seconds with one save, triples as above).

    python benchmarks/bench_stall.py               # writes results/stall.{json,md}
    python benchmarks/bench_stall.py --markdown    # stall.md again from stall.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from figures import add_output_arguments, interval, write  # noqa: E402

MB = 1e6


def build(width: int, layers: int):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    fully_shard(model)
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-4)
    return model, opt


def measure(args) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ray_train_xla as rtx
    from ray_train_xla.toolkit import reporting
    from ray_train_xla.toolkit.checkpoint.staging import pool, snapshots

    torch.set_num_threads(1)
    # As in a Ray worker (Ray sets it from num_cpus): the writer process starts with it.
    os.environ["OMP_NUM_THREADS"] = "1"
    root = tempfile.mkdtemp(prefix="bench-stall-")
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
    reporting._ray_report = lambda metrics, directory, name=None: None  # no Ray here
    width = 1024
    layers = max(1, round(args.state_mb * MB / (3 * 4 * (width * width + width))))
    model, opt = build(width, layers)
    x = torch.randn(args.batch, width)

    def step():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    def state():
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 0}

    for _ in range(2):
        step()
    tensors = [t.to_local() for t in [*model.parameters(),
                                      *(v for s in opt.state.values() for v in s.values()
                                        if isinstance(v, torch.Tensor) and v.dim())]]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    buffers = [torch.empty_like(t) for t in tensors]
    out: dict = {"state_mb": state_bytes / MB}
    try:
        # -- blocking: the call, a plain copy, dcp.save
        reporting.configure_reports(max_in_flight=2, overlap_snapshots=False)
        rtx.save_checkpoint(state(), wait=True)  # the first save allocates the buffers
        rtx.save_checkpoint(state(), wait=True)
        calls, copies, saves = [], [], []
        for i in range(args.reps):
            t = time.perf_counter()
            for b, src in zip(buffers, tensors):
                b.copy_(src)
            copies.append(time.perf_counter() - t)
            s = state()  # the loop's own state dicts, built before the call
            t = time.perf_counter()
            rtx.save_checkpoint(s)
            calls.append(time.perf_counter() - t)
            reporting.flush_reports()
            d = os.path.join(root, f"dcp{i}")
            t = time.perf_counter()
            dcp.save(state(), storage_writer=dcp.FileSystemWriter(d))
            saves.append(time.perf_counter() - t)
            shutil.rmtree(d, ignore_errors=True)
        out["blocking"] = {"call_s": statistics.median(calls), "copy_s": statistics.median(copies),
                           "dcp_save_s": statistics.median(saves),
                           "runs": {"call": calls, "copy": copies, "dcp_save": saves}}
        out["blocking"]["call_over_copy"] = out["blocking"]["call_s"] / out["blocking"]["copy_s"]
        print("blocking", {k: v for k, v in out["blocking"].items() if k != "runs"}, flush=True)

        # -- overlapped: blocks of `every` steps with a save half-way through against blocks
        # without, each ended once its write did (the write counts)
        reporting.configure_reports(max_in_flight=2, overlap_snapshots=True)
        allocated = pool().allocated_bytes

        def block(saves: bool, steps: int) -> float:
            t = time.perf_counter()
            for i in range(1, steps + 1):
                step()
                if saves and i == steps // 2:
                    rtx.save_checkpoint(state())
            reporting.flush_reports()
            return time.perf_counter() - t

        def triples(steps: int, count: int) -> list[tuple[float, float, float]]:
            """(no save, a save, no save again: the control, what the same difference measures
            with nothing to find) blocks of ``steps``, ``count`` times, in each of the six
            orders alike."""
            orders = list(itertools.permutations(("plain", "saved", "control")))
            runs = []
            for rep in range(count):
                times = {kind: block(kind == "saved", steps)
                         for kind in orders[rep % len(orders)]}
                runs.append((times["plain"], times["saved"], times["control"]))
            return runs

        block(True, args.every)  # warm: the buffers of overlapped saves
        runs = triples(args.every, args.triples)
        extra = [s - p for p, s, _ in runs]
        control = [c - p for p, _, c in runs]
        dcp_s = out["blocking"]["dcp_save_s"]
        out["overlapped"] = {
            "every": args.every, "step_s": statistics.median(p for p, _, _ in runs) / args.every,
            "extra_per_save_s": statistics.median(extra), "extra_interval_s": interval(extra),
            "extra_over_dcp_save": statistics.median(extra) / dcp_s,
            "control_per_save_s": statistics.median(control),
            "control_interval_s": interval(control),
            "optimizer_waits": snapshots().waits,
            "allocated_mb_after_warmup": (pool().allocated_bytes - allocated) / MB,
            "runs": runs}
        print("overlapped", {k: v for k, v in out["overlapped"].items() if k != "runs"},
              flush=True)

        # -- the loop with a checkpoint every loop_every_s seconds against none: blocks of that
        # many seconds, one save each
        every = max(1, round(args.loop_every_s / out["overlapped"]["step_s"]))
        runs = triples(every, args.loop_triples)
        ratios = [p / s for p, s, _ in runs]
        controls = [p / c for p, _, c in runs]
        out["loop"] = {"every_s": args.loop_every_s, "every_steps": every,
                       "ratio": statistics.median(ratios), "ratio_interval": interval(ratios),
                       "control_ratio": statistics.median(controls),
                       "control_interval": interval(controls), "runs": runs}
        print("loop", {k: v for k, v in out["loop"].items() if k != "runs"}, flush=True)
    finally:
        reporting.flush_reports()
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    return out


def markdown(r: dict) -> str:
    b, o = r["blocking"], r["overlapped"]
    return "\n".join([
        "# What a sharded checkpoint costs the loop",
        "",
        f"One process on a machine of {r['machine']['cpus']} CPUs, one training thread, FSDP2 "
        f"over a one-rank gloo group, {r['state_mb']:.0f} MB of shards and AdamW state "
        "(`benchmarks/bench_stall.py`); from the second save on, medians of "
        f"{len(b['runs']['call'])} runs.",
        "",
        "## A blocking snapshot",
        "",
        "| `save_checkpoint` call (s) | plain copy into reused buffers (s) | call / copy | "
        "target (<= 1.25) | `dcp.save` to local disk (s) |",
        "|---|---|---|---|---|",
        f"| {b['call_s']:.3f} | {b['copy_s']:.3f} | {b['call_over_copy']:.2f} | "
        f"{'met' if b['call_over_copy'] <= 1.25 else 'not met'} | {b['dcp_save_s']:.3f} |",
        "",
        "## Overlapped (the default)",
        "",
        f"Blocks of {o['every']} steps of {o['step_s'] * 1000:.0f} ms, each ended once its write "
        "did: no save, a save half-way through, no save again (the control), in each of the six "
        f"orders ({len(o['runs'])} triples). The extra per save is the median of the "
        "differences (with a save less without); the control, the same of the two blocks "
        "without (what the method finds where there is nothing to find); in brackets, the "
        "median's 90% bootstrap interval.",
        "",
        "| extra per save (s) | / `dcp.save` | target (<= 0.05) | control (s) | "
        "optimizer steps that waited for a copy |",
        "|---|---|---|---|---|",
        f"| {o['extra_per_save_s']:.3f} [{o['extra_interval_s'][0]:.3f}, "
        f"{o['extra_interval_s'][1]:.3f}] | {o['extra_over_dcp_save']:.3f} | "
        f"{'met' if o['extra_over_dcp_save'] <= 0.05 else 'not met'} | "
        f"{o['control_per_save_s']:.3f} [{o['control_interval_s'][0]:.3f}, "
        f"{o['control_interval_s'][1]:.3f}] | {o['optimizer_waits']} |",
        "",
        "## The loop with a checkpoint every "
        f"{r['loop']['every_s']:.0f} s",
        "",
        f"Blocks of {r['loop']['every_steps']} steps with a save half-way through against "
        "blocks without, and the control, as above "
        f"({len(r['loop']['runs'])} triples): the loop's speed without saves over its speed "
        "with them, the median and its 90% bootstrap interval.",
        "",
        "| loop without / with saves | target (>= 0.98) | control |",
        "|---|---|---|",
        f"| {r['loop']['ratio']:.3f} [{r['loop']['ratio_interval'][0]:.3f}, "
        f"{r['loop']['ratio_interval'][1]:.3f}] | "
        f"{'met' if r['loop']['ratio'] >= 0.98 else 'not met'} | "
        f"{r['loop']['control_ratio']:.3f} [{r['loop']['control_interval'][0]:.3f}, "
        f"{r['loop']['control_interval'][1]:.3f}] |",
        "",
        r.get("note", ""),
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=float, default=190.0)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--loop-every-s", type=float, default=10.0)
    parser.add_argument("--reps", type=int, default=3, help="blocking saves measured")
    parser.add_argument("--triples", type=int, default=18,
                        help="triples of blocks of the overlapped measure (3 of each order)")
    parser.add_argument("--loop-triples", type=int, default=6,
                        help="triples of blocks of loop-every-s seconds (one of each order)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    return write(args, "stall", measure, markdown)

if __name__ == "__main__":
    raise SystemExit(main())
