"""A small MLP on synthetic regression data with Ray Train and PyTorch/XLA.

The same training function runs on Trainium, TPU and CPU. By default: 2 CPU workers, a
checkpoint with the loss and XLA compile metrics every 20 steps (``--report-every``),
resumable: Ray Train restarts a failed worker group from the last checkpoint, and
``--resume --name RUN`` continues a finished run for ``--steps`` more (Ray Train V2 finds the
run's checkpoints under its storage path).

``save_checkpoint`` does not wait for Ray: it copies the state off the device and hands the
write and the report to a background thread, so the loop can report every few steps.

    python examples/train_mlp.py --workers 2 --steps 2000
    python examples/train_mlp.py --resume --name train_mlp-... --steps 1000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def train_loop(config: dict) -> None:
    """The training function: data, model, optimizer step, checkpoints, compile metrics."""
    import torch

    import ray_train_xla as rtx

    # Synthetic regression: y = sin(x) . w + noise, the same data on every worker (each
    # worker reads its own shard through prepare_data_loader).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(config["samples"], config["features"], generator=g)
    w = torch.randn(config["features"], 1, generator=g)
    y = torch.sin(x) @ w + 0.01 * torch.randn(config["samples"], 1, generator=g)
    loader = rtx.prepare_data_loader(
        torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=config["batch_size"], shuffle=True
        )
    )

    model = rtx.prepare_model(
        torch.nn.Sequential(
            torch.nn.Linear(config["features"], config["hidden"]),
            torch.nn.ReLU(),
            torch.nn.Linear(config["hidden"], 1),
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)

    state = rtx.load_checkpoint(model, optimizer)  # None on a fresh start
    step = state["step"] if state else 0
    last = step + config["steps"] if config.get("more") and state else config["steps"]
    steps_per_epoch = len(loader)
    loader.set_epoch(step // steps_per_epoch)
    skip = step % steps_per_epoch  # resuming mid-epoch: skip the batches already seen

    # Running loss total, summed on the device inside the step graph (no extra graph, no
    # transfer per step); read at each report to give the mean loss since the previous one.
    loss_total, reported_total, reported_step = torch.zeros((), device=rtx.get_device()), 0.0, step
    while step < last:
        for i, (xb, yb) in enumerate(loader):
            if i < skip:
                continue
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            loss_total = loss_total + loss.detach()
            rtx.optimizer_step(optimizer)  # average gradients, step, cut the graph
            step += 1
            rtx.metrics(step)  # a few microseconds: counts compilations, warns on recompilation
            if step % config["report_every"] == 0 or step >= last:
                total = loss_total.item()
                rtx.save_checkpoint(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "step": step},
                    {"step": step, "loss": (total - reported_total) / (step - reported_step),
                     **rtx.metrics(step, execute_time=True)},
                )
                reported_total, reported_step = total, step
            if step >= last:
                break
        skip = 0


def default_config(steps: int = 60, report_every: int = 20) -> dict:
    """The example's sizes; a checkpoint every ``report_every`` steps and at the last."""
    return {
        "samples": 512, "features": 8, "hidden": 32, "batch_size": 32, "lr": 0.05,
        "steps": steps, "report_every": report_every,
    }


def build_trainer(workers: int, config: dict, storage_path: str, name: str, device: str = "cpu",
                  keep: int | None = 2):
    """A TorchTrainer for ``train_loop`` with ``TorchXLAConfig``, resumable under ``name``;
    ``keep``: checkpoints kept (None: all)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import TorchXLAConfig

    return TorchTrainer(
        train_loop,
        train_loop_config=config,
        torch_config=TorchXLAConfig(device=device, timeout_s=120),
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(
            storage_path=storage_path,
            name=name,
            checkpoint_config=CheckpointConfig(num_to_keep=keep),
            failure_config=FailureConfig(max_failures=1),
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "neuron", "tpu"])
    parser.add_argument("--storage-path", default=os.path.join(tempfile.gettempdir(), "train_mlp"))
    parser.add_argument("--name", default=None, help="run name (default: a new one)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run --name from its last checkpoint, --steps more")
    parser.add_argument("--report-every", type=int, default=20, metavar="N",
                        help="report and checkpoint every N steps (default 20; the loop does not "
                        "wait for Ray)")
    args = parser.parse_args()
    if args.resume and not args.name:
        parser.error("--resume needs the --name of the run to continue")
    args.name = args.name or time.strftime("train_mlp-%Y%m%d-%H%M%S")

    import ray

    ray.init(address="local", include_dashboard=False)  # never attach to a stale cluster
    try:
        config = default_config(args.steps, args.report_every)
        config["more"] = args.resume
        trainer = build_trainer(args.workers, config, args.storage_path, args.name, args.device)
        result = trainer.fit()
    finally:
        ray.shutdown()
    m = result.metrics or {}
    print(f"step {m.get('step')}: loss {m.get('loss'):.4f}, "
          f"{m.get('xla/compiles')} graphs compiled ({m.get('xla/compile_time_s', 0):.2f} s), "
          f"{m.get('xla/compiles_after_warmup')} after warm-up; checkpoint {result.checkpoint}")


if __name__ == "__main__":
    main()
