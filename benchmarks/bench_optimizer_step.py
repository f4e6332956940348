"""optimizer_step on several CPU workers: bucketed gradient reduction vs one bucket a parameter.

Runs one Ray Train fit with 2 CPU workers (gloo path) and, in the same training function,
times steps of an MLP with many parameter tensors for each bucket size, counting the
device-to-host transfers per step. Prints one JSON line per bucket size (rank 0).

    python benchmarks/bench_optimizer_step.py --layers 24 --width 256 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def bench_loop(config: dict) -> None:
    import torch
    import torch_xla.debug.metrics as met

    import ray_train_xla as rtx

    def transfers() -> int:
        data = met.metric_data("TransferFromDeviceTime")
        return int(data[0]) if data else 0

    layers = []
    for _ in range(config["layers"]):
        layers += [torch.nn.Linear(config["width"], config["width"]), torch.nn.Tanh()]
    model = rtx.prepare_model(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    device = rtx.get_device()
    x = torch.randn(config["batch"], config["width"]).to(device)
    results = []
    for bucket_mb in config["bucket_mbs"]:
        for i in range(config["warmup"] + config["steps"]):
            if i == config["warmup"]:
                start, t0 = transfers(), time.perf_counter()
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            rtx.optimizer_step(opt, bucket_mb=bucket_mb)
        seconds = time.perf_counter() - t0
        results.append({
            "bucket_mb": bucket_mb,
            "param_tensors": len(list(model.parameters())),
            "param_mb": sum(p.numel() * 4 for p in model.parameters()) / 2**20,
            "ms_per_step": 1000 * seconds / config["steps"],
            "host_transfers_per_step": (transfers() - start) / config["steps"],
        })
    if rtx.rank() == 0:
        with open(os.path.join(config["out_dir"], "bench.json"), "w") as f:
            json.dump(results, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import TorchXLAConfig

    with tempfile.TemporaryDirectory() as tmp:
        config = {**vars(args), "out_dir": tmp, "bucket_mbs": [25.0, 1e-9]}
        ray.init(address="local", num_cpus=args.workers + 1, include_dashboard=False,
                 log_to_driver=False)
        try:
            TorchTrainer(
                bench_loop, train_loop_config=config,
                torch_config=TorchXLAConfig(device="cpu", timeout_s=300),
                scaling_config=ScalingConfig(num_workers=args.workers),
                run_config=RunConfig(storage_path=os.path.join(tmp, "results")),
            ).fit()
        finally:
            ray.shutdown()
        with open(os.path.join(tmp, "bench.json")) as f:
            for row in json.load(f):
                print(json.dumps(row))


if __name__ == "__main__":
    main()
