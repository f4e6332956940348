"""What a sharded checkpoint costs the training loop: the save call, and the loop's time.

One process with 2 cores and one training thread (``torch.set_num_threads(1)``: the writer has
a core, as on real hosts), FSDP2 over a one-rank gloo group, about 190 MB of shards and AdamW
state; ``save_checkpoint``'s files written by the worker's background reporter into a local
temporary directory (the report itself is a no-op here: this measures the loop's side, not
Ray's). From the second save on, measured side by side in one run:

- **blocking snapshot** (``configure_reports(overlap_snapshots=False)``): the call's time
  against a plain copy of the same tensors into buffers allocated once (``copy_``), and
  against a synchronous ``torch.distributed.checkpoint.save`` of the same state to local disk;
- **overlapped** (the default): the loop with a save every ``--every`` steps (half-way through
  each interval, so the last write has steps to overlap too; the loop ends once every write
  did) against the same loop without saves; the extra time per save over ``dcp.save``'s time;
- **the loop**: with a save every ``--loop-every-s`` seconds (10) against none, its speed ratio.

    python benchmarks/bench_stall.py               # writes results/stall.{json,md}
    python benchmarks/bench_stall.py --markdown    # stall.md again from stall.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from figures import add_output_arguments, write  # noqa: E402

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

        # -- overlapped: the loop with saves against the loop without
        reporting.configure_reports(max_in_flight=2, overlap_snapshots=True)
        allocated = pool().allocated_bytes

        durations: list[list[float]] = []  # per loop with saves: each step, its save call in

        def loop(saves: bool) -> float:
            t = last = time.perf_counter()
            steps = []
            for i in range(1, args.steps + 1):
                step()
                if saves and i % args.every == args.every // 2:
                    rtx.save_checkpoint(state())
                now = time.perf_counter()
                steps.append(now - last)
                last = now
            reporting.flush_reports()  # the last write counts
            steps[-1] += time.perf_counter() - last
            if saves:
                durations.append(steps)
            return time.perf_counter() - t

        loop(True)  # warm: the buffers of overlapped saves
        durations.clear()
        pairs = [(loop(False), loop(True)) for _ in range(args.reps)]
        saves_per_loop = args.steps // args.every
        plain = statistics.median(p for p, _ in pairs)
        with_saves = statistics.median(s for _, s in pairs)
        extra = (with_saves - plain) / saves_per_loop
        # Paired within each loop with saves (no drift between loops): the steps from a save's
        # call to the next half-interval (its write runs beside them) against the loop's quiet
        # steps (no call, no write), per save.
        half = args.every // 2
        per_save = []
        for steps in durations:
            busy = {i for s in range(half, args.steps + 1, args.every)
                    for i in range(s, min(s + half, args.steps) + 1)}
            quiet = statistics.median(d for i, d in enumerate(steps, 1) if i not in busy)
            for s in range(half, args.steps + 1, args.every):
                window = [steps[i - 1] for i in range(s, min(s + half, args.steps) + 1)]
                per_save.append(sum(window) - len(window) * quiet)
        paired = statistics.median(per_save)
        out["overlapped"] = {
            "steps": args.steps, "every": args.every, "step_s": plain / args.steps,
            "loop_s": plain, "loop_with_saves_s": with_saves, "extra_per_save_s": extra,
            "extra_over_dcp_save": extra / out["blocking"]["dcp_save_s"],
            "paired_extra_per_save_s": paired,
            "paired_over_dcp_save": paired / out["blocking"]["dcp_save_s"],
            "loop_ratio": plain / with_saves, "optimizer_waits": snapshots().waits,
            "allocated_mb_after_warmup": (pool().allocated_bytes - allocated) / MB,
            "runs": pairs, "per_save_s": per_save}
        print("overlapped", {k: v for k, v in out["overlapped"].items() if k != "runs"},
              flush=True)

        # -- the loop with a checkpoint every loop_every_s seconds against none
        every = max(1, round(args.loop_every_s / out["overlapped"]["step_s"]))
        steps, args.every = 2 * every, every
        saved_steps, args.steps = args.steps, steps
        pairs = [(loop(False), loop(True)) for _ in range(max(2, args.reps - 1))]
        args.steps = saved_steps
        plain = statistics.median(p for p, _ in pairs)
        with_saves = statistics.median(s for _, s in pairs)
        out["loop"] = {"every_s": args.loop_every_s, "every_steps": every, "steps": steps,
                       "ratio": plain / with_saves, "runs": pairs}
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
        f"{o['steps']} steps of {o['step_s'] * 1000:.0f} ms, a save every {o['every']} steps "
        "(half-way through each interval), against the same loop without saves: the loops' "
        f"medians ({len(o['runs'])} pairs). Paired: in each loop with saves, the steps from a "
        "save's call to the next half-interval (its write runs beside them) against that loop's "
        f"other steps, per save: the median of {len(o['per_save_s'])} and their range.",
        "",
        "| extra per save (s) | / `dcp.save` | target (<= 0.05) | paired: median (s) | "
        "paired: range (s) | loop without / with saves |",
        "|---|---|---|---|---|---|",
        f"| {o['extra_per_save_s']:.3f} | {o['extra_over_dcp_save']:.3f} | "
        f"{'met' if o['extra_over_dcp_save'] <= 0.05 else 'not met'} | "
        f"{o['paired_extra_per_save_s']:.3f} | {min(o['per_save_s']):.3f} to "
        f"{max(o['per_save_s']):.3f} | {o['loop_ratio']:.3f} |",
        "",
        "## The loop with a checkpoint every "
        f"{r['loop']['every_s']:.0f} s",
        "",
        f"{r['loop']['steps']} steps, a save every {r['loop']['every_steps']} steps, against the "
        "same loop without saves (medians of "
        f"{len(r['loop']['runs'])} pairs).",
        "",
        "| loop without / with saves | target (>= 0.98) |",
        "|---|---|",
        f"| {r['loop']['ratio']:.3f} | {'met' if r['loop']['ratio'] >= 0.98 else 'not met'} |",
        "",
        r.get("note", ""),
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=float, default=190.0)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--loop-every-s", type=float, default=10.0)
    parser.add_argument("--reps", type=int, default=3)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    return write(args, "stall", measure, markdown)

if __name__ == "__main__":
    raise SystemExit(main())
