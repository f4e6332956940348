"""A small MLP on synthetic regression data with Ray Train and PyTorch/XLA.

The same training function runs on Trainium, TPU and CPU. By default: 2 CPU workers, loss and
XLA compile metrics reported with a checkpoint after the first step and then about every 3
seconds of steps (``--report-every-s``; ``--report-every N`` for every N steps instead),
resumable: Ray Train restarts a failed worker group from the last checkpoint, and
``--resume --name RUN`` continues a finished run for ``--steps`` more (Ray Train V2 finds the
run's checkpoints under its storage path).

Why seconds and not steps: Ray Train V2 takes one report each time its controller polls the
workers (every 2 s by default, ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``), and ``ray.train.report``
waits until the previous report was taken, so a loop that reports every 10 fast steps spends
most of its time waiting for Ray.

    python examples/train_mlp.py --workers 2 --steps 2000
    python examples/train_mlp.py --resume --name train_mlp-... --steps 1000
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time


def rank0_value(value: float) -> float:
    """Rank 0's ``value`` on every worker (one small collective), so that every worker takes the
    same decision from it."""
    import torch

    import ray_train_xla as rtx

    if rtx.world_size() == 1:
        return value
    return rtx.broadcast(torch.tensor([value], device=rtx.get_device()), src=0).item()


class ReportCadence:
    """When to report (and checkpoint): at the same steps on every worker, never so often that
    the loop waits for Ray Train.

    With ``every_steps``, every that many steps (deterministic). Otherwise after the first step
    (where the loss started) and then about every ``every_s`` seconds. Every worker must report
    at the same steps (``save_checkpoint`` is called by all of them, like ``ray.train.report``),
    and their clocks differ slightly, so the clock is rank 0's: at a check, rank 0's time since
    the last report goes to every worker (``value_of_rank0``), and the next check is placed
    where that time should be up at the latest pace, so a check comes every few seconds, not
    every step. The last step always reports.
    """

    def __init__(self, last_step: int, every_s: float = 3.0, every_steps: int | None = None,
                 value_of_rank0=rank0_value):
        self.last_step, self.every_s, self.every_steps = last_step, every_s, every_steps
        self.value_of_rank0 = value_of_rank0
        self._report: tuple[float, int] | None = None  # (time, step) of the last report
        self._check = (0.0, 0)  # (seconds since the report, step) at the last check
        self._next_check = 0
        self._pace: float | None = None  # seconds per step, as last measured

    def due(self, step: int) -> bool:
        """Whether to report after ``step`` (call it on every worker, every step)."""
        if step >= self.last_step:
            return True
        if self.every_steps:
            return step % self.every_steps == 0
        if self._report is None:
            return True  # the first step of this run
        if step < self._next_check:
            return False
        elapsed = self.value_of_rank0(time.perf_counter() - self._report[0])
        seconds, at = self._check
        self._pace = max(elapsed - seconds, 1e-6) / max(step - at, 1)
        self._check = (elapsed, step)
        if elapsed >= self.every_s:
            return True
        self._next_check = step + max(1, math.ceil((self.every_s - elapsed) / self._pace))
        return False

    def reported(self, step: int) -> None:
        """Call after each report: the time to the next one starts now."""
        self._report = (time.perf_counter(), step)
        self._check = (0.0, step)
        ahead = math.ceil(self.every_s / self._pace) if self._pace else 1
        self._next_check = step + max(1, ahead)


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

    cadence = ReportCadence(last, config["report_every_s"], config["report_every"])
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
            if cadence.due(step):
                total = loss_total.item()
                rtx.save_checkpoint(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "step": step},
                    {"step": step, "loss": (total - reported_total) / (step - reported_step),
                     **rtx.metrics(step, execute_time=True)},
                )
                reported_total, reported_step = total, step
                cadence.reported(step)
            if step >= last:
                break
        skip = 0


def default_config(steps: int = 60, report_every_s: float = 3.0,
                   report_every: int | None = None) -> dict:
    """The example's sizes. Reports come about every ``report_every_s`` seconds of steps, or
    every ``report_every`` steps when that is given."""
    return {
        "samples": 512, "features": 8, "hidden": 32, "batch_size": 32, "lr": 0.05,
        "steps": steps, "report_every_s": report_every_s, "report_every": report_every,
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
    parser.add_argument("--report-every-s", type=float, default=3.0, metavar="SECONDS",
                        help="report and checkpoint about every SECONDS of steps (default 3.0; "
                        "Ray Train V2 takes one report per 2 s poll)")
    parser.add_argument("--report-every", type=int, default=None, metavar="N",
                        help="report and checkpoint every N steps instead (deterministic)")
    args = parser.parse_args()
    if args.resume and not args.name:
        parser.error("--resume needs the --name of the run to continue")
    args.name = args.name or time.strftime("train_mlp-%Y%m%d-%H%M%S")

    import ray

    ray.init(address="local", include_dashboard=False)  # never attach to a stale cluster
    try:
        config = default_config(args.steps, args.report_every_s, args.report_every)
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
