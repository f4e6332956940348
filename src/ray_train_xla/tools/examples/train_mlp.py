"""A small MLP on synthetic regression data with Ray Train, under any of the three configs.

The same training function runs on Trainium, TPU and CPU, under ``TorchXLAConfig``,
``TorchNeuronConfig`` or ``TorchTPUConfig`` (``--config xla|neuron|tpu``). By default: 2 CPU workers, a
checkpoint with the loss and XLA compile metrics every 20 steps (``--report-every``),
resumable: Ray Train restarts a failed worker group from the last checkpoint, and
``--resume --name RUN`` continues a finished run for ``--steps`` more (Ray Train V2 finds the
run's checkpoints under its storage path).

A run ends at its target step however often it restarts: the target (``--steps``, or with
``--resume`` the resumed checkpoint's step plus ``--steps``) is fixed when the run starts and kept
in every checkpoint, so a restart of the same run trains on to it, not ``--steps`` past it.

``save_checkpoint`` does not wait for Ray: it copies the state off the device and hands the
write and the report to a background thread, so the loop can report every few steps.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid

from ray_train_xla.tools.examples.cluster import (
    ExampleUsageError,
    add_cluster_args,
    add_config_arg,
    check_cluster,
    check_config,
    ray_session,
    resolve_device,
    scaling_config,
    torch_config,
)


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
    if state and config.get("run") and state.get("run") == config["run"]:
        last = state["last"]  # a restart of this run (after a failure): the same target
    elif state and config.get("more"):
        last = step + config["steps"]  # --resume: --steps more than the run resumed
    else:
        last = config["steps"]
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
                     "step": step, "last": last, "run": config.get("run")},
                    {"step": step, "loss": (total - reported_total) / (step - reported_step),
                     **rtx.metrics(step, execute_time=True)},
                )
                reported_total, reported_step = total, step
            crash_once(config, step)
            if step >= last:
                break
        skip = 0


def crash_once(config: dict, step: int) -> None:
    """``crash_at``: fail the run once after that step (every rank; a marker file per rank in
    ``marker_dir`` says it did), to see the restart from the last checkpoint."""
    if not config.get("crash_at") or step != config["crash_at"]:
        return
    import ray_train_xla as rtx

    marker_dir = config.get("marker_dir") or tempfile.gettempdir()
    os.makedirs(marker_dir, exist_ok=True)
    marker = os.path.join(marker_dir, f"train_mlp_crashed_rank{rtx.rank()}")
    if os.path.exists(marker):
        return
    open(marker, "w").close()
    rtx.flush_reports()  # the checkpoints so far reach Ray ...
    # ... and Ray Train V2 registers them when its controller next polls the workers.
    time.sleep(2.5 * float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")))
    raise RuntimeError(f"train_mlp: simulated crash after step {step}")


def default_config(steps: int = 60, report_every: int = 20) -> dict:
    """The example's sizes; a checkpoint every ``report_every`` steps and at the last."""
    return {
        "samples": 512, "features": 8, "hidden": 32, "batch_size": 32, "lr": 0.05,
        "steps": steps, "report_every": report_every,
    }


def build_trainer(workers: int, config: dict, storage_path: str, name: str, device: str = "cpu",
                  keep: int | None = 2, tpu_topology: str | None = None,
                  accelerator_type: str | None = None, config_name: str = "xla"):
    """A TorchTrainer for ``train_loop``, resumable under ``name``, with the config
    ``config_name`` (xla: TorchXLAConfig, neuron: TorchNeuronConfig, tpu: TorchTPUConfig);
    ``keep``: checkpoints kept (None: all). ``device`` (cpu, neuron or tpu): each worker asks
    Ray for one NeuronCore or TPU chip (on a TPU slice of ``tpu_topology`` and
    ``accelerator_type``)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import check_scaling_config

    chosen = torch_config(config_name, device, timeout_s=120)
    scaling = scaling_config(device, workers, 1, tpu_topology, accelerator_type)
    check_scaling_config(scaling, chosen)
    # This fit's id: a checkpoint carrying it is a restart of this run, which keeps its target.
    config = {**config, "run": uuid.uuid4().hex}
    return TorchTrainer(
        train_loop,
        train_loop_config=config,
        torch_config=chosen,
        scaling_config=scaling,
        run_config=RunConfig(
            storage_path=storage_path,
            name=name,
            checkpoint_config=CheckpointConfig(num_to_keep=keep),
            failure_config=FailureConfig(max_failures=1),
        ),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    add_config_arg(parser)
    add_cluster_args(parser)
    parser.add_argument("--storage-path", default=os.path.join(tempfile.gettempdir(), "train_mlp"),
                        help="where checkpoints go: a path every node reaches (shared "
                        "filesystem, s3://, gs://) on a cluster of several nodes")
    parser.add_argument("--name", default=None, help="run name (default: a new one)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run --name from its last checkpoint, --steps more")
    parser.add_argument("--report-every", type=int, default=20, metavar="N",
                        help="report and checkpoint every N steps (default 20; the loop does not "
                        "wait for Ray)")
    parser.add_argument("--crash-at", type=int, default=None, metavar="STEP",
                        help="fail once after this step (the run restarts from its last checkpoint)")
    args = parser.parse_args(argv)
    if args.resume and not args.name:
        parser.error("--resume needs the --name of the run to continue")
    args.name = args.name or time.strftime("train_mlp-%Y%m%d-%H%M%S")

    try:
        check_config(args.config, args.device)
        check_cluster(args.device, args.workers, args.tpu_topology, args.accelerator_type)
        with ray_session(args.address):
            config = default_config(args.steps, args.report_every)
            config.update(more=args.resume, crash_at=args.crash_at,
                          marker_dir=tempfile.mkdtemp(prefix="train_mlp-"))
            trainer = build_trainer(args.workers, config, args.storage_path, args.name,
                                    resolve_device(args.device), tpu_topology=args.tpu_topology,
                                    accelerator_type=args.accelerator_type,
                                    config_name=args.config)
            result = trainer.fit()
    except ExampleUsageError as exc:
        parser.error(str(exc))
    m = result.metrics or {}
    print(f"step {m.get('step')}: loss {m.get('loss'):.4f}, "
          f"{m.get('xla/compiles')} graphs compiled ({m.get('xla/compile_time_s', 0):.2f} s), "
          f"{m.get('xla/compiles_after_warmup')} after warm-up; checkpoint {result.checkpoint}")


if __name__ == "__main__":
    main()
