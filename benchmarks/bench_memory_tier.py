"""The memory tier against storage: restore time, and the cost of keeping every step in memory.

Both measured in one process on a local Ray (the memory store is a real actor on this node),
with FSDP2 over a one-rank gloo group (the path a sharded model takes):

- **restore**: a state of about 500 MB (model and AdamW state) kept in memory by
  ``keep_in_memory``, and saved to a local directory by ``save_checkpoint``'s writer; then
  ``load_checkpoint`` into a fresh model, from memory, and from the directory read through a
  storage that serves 100 MB/s (a pyarrow filesystem that waits as long as that takes);
  alternating, medians;
- **every step**: a loop of 200 ms steps (one training thread; the rest of the step matrix
  products, small (256-wide) then large (1024-wide), calibrated on the whole step), in triples
  of blocks: none kept, ``keep_in_memory`` at every step, none kept again (the control), each
  order alike; the extra time per step (the median difference, with its bootstrap interval)
  over the step time. Then the CPU of every process of the machine per generation kept
  (``/proc/stat``), with an idle rest of the step.

    python benchmarks/bench_memory_tier.py                # writes results/memory_tier.{json,md}
    python benchmarks/bench_memory_tier.py --markdown     # memory_tier.md again from the json
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
import uuid

import pyarrow as pa
import pyarrow.fs as pafs

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from figures import add_output_arguments, interval, write  # noqa: E402

MB = 1e6
STORAGE_BPS = 100 * MB
SETTLE = 2  # the first steps of each block of the every-step loop, not counted


class SlowHandler(pafs.FileSystemHandler):
    """A pyarrow filesystem handler over the local file system that serves reads at
    ``bytes_per_s`` (writes at the local file system's speed). At module level, so that it is
    pickled by name into writer processes."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.fs = pafs.LocalFileSystem()

    def __reduce__(self):
        return SlowHandler, (self.bytes_per_s,)

    def _read(self, path):
        with self.fs.open_input_file(path) as f:
            data = f.read()
        time.sleep(len(data) / self.bytes_per_s)
        return pa.BufferReader(pa.py_buffer(data))

    def open_input_file(self, path):
        return self._read(path)

    def open_input_stream(self, path):
        return self._read(path)

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def get_type_name(self):
        return "slow"

    def normalize_path(self, path):
        return path

    def equals(self, other):
        return other is self

    # Writes at the local file system's speed (what is measured is reading).
    def create_dir(self, path, recursive):
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("not here")

    def delete_file(self, path):
        self.fs.delete_file(path)

    def move(self, src, dest):
        self.fs.move(src, dest)

    def copy_file(self, src, dest):
        self.fs.copy_file(src, dest)

    def open_output_stream(self, path, metadata):
        return self.fs.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        return self.fs.open_append_stream(path, metadata=metadata)


def busy_s() -> float:
    """Seconds of CPU the machine's processes used so far, all together (``/proc/stat``)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def slow_filesystem(bytes_per_s: float):
    """A pyarrow filesystem that serves reads at ``bytes_per_s`` (``SlowHandler``)."""
    return pafs.PyFileSystem(SlowHandler(bytes_per_s))


def build(width: int, layers: int, seed: int):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    fully_shard(model)
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    return model, opt


def train_step(model, opt, x, matmuls: int = 0, work=None):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    for _ in range(matmuls):  # the rest of a 200 ms step
        work @ work


def state_of(model, opt, step: int) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def measure(args) -> dict:
    import ray
    import torch
    import torch.distributed as dist

    import ray_train_xla as rtx
    from ray_train_xla.planning import contract
    from ray_train_xla.toolkit.checkpoint import memory
    from ray_train_xla.toolkit.checkpoint.seam import load_sharded, save_sharded

    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    root = tempfile.mkdtemp(prefix="bench-memory-tier-")
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
    node = ray.get_runtime_context().get_node_id()
    tier_id = uuid.uuid4().hex[:12]
    stores: dict = {}  # the stores live as long as these first handles (the backend's too)
    memory.start_stores(tier_id, [node], 120, stores)
    # FSDP2 on the CPU twin of a native config (TorchNeuronConfig, TorchTPUConfig)
    os.environ.update({contract.MEMORY_EVERY_VAR: "1", contract.MEMORY_TIER_VAR: tier_id,
                       contract.MEMORY_NODES_VAR: node, contract.TIMEOUT_VAR: "300",
                       contract.RUNTIME_VAR: "native", contract.DEVICE_VAR: "cpu"})
    contract.reload()
    out: dict = {}
    try:
        # -- every step (first: the restore's 500 MB are not in this process yet): the rest of
        # the step in small kernels (256-wide matmuls, each a call that takes the interpreter
        # lock again) and in large ones (1024-wide)
        width = 1024
        x = torch.randn(8, width)
        model, opt = build(width, args.step_layers, 2)
        step_state_mb = sum(p.numel() * 4 * 3 for p in model.parameters()) / MB
        for key, size in (("every_step", 256), ("every_step_large", 1024)):
            work = torch.randn(size, size)
            for _ in range(3):  # warm
                train_step(model, opt, x, 2, work)
            t = time.perf_counter()
            for _ in range(20):
                work @ work
            per = (time.perf_counter() - t) / 20
            train_s = statistics.median(timed(train_step, model, opt, x) for _ in range(5))
            matmuls = max(0, int((args.step_s - train_s) / per))
            for _ in range(2):  # the whole step at step_s, as measured
                step_s = statistics.median(
                    timed(train_step, model, opt, x, matmuls, work) for _ in range(5))
                matmuls = max(0, round(matmuls * (args.step_s - train_s) /
                                       max(1e-6, step_s - train_s)))

            def block(keep: bool, first: int, matmuls=matmuls, work=work) -> float:
                """The mean step of a block of steps, keeping every one or none; its first
                steps (the change of regime) are not counted; the tier's last generation is
                waited for after the block, untimed."""
                times = []
                for step in range(first, first + args.block):
                    t = time.perf_counter()
                    train_step(model, opt, x, matmuls, work)
                    if keep:
                        rtx.keep_in_memory(state_of(model, opt, step), step)
                    times.append(time.perf_counter() - t)
                memory.flush_memory()
                return statistics.mean(times[SETTLE:])

            block(True, 1)  # warm up: the slots are laid out, the plan made
            # Triples of blocks: none kept, every step kept, none kept again (the control: what
            # the same difference measures with nothing to find), in each of the six orders.
            orders = list(itertools.permutations(("plain", "kept", "control")))
            runs = []
            for rep in range(args.reps * 4):
                first = 1 + (rep + 1) * 3 * args.block
                means = {kind: block(kind == "kept", first + i * args.block)
                         for i, kind in enumerate(orders[rep % len(orders)])}
                runs.append((means["plain"], means["kept"], means["control"]))
            plain = statistics.median(p for p, _, _ in runs)
            kept = statistics.median(k for _, k, _ in runs)
            extra = [(k - p) / plain for p, k, _ in runs]
            control = [(c - p) / plain for p, _, c in runs]
            out[key] = {"state_mb": step_state_mb, "kernel": size, "kernels": matmuls,
                        "step_s": plain, "kept_step_s": kept, "block": args.block,
                        "settle": SETTLE, "extra_fraction": statistics.median(extra),
                        "extra_interval": interval(extra),
                        "control_fraction": statistics.median(control),
                        "control_interval": interval(control), "runs": runs}
            print(key, {k: v for k, v in out[key].items() if k != "runs"}, flush=True)

        # -- the CPU of every process of the machine per generation kept (the tier's work beside
        # the loop: the snapshot's copy, the tier's thread, Ray's call, the store): blocks of
        # training steps with an idle rest, keeping every step against none
        tier, blocks, step = memory.memory_tier(), [], 10_000
        for _ in range(args.reps):
            used = {}
            for keep in (False, True):
                kept, start = tier.kept, busy_s()
                for _ in range(25):
                    step += 1
                    train_step(model, opt, x)
                    if keep:
                        rtx.keep_in_memory(state_of(model, opt, step), step)
                    time.sleep(0.1)
                memory.flush_memory()
                used[keep] = (busy_s() - start, tier.kept - kept)
            blocks.append((used[True][0] - used[False][0]) / max(1, used[True][1]))
        out["cpu_per_generation"] = {"ms": statistics.median(blocks) * 1000,
                                     "runs_ms": [b * 1000 for b in blocks]}
        print("cpu_per_generation", out["cpu_per_generation"], flush=True)
        del model, opt

        # -- restore
        layers = max(1, round(args.state_mb * MB / (3 * 4 * (width * width + width))))
        model, opt = build(width, layers, 0)
        train_step(model, opt, x)
        state = state_of(model, opt, 1)
        rtx.keep_in_memory(state, 1)
        memory.flush_memory()
        directory = os.path.join(root, "checkpoint")
        written = save_sharded(state, directory)
        state_bytes = written["bytes"]
        slow = slow_filesystem(STORAGE_BPS)
        fresh, fresh_opt = build(width, layers, 1)
        train_step(fresh, fresh_opt, x)  # the optimizer state exists, as after a restart
        times: dict[str, list[float]] = {"memory": [], "storage": []}
        for _ in range(args.reps):
            t = time.perf_counter()
            rtx.load_checkpoint(fresh, fresh_opt)
            times["memory"].append(time.perf_counter() - t)
            assert memory.memory_tier().restored is not None
            t = time.perf_counter()
            load_sharded(directory, fresh, fresh_opt, filesystem=slow)
            times["storage"].append(time.perf_counter() - t)
        out["restore"] = {"state_mb": state_bytes / MB, "storage_mb_per_s": STORAGE_BPS / MB,
                          "memory_s": statistics.median(times["memory"]),
                          "storage_s": statistics.median(times["storage"]), "runs": times}
        out["restore"]["speedup"] = out["restore"]["storage_s"] / out["restore"]["memory_s"]
        print("restore", {k: v for k, v in out["restore"].items() if k != "runs"}, flush=True)
    finally:
        dist.destroy_process_group()
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return out


def _bracket(bounds) -> str:
    return f" [{bounds[0]:.1%}, {bounds[1]:.1%}]" if bounds else ""


def _control(e: dict) -> str:
    if "control_fraction" not in e:
        return ""
    return f"{e['control_fraction']:.1%}{_bracket(e.get('control_interval'))}"


def markdown(r: dict) -> str:
    rs, es = r["restore"], r["every_step"]
    return "\n".join([
        "# The memory tier",
        "",
        f"One process on a machine of {r['machine']['cpus']} CPUs, a local Ray, FSDP2 over a "
        "one-rank gloo group (`benchmarks/bench_memory_tier.py`); medians of "
        f"{len(rs['runs']['memory'])} alternating runs.",
        "",
        "## Restore",
        "",
        f"`load_checkpoint` of {rs['state_mb']:.0f} MB (model and AdamW state) into a fresh "
        "model: from the memory tier (this node's store), and from the same checkpoint in storage "
        f"that serves {rs['storage_mb_per_s']:.0f} MB/s.",
        "",
        "| from memory (s) | from storage (s) | memory faster by | target (>= 5x) |",
        "|---|---|---|---|",
        f"| {rs['memory_s']:.2f} | {rs['storage_s']:.2f} | {rs['speedup']:.1f}x | "
        f"{'met' if rs['speedup'] >= 5 else 'not met'} |",
        "",
        "## Keeping every step",
        "",
        f"A loop of about {es['step_s'] * 1000:.0f} ms steps with {es['state_mb']:.0f} MB of "
        "model and AdamW state, `keep_in_memory` at every step against none (one training "
        "thread). The rest of each step is matrix products: small kernels (each a short call "
        "that takes the interpreter lock again), or large ones. Blocks of "
        f"{es.get('block', 20)} steps: none kept, every step kept, none kept again (the "
        f"control), in each of the six orders ({len(es['runs'])} triples); the first "
        f"{es.get('settle', 0)} steps of each block are not counted. The extra is the median of "
        "the differences (kept less none), over the step; the control, the same of the two "
        "blocks that keep none (what the method finds where there is nothing to find); in "
        "brackets, the median's 90% bootstrap interval.",
        "",
        "| the step's kernels | step (ms) | with keep_in_memory every step (ms) | extra | "
        "control | target (<= 2%) |",
        "|---|---|---|---|---|---|",
        *(f"| {e.get('kernels', '')} of {e.get('kernel', 256)}x{e.get('kernel', 256)} | "
          f"{e['step_s'] * 1000:.0f} | {e['kept_step_s'] * 1000:.0f} | "
          f"{e['extra_fraction']:.1%}{_bracket(e.get('extra_interval'))} | "
          f"{_control(e)} | {'met' if e['extra_fraction'] <= 0.02 else 'not met'} |"
          for e in (es, r.get("every_step_large")) if e),
        "",
        *([f"The CPU of every process of the machine per generation kept (the tier's work beside "
           f"the loop): {r['cpu_per_generation']['ms']:.1f} ms (median of "
           f"{len(r['cpu_per_generation']['runs_ms'])} blocks of 25 steps).", ""]
          if "cpu_per_generation" in r else []),
        r.get("note", ""),
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=float, default=500.0)
    parser.add_argument("--step-layers", type=int, default=4,
                        help="1024-wide layers of the every-step loop's model (4: 50 MB of state)")
    parser.add_argument("--step-s", type=float, default=0.2)
    parser.add_argument("--block", type=int, default=8,
                        help="steps per block of the every-step loop (keeping every step or none)")
    parser.add_argument("--reps", type=int, default=6,
                        help="restores of each kind; the every-step loop makes 4x as many triples")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    return write(args, "memory_tier", measure, markdown)

if __name__ == "__main__":
    raise SystemExit(main())
