"""A small decoder-only transformer language model, trained sharded with Ray Data batches.

Random initialisation from a config, no downloads: a model of our own (token and position
embeddings, pre-norm blocks of causal self-attention and an MLP, a language-model head) on a
synthetic language whose next token follows from the previous one, with noise. One SPMD worker
per node shards every parameter, gradient and Adam state over its devices
(``rtx.prepare_sharded_model``); checkpoints are sharded (every rank writes its own shards);
a failed run restarts from the last checkpoint and ends where an uninterrupted run ends.
Loss, compile counts and a checkpoint are reported every 10 steps (``--report-every N``) and at
the last; ``save_checkpoint`` copies this rank's shards off the devices and writes and reports
them in a background thread, so the loop does not wait for Ray.

Under ``TorchXLAConfig`` (``--config xla``, the default) the model is sharded with FSDPv2 over
the devices of SPMD workers: on accelerators (``--device neuron`` / ``tpu``) each SPMD worker
asks Ray for ``--devices`` NeuronCores or TPU chips, one worker per node (``--workers``, the
nodes), all of its devices in the mesh. Under ``TorchNeuronConfig`` or ``TorchTPUConfig``
(``--config neuron`` / ``tpu``) it is sharded with FSDP2 over ``--workers`` workers of one
device each (CPU workers with gloo on the CPU), each reading its own shard of the batches.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

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

VOCAB, SEQ = 64, 32


def lm_config(**overrides) -> dict:
    """Model, data and training sizes (every model dimension divisible by 8 devices), and the
    report cadence: a checkpoint every ``report_every`` steps and at the last."""
    config = {"vocab": VOCAB, "seq": SEQ, "dim": 64, "heads": 4, "layers": 2, "ff": 256,
              "rows": 256, "batch_size": 16, "lr": 3e-3, "steps": 40, "report_every": 10,
              "crash_at": None, "seed": 0}
    config.update(overrides)
    return config


def make_model(config: dict):
    """The transformer (plain torch), initialised from ``config["seed"]``."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, dim: int, heads: int, ff: int):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.ff1, self.ff2 = nn.Linear(dim, ff), nn.Linear(ff, dim)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.ff2(torch.nn.functional.gelu(self.ff1(self.ln2(x))))

    class TinyLM(nn.Module):
        def __init__(self, c: dict):
            super().__init__()
            self.tok = nn.Embedding(c["vocab"], c["dim"])
            self.pos = nn.Embedding(c["seq"], c["dim"])
            self.blocks = nn.Sequential(*[Block(c["dim"], c["heads"], c["ff"]) for _ in range(c["layers"])])
            self.ln = nn.LayerNorm(c["dim"])
            self.head = nn.Linear(c["dim"], c["vocab"], bias=False)

        def forward(self, tokens):
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            return self.head(self.ln(self.blocks(self.tok(tokens) + self.pos(positions))))

    torch.manual_seed(config["seed"])
    return TinyLM(config)


def make_tokens(batch: dict) -> dict:
    """Ray Data ``map_batches``: row ``id`` -> a sequence of SEQ + 1 tokens of the synthetic
    language (next = 5 * previous + 3 mod VOCAB, one token in eight random), from ``id`` alone."""
    import numpy as np

    rows = []
    for i in batch["id"]:
        rng = np.random.default_rng(int(i))
        seq = [int(rng.integers(VOCAB))]
        for _ in range(SEQ):
            nxt = (5 * seq[-1] + 3) % VOCAB
            seq.append(int(rng.integers(VOCAB)) if rng.random() < 0.125 else nxt)
        rows.append(seq)
    return {"tokens": np.array(rows, dtype=np.int64)}


def make_dataset(config: dict):
    import ray.data

    return ray.data.range(config["rows"]).map_batches(make_tokens, batch_size=64)


