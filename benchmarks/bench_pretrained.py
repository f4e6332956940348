"""Pretrained models by slices: the sharded load against ``from_pretrained`` in every worker, and
the parallel export against ``consolidate --hf`` in one process; time and peak memory per worker.

W worker processes (1, 2, 4, and 8 with ``--workers 1 2 4 8``) on this machine, each with the
environment ``TorchNeuronConfig(device="cpu")`` plans (a native CPU worker: gloo, FSDP2), joined
by ``torch.distributed`` (gloo), as Ray Train's workers are. The model: a Llama of 160M
parameters saved in bf16 (320 MB, 3 safetensors files), each decoder layer an FSDP2 unit.

- ``load``: ``rtx.load_pretrained(meta model, path, dtype=bf16)`` against today's path,
  ``from_pretrained(path, dtype=bf16)`` in every worker then ``prepare_sharded_model`` (which
  broadcasts rank 0's weights). Per worker: the time from a barrier to the model being ready
  (every parameter it holds read once: Transformers maps the files, and a tensor left mapped
  is read from the file on first use),
  and the peak resident memory above the worker's memory just before (``/proc/self/status``
  ``VmHWM`` after resetting it with ``/proc/self/clear_refs``). Targets: peak per worker <=
  1.3 x model / W + 150 MB; at W = 4, the sharded load no slower than one ``from_pretrained``
  (W = 1 of the baseline).
- ``export``: with the model loaded at W = 4, ``rtx.export_pretrained`` from every worker
  against ``consolidate_hf`` of the same model's DCP checkpoint in one process (streamed), both
  in bf16.

Writes ``pretrained.json`` and ``pretrained.md`` under --out.

    python benchmarks/bench_pretrained.py [--workers 1 2 4] [--reps 2] [--out benchmarks/results]
    python benchmarks/bench_pretrained.py --markdown   # pretrained.md again from pretrained.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MB = 10**6


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def make_model(path: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                         max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="120MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def touch(model) -> float:
    """Read every parameter this worker holds (its shards): until then a tensor
    ``from_pretrained`` left mapped to the file has not been read."""
    import torch

    total = 0.0
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += float(local.float().sum())
    return total


def worker(rank: int, world: int, port: int, task: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), RAY_TRAIN_XLA_DEVICE="cpu",
                      RAY_TRAIN_XLA_RUNTIME="native", RAY_TRAIN_XLA_PG_BACKEND="gloo",
                      TORCHELASTIC_RUN_ID=f"bench-{port}")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    import ray_train_xla as rtx

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    path = task["path"]
    result: dict = {"rank": rank}
    with torch.device("meta"):  # the imports and first-use costs, before measuring
        probe = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    blocks = {type(probe.model.layers[0])}
    del probe
    dist.barrier()
    before = reset_peak()
    start = time.perf_counter()
    if task["kind"] == "sharded":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                                     dtype=torch.bfloat16)
        model = rtx.load_pretrained(model, path, auto_wrap_policy=blocks)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        if world > 1:
            model = rtx.prepare_sharded_model(model, auto_wrap_policy=blocks)
    touch(model)  # transformers maps the files: its tensors are read on first use, here
    dist.barrier()
    result["load_s"] = time.perf_counter() - start
    result["load_peak"] = status("VmHWM") - before
    if task.get("export"):
        dist.barrier()
        before = reset_peak()
        start = time.perf_counter()
        rtx.export_pretrained(model, task["export"], source=path)
        result["export_s"] = time.perf_counter() - start
        result["export_peak"] = status("VmHWM") - before
        dcp.save({"model": model.state_dict()}, checkpoint_id=task["checkpoint"])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, task: dict) -> list[dict]:
    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(prefix="bench-pretrained-")
    try:
        mp.spawn(worker, args=(world, free_port(), task, out), nprocs=world)
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def consolidate_one_process(checkpoint: str, out: str, source: str) -> dict:
    """``consolidate_hf`` in a fresh process (so the benchmark's own memory does not hide its
    peak)."""
    import subprocess

    code = (f"import json, sys; sys.path.insert(0, {HERE!r}); import bench_pretrained as b; "
            "import time; from ray_train_xla.tools.consolidate import consolidate_hf; "
            "import ray_train_xla.toolkit.checkpoint.stream, transformers; "
            f"before = b.reset_peak(); t = time.perf_counter(); "
            f"consolidate_hf({checkpoint!r}, {out!r}, config={source!r}, dtype='bfloat16'); "
            "print(json.dumps({'export_s': time.perf_counter() - t, "
            "'export_peak': b.status('VmHWM') - before}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reps", type=int, default=2, help="repetitions of each load (medians)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--markdown", action="store_true",
                        help="rewrite pretrained.md from pretrained.json under --out, measuring nothing")
    args = parser.parse_args(argv)
    if args.markdown:
        with open(os.path.join(args.out, "pretrained.json")) as f:
            text = markdown(json.load(f))
        with open(os.path.join(args.out, "pretrained.md"), "w") as f:
            f.write(text)
        return 0
    root = tempfile.mkdtemp(prefix="bench-pretrained-model-")
    try:
        path = os.path.join(root, "model")
        model_bytes = make_model(path)
        loads: dict = {}
        for world in args.workers:
            for kind in ("sharded", "from_pretrained"):
                reps = [run(world, {"kind": kind, "path": path}) for _ in range(args.reps)]
                loads[f"{kind}/{world}"] = {
                    "load_s": statistics.median(max(r["load_s"] for r in rep) for rep in reps),
                    "peak_mb": statistics.median(max(r["load_peak"] for r in rep) for rep in reps) / MB,
                }
                print(world, kind, loads[f"{kind}/{world}"], flush=True)
        export_dir, checkpoint = os.path.join(root, "export"), os.path.join(root, "ckpt")
        ranks = run(4, {"kind": "sharded", "path": path, "export": export_dir,
                        "checkpoint": checkpoint})
        parallel = {"export_s": max(r["export_s"] for r in ranks),
                    "peak_mb": max(r["export_peak"] for r in ranks) / MB}
        single = consolidate_one_process(checkpoint, os.path.join(root, "single"), path)
        one = {"export_s": single["export_s"], "peak_mb": single["export_peak"] / MB}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    four = 4 if 4 in args.workers else max(args.workers)
    bound = {str(w): (1.3 * model_bytes / w + 150 * MB) / MB for w in args.workers}
    results = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "model_mb": model_bytes / MB,
        "loads": loads,
        "peak_bound_mb": bound,
        "peak_target_met": all(loads[f"sharded/{w}"]["peak_mb"] <= bound[str(w)]
                               for w in args.workers),
        "speed_target_met": loads[f"sharded/{four}"]["load_s"] <= loads["from_pretrained/1"]["load_s"]
        if 1 in args.workers else None,
        "export": {"parallel_4": parallel, "consolidate_1": one},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pretrained.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.out, "pretrained.md"), "w") as f:
        f.write(markdown(results))
    print(markdown(results))
    return 0


def markdown(r: dict) -> str:
    lines = [
        "# Pretrained models by slices",
        "",
        f"A Llama of {r['model_mb']:.0f} MB in bf16 (3 safetensors files), W gloo workers as "
        f"`TorchNeuronConfig(device=\"cpu\")` plans them, on a machine of {r['machine']['cpus']} "
        "CPUs (`benchmarks/bench_pretrained.py`). Time: from a barrier to the model ready on every "
        "worker (the slowest), each worker having read every parameter it holds once (Transformers "
        "maps the files: a tensor it leaves mapped is read on first use); peak: the most resident "
        "memory above the worker's own just before (the largest worker; the mapped pages read "
        "count as resident), medians of the repetitions.",
        "",
        "| W | sharded load (s) | peak / worker (MB) | bound 1.3 x model / W + 150 MB | "
        "from_pretrained in every worker (s) | its peak / worker (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for key, value in r["loads"].items():
        kind, w = key.split("/")
        if kind != "sharded":
            continue
        base = r["loads"][f"from_pretrained/{w}"]
        lines.append(f"| {w} | {value['load_s']:.2f} | {value['peak_mb']:.0f} | "
                     f"{r['peak_bound_mb'][w]:.0f} | "
                     f"{base['load_s']:.2f} | {base['peak_mb']:.0f} |")
    e = r["export"]
    speed = {True: "met", False: "NOT met", None: "not measured"}[r["speed_target_met"]]
    cpus = r["machine"]["cpus"] or 1
    fits = [w for w in (int(k.split("/")[1]) for k in r["loads"] if k.startswith("sharded/"))
            if w <= cpus]
    if r["speed_target_met"] is False and cpus < 4 and fits:
        w = max(fits)
        speed += (f": at W = 4 the {4} workers share {cpus} CPUs; at W = {w}, a CPU a worker, the "
                  f"sharded load takes {r['loads'][f'sharded/{w}']['load_s']:.2f} s against "
                  f"{r['loads']['from_pretrained/1']['load_s']:.2f} s for one from_pretrained")
    lines += [
        "",
        f"Peak target (every W): {'met' if r['peak_target_met'] else 'NOT met'}. Speed target "
        f"(sharded at W = 4 no slower than one from_pretrained): "
        f"{speed}.",
        "",
        "| export, bf16 | time (s) | peak / process (MB) |",
        "|---|---|---|",
        f"| export_pretrained, 4 workers | {e['parallel_4']['export_s']:.2f} | "
        f"{e['parallel_4']['peak_mb']:.0f} |",
        f"| consolidate --hf, 1 process (streamed from the DCP checkpoint) | "
        f"{e['consolidate_1']['export_s']:.2f} | {e['consolidate_1']['peak_mb']:.0f} |",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
