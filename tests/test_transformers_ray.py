"""Hugging Face Transformers' Trainer on the XLA device inside a Ray training function, on CPU
workers: a tiny Llama built from a config (no downloads), Ray's ``prepare_trainer`` and
``RayTrainReportCallback``, the default ``TrainingArguments`` optimizer. Checked: the loss falls,
the gradients the optimizer applies are the average of the workers' gradients, checkpoints
reach Ray."""

from __future__ import annotations

import os
import tempfile

import pytest

from conftest import fit, write_record

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

pytest.importorskip("transformers")

STEPS, SAVE_EVERY = 8, 4


def train_hf(config):
    import ray.train
    import torch
    import torch_xla.runtime as xr
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    rank, world = xr.global_ordinal(), xr.world_size()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))

    class Repeating(torch.utils.data.Dataset):
        """A learnable sequence: token t is followed by t + 1."""

        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = (torch.arange(8) + i) % 32
            return {"input_ids": ids, "labels": ids.clone()}

    grads: dict[str, list] = {"before": [], "after": []}
    local: list = []

    def keep_local(param):
        # Right after backward, before Accelerate reduces the gradients (in clip_grad_norm_,
        # which the Trainer calls every step, or in the optimizer step).
        local.append(param.grad.detach().reshape(-1)[:16].clone())

    class GradientProbe(TrainerCallback):
        """The lm_head gradient of this worker's backward pass and the one the optimizer applied
        (averaged across workers)."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            # On the parameter the Trainer trains: moving to XLA made new Parameter objects.
            model.lm_head.weight.register_post_accumulate_grad_hook(keep_local)

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads["before"].append(local.pop().cpu().tolist())
            grads["after"].append(model.lm_head.weight.grad.detach().cpu().reshape(-1)[:16].tolist())

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="rtx-hf-"), per_device_train_batch_size=4,
        # optim left at its default (adamw_torch_fused with torch >= 2.8): the worker's start-up
        # makes it the unfused AdamW, whose fused kernel would refuse XLA parameters.
        max_steps=STEPS, learning_rate=3e-2,
        max_grad_norm=0.0,  # no clipping: the gradients are reduced inside optimizer.step()
        logging_steps=1, save_strategy="steps", save_steps=SAVE_EVERY, report_to=[],
        dataloader_drop_last=True, use_cpu=False, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Repeating(),
                      callbacks=[RayTrainReportCallback(), GradientProbe()])
    trainer = prepare_trainer(trainer)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    write_record(config, f"rank{rank}", {
        "rank": rank, "world": world, "args_world": trainer.args.world_size,
        "process_index": trainer.args.process_index, "device": str(trainer.args.device),
        "param_device": next(trainer.model.parameters()).device.type,
        "losses": losses, "grads": grads,
        "optim": str(getattr(trainer.args.optim, "value", trainer.args.optim)),
        "checkpoint_seen": ray.train.get_checkpoint() is not None,
    })


def test_transformers_trainer_on_xla_cpu_workers(ray_local):
    # Two workers (one process with the whole batch is the same code with nothing to average).
    workers = 2
    result, records = fit(train_hf, num_workers=workers)
    records = sorted(records, key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == list(range(workers))
    for rec in records:
        assert rec["world"] == rec["args_world"] == workers and rec["process_index"] == rec["rank"]
        assert rec["device"].startswith("xla") and rec["param_device"] == "xla"
        assert rec["optim"] == "adamw_torch"  # the default, unfused on the XLA worker
        losses = rec["losses"]
        assert len(losses) == STEPS and losses[-1] < 0.8 * losses[0], losses
        assert len(rec["grads"]["before"]) == len(rec["grads"]["after"]) == STEPS
    # The optimizer applied the mean of the workers' own gradients, identical on every worker.
    import numpy as np

    for step in range(STEPS):
        before = np.array([rec["grads"]["before"][step] for rec in records])
        for rec in records:
            np.testing.assert_allclose(rec["grads"]["after"][step], before.mean(axis=0),
                                       rtol=1e-4, atol=1e-6)
    # The workers' own gradients differ: they saw different rows.
    assert not np.allclose(records[0]["grads"]["before"][0], records[1]["grads"]["before"][0])
    # Checkpoints reached Ray: the run's latest holds the Trainer's checkpoint directory.
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as path:
        names = os.listdir(os.path.join(path, "checkpoint"))
    assert "model.safetensors" in names or "pytorch_model.bin" in names, names