def lm_loss(model, tokens):
    import torch

    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train_loop(config: dict) -> None:
    """The training function: sharded model, Ray Data batches, sharded checkpoints, resume."""
    import ray.train
    import torch

    import ray_train_xla as rtx

    spmd = config.get("spmd", True)  # FSDPv2 under SPMD; else FSDP2, one device per worker

    model = rtx.prepare_sharded_model(make_model(config))
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    state = rtx.load_checkpoint(model, optimizer)  # this rank's shards; None on a fresh start
    step = state["step"] if state else 0
    # Each worker reads its own shard of the rows (Ray Data splits them equally).
    workers = ray.train.get_context().get_world_size()
    steps_per_epoch = config["rows"] // workers // config["batch_size"]
    shard = ray.train.get_dataset_shard("train")
    monitor = rtx.CompileMonitor(warmup_steps=2)
    marker_dir = config.get("marker_dir") or tempfile.gettempdir()
    os.makedirs(marker_dir, exist_ok=True)  # made by the driver, which may be on another node
    crash_marker = os.path.join(marker_dir, "train_lm_crashed")  # one per node: SPMD workers
    while step < config["steps"]:
        skip = step % steps_per_epoch  # resuming mid-epoch: skip the batches already trained on
        # CPU batches: shard_batch moves each one to the devices and splits it over the mesh.
        batches = shard.iter_torch_batches(batch_size=config["batch_size"], drop_last=True,
                                           device="cpu")
        for i, batch in enumerate(batches):
            if i < skip:
                continue
            tokens = (rtx.shard_batch(batch["tokens"]) if spmd
                      else batch["tokens"].to(rtx.get_device()))  # this worker's own rows
            optimizer.zero_grad()
            loss = lm_loss(model, tokens)
            loss.backward()
            optimizer.step()  # the sharded paths reduce the gradients themselves
            rtx.sync()
            step += 1
            metrics = monitor.metrics(step)
            if step % config["report_every"] == 0 or step >= config["steps"]:
                # wait=True only when a test asks what each rank wrote
                written = rtx.save_checkpoint(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                    {"step": step, "loss": loss.item(), **metrics}, wait=bool(config.get("out_dir")),
                )
                if written and config.get("out_dir"):
                    with open(os.path.join(config["out_dir"], f"ckpt_step{step}_rank{rtx.rank()}"), "w") as f:
                        f.write(str(written["bytes"]))
            if config["crash_at"] and step == config["crash_at"] and not os.path.exists(crash_marker):
                open(crash_marker, "w").close()
                rtx.flush_reports()  # the checkpoints so far reach Ray ...
                # ... and Ray Train V2 registers them when its controller next polls the workers
                # (every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default).
                time.sleep(2.5 * float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")))
                raise RuntimeError(f"train_lm: simulated crash after step {step}")
            if step >= config["steps"]:
                break
    if config.get("out_dir") and rtx.rank() == 0:
        full = {k.replace("_orig_module.", ""): v.cpu() for k, v in model.state_dict().items()}
        torch.save(full, os.path.join(config["out_dir"], "final_params.pt"))


def check_workers(device: str, workers: int, config_name: str = "xla") -> None:
    """SPMD on the CPU is one worker (``--config xla``)."""
    if config_name == "xla" and device == "cpu" and workers != 1:
        raise ExampleUsageError(
            f"--workers {workers} with --device cpu: SPMD on the CPU is one worker whose mesh is "
            "its --devices virtual devices (torch_xla's CPU client has no collectives across "
            "processes)")


def build_trainer(config: dict, devices: int, storage_path: str, name: str, device: str = "cpu",
                  keep: int | None = 2, workers: int = 1, tpu_topology: str | None = None,
                  accelerator_type: str | None = None, config_name: str = "xla"):
    """A TorchTrainer for ``train_loop``. ``config_name`` xla: ``workers`` SPMD workers (one per
    node), each with ``devices`` XLA CPU devices (one worker only) or asking Ray for ``devices``
    NeuronCores / TPU chips (on a TPU slice of ``tpu_topology`` and ``accelerator_type``);
    neuron or tpu: ``workers`` workers of one device each (``devices`` unused), FSDP2. The token
    dataset, restarts on failure; ``keep``: checkpoints kept (None: all)."""
    from ray.data import ExecutionOptions
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import check_scaling_config

    check_workers(device, workers, config_name)
    if config_name != "xla":
        chosen = torch_config(config_name, device, timeout_s=300)
        per_worker = 1
    elif device == "cpu":
        chosen = torch_config("xla", "cpu", spmd=True, cpu_devices_per_worker=devices,
                              timeout_s=300)
        per_worker = devices
    else:
        chosen, per_worker = torch_config("xla", device, spmd=True), devices
    scaling = scaling_config(device, workers, per_worker, tpu_topology, accelerator_type)
    check_scaling_config(scaling, chosen)
    return TorchTrainer(
        train_loop,
        train_loop_config={**config, "spmd": config_name == "xla"},
        torch_config=chosen,
        scaling_config=scaling,
        datasets={"train": make_dataset(config)},
        # The same batches in the same order every epoch and after a restart.
        dataset_config=DataConfig(execution_options=ExecutionOptions(preserve_order=True)),
        run_config=RunConfig(storage_path=storage_path, name=name,
                             checkpoint_config=CheckpointConfig(num_to_keep=keep),
                             failure_config=FailureConfig(max_failures=1)),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4,
                        help="each SPMD worker's devices: virtual XLA CPU devices with --device "
                        "cpu, else the NeuronCores / TPU chips asked of Ray (default 4)")
    parser.add_argument("--workers", type=int, default=1,
                        help="--config xla: SPMD workers, one per node (default 1; 1 with "
                        "--device cpu); neuron or tpu: workers of one device each")
    add_config_arg(parser)
    add_cluster_args(parser)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--crash-at", type=int, default=None, help="fail once after this step")
    parser.add_argument("--storage-path", default=os.path.join(tempfile.gettempdir(), "train_lm"),
                        help="where checkpoints go: a path every node reaches (shared "
                        "filesystem, s3://, gs://) on a cluster of several nodes")
    parser.add_argument("--report-every", type=int, default=10, metavar="N",
                        help="report and checkpoint every N steps (default 10; the loop does not "
                        "wait for Ray)")
    args = parser.parse_args(argv)

    try:
        check_config(args.config, args.device)
        check_workers(args.device, args.workers, args.config)
        check_cluster(args.device, args.workers, args.tpu_topology, args.accelerator_type)
        with ray_session(args.address):
            config = lm_config(steps=args.steps, crash_at=args.crash_at,
                               report_every=args.report_every,
                               marker_dir=tempfile.mkdtemp(prefix="train_lm-"))
            result = build_trainer(config, args.devices, args.storage_path,
                                   time.strftime("train_lm-%Y%m%d-%H%M%S"),
                                   resolve_device(args.device), workers=args.workers,
                                   tpu_topology=args.tpu_topology,
                                   accelerator_type=args.accelerator_type,
                                   config_name=args.config).fit()
    except ExampleUsageError as exc:
        parser.error(str(exc))
    m = result.metrics or {}
    print(f"step {m.get('step')}: loss {m.get('loss'):.4f}, {m.get('xla/compiles')} graphs compiled, "
          f"{m.get('xla/compiles_after_warmup')} after warm-up; checkpoint {result.checkpoint}")


if __name__ == "__main__":
    main()
