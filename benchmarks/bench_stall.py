"""What a sharded checkpoint costs the training loop: the save call, and the loop's time.

One process with 2 cores and one training thread (``torch.set_num_threads(1)``: the writer has
a core, as on real hosts), FSDP2 over a one-rank gloo group, about 190 MB of shards and AdamW
state; ``save_checkpoint``'s files written by the worker's background reporter into a local
temporary directory (the report itself is a no-op here: this measures the loop's side, not
Ray's). From the second save on, measured side by side in one run:

- **blocking snapshot** (``configure_reports(overlap_snapshots=False)``): the call's time
  against a plain copy of the same tensors into buffers allocated once (``copy_``), and
  against a synchronous ``torch.distributed.checkpoint.save`` of the same state to local disk;
- **overlapped** (the default): the steps right after ``save_checkpoint``, while its write runs
  beside them (torch's writer process), against as many steps once it has ended, in rounds that
  alternate with a control (the same two sets of steps with no save); the extra time per save
  (the median difference, with its bootstrap interval) over ``dcp.save``'s time, at each CPU
  niceness of the writer process given (``--writer-niceness``; the package runs it at the
  training process's);
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
    # This process's environment says nothing of threads (torch's default: one per core); the
    # writer process starts on one thread of its pools all the same (writer.WRITER_THREADS).
    os.environ.pop("OMP_NUM_THREADS", None)
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

        # -- overlapped: the steps right after a save, while its write runs beside them, against
        # as many steps once the write has ended; the control, the same two sets of steps with
        # no save (what the method finds where there is nothing to find). Rounds of each kind
        # alternate; the writer process's CPU niceness cycles through --writer-niceness.
        from ray_train_xla.toolkit import runtime as rt_mod
        from ray_train_xla.toolkit.checkpoint import writer

        pid = writer.writer_process_pid()  # torch's, started by the saves above
        rt_mod.begin()  # as another training function would: these options are its own
        reporting.configure_reports(max_in_flight=2, overlap_snapshots=True)

        def steps(n: int) -> float:
            t = time.perf_counter()
            for _ in range(n):
                step()
            return time.perf_counter() - t

        def saved_round(n: int) -> float:
            rtx.save_checkpoint(state())
            during = steps(n)
            reporting.flush_reports()  # the write has ended
            return during - steps(n)

        def control_round(n: int) -> float:
            first = steps(n)
            return steps(n) - first

        saved_round(args.overlap_steps)  # warm: the buffers
        allocated = pool().allocated_bytes
        by_niceness: dict = {n: {"extra": [], "control": []} for n in args.writer_niceness}
        for i in range(args.rounds * len(args.writer_niceness)):
            niceness = args.writer_niceness[i % len(args.writer_niceness)]
            renice(pid, niceness)
            first, second = (saved_round, control_round) if i % 2 else (control_round, saved_round)
            runs = {f: f(args.overlap_steps) for f in (first, second)}
            by_niceness[niceness]["extra"].append(runs[saved_round])
            by_niceness[niceness]["control"].append(runs[control_round])
        dcp_s = out["blocking"]["dcp_save_s"]
        out["overlapped"] = {
            "steps": args.overlap_steps, "rounds": args.rounds,
            "step_s": statistics.median(steps(1) for _ in range(5)),
            "shipped_niceness": 0,  # the package runs its writers at the training's priority
            "writer_threads": writer.WRITER_THREADS,
            "optimizer_waits": snapshots().waits,
            "allocated_mb_after_warmup": (pool().allocated_bytes - allocated) / MB,
            "by_niceness": {str(n): {
                "extra_per_save_s": statistics.median(r["extra"]),
                "extra_interval_s": interval(r["extra"]),
                "extra_over_dcp_save": statistics.median(r["extra"]) / dcp_s,
                "control_s": statistics.median(r["control"]),
                "control_interval_s": interval(r["control"]), "runs": r}
                for n, r in by_niceness.items()}}
        shipped = out["overlapped"]["by_niceness"].get("0") or \
            next(iter(out["overlapped"]["by_niceness"].values()))
        out["overlapped"]["extra_over_dcp_save"] = shipped["extra_over_dcp_save"]
        print("overlapped", {n: {k: v for k, v in r.items() if k != "runs"}
                             for n, r in out["overlapped"]["by_niceness"].items()}, flush=True)

        # -- the loop: blocks of steps with a save half-way through against blocks without,
        # each ended once its write did (the write counts), in triples with a control
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


def renice(pid: int, niceness: int) -> None:
    """The CPU niceness of every thread of process ``pid`` (Linux keeps one per thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


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
        f"Each round: `save_checkpoint` returns, then {o['steps']} steps while the write runs "
        f"beside them (torch's writer process), then {o['steps']} steps once it has ended; the "
        "extra per save is the first set's time less the second's. The control: "
        f"{o['steps']} steps, then {o['steps']} more, no save (what the method finds where "
        f"there is nothing to find). {o['rounds']} rounds of each, alternating, at each CPU "
        "niceness of the writer process (the training process's is 0; the writer runs "
        f"on {o['writer_threads']} thread of its pools); medians, "
        "in brackets their 90% bootstrap intervals. A step takes "
        f"{o['step_s'] * 1000:.0f} ms.",
        "",
        "| writer's niceness | extra per save (s) | / `dcp.save` | target (<= 0.05) | control (s) |",
        "|---|---|---|---|---|",
        *(f"| {n}{' (shipped)' if int(n) == o['shipped_niceness'] else ''} | "
          f"{r['extra_per_save_s']:.3f} [{r['extra_interval_s'][0]:.3f}, "
          f"{r['extra_interval_s'][1]:.3f}] | {r['extra_over_dcp_save']:.3f} | "
          + ("met" if r["extra_over_dcp_save"] <= 0.05 else "not met")
          + f" | {r['control_s']:.3f} [{r['control_interval_s'][0]:.3f}, "
          f"{r['control_interval_s'][1]:.3f}] |"
          for n, r in o["by_niceness"].items()),
        "",
        f"Optimizer steps that waited for a snapshot's copy: {o['optimizer_waits']}; host memory "
        f"allocated after the warm-up: {o['allocated_mb_after_warmup']:.1f} MB.",
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
    parser.add_argument("--overlap-steps", type=int, default=3,
                        help="steps measured while a write runs, and after it (default 3)")
    parser.add_argument("--rounds", type=int, default=30,
                        help="rounds with a save and control rounds, each, per niceness")
    parser.add_argument("--writer-niceness", type=lambda v: [int(x) for x in v.split(",")],
                        default=[0], help="the writer process's CPU niceness, one or several "
                        "(comma-separated; rounds cycle through them; default 0, the package's)")
    parser.add_argument("--loop-every-s", type=float, default=10.0)
    parser.add_argument("--reps", type=int, default=3, help="blocking saves measured")
    parser.add_argument("--loop-triples", type=int, default=6,
                        help="triples of blocks of loop-every-s seconds (one of each order)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    return write(args, "stall", measure, markdown)

if __name__ == "__main__":
    raise SystemExit(main())
