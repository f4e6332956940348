"""Hugging Face Transformers' ``Trainer`` on the XLA device with default ``TrainingArguments``,
without Ray: what an XLA worker's start-up installs (``startup/ray_helpers.install``) makes the
default optimizer (``adamw_torch_fused`` with torch >= 2.8, whose fused kernel refuses XLA
parameters) train. Each case runs in a fresh process on one XLA CPU device; one with
Transformers imported before the worker's start-up, one imported after it (by the training
function)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SRC_DIR = os.path.join(os.path.dirname(TESTS_DIR), "src")

SCRIPT = r"""
import json, logging, sys, tempfile
import torch
if sys.argv[1] == "before":
    import transformers.trainer  # imported before the worker's start-up
from ray_train_xla.startup import ray_helpers
ray_helpers.install(spmd=False)
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("ray_train_xla.startup.ray_helpers").addHandler(Keep())

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))

class Repeating(torch.utils.data.Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        ids = (torch.arange(8) + i) % 32
        return {"input_ids": ids, "labels": ids.clone()}

args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=4,
                         report_to=[], save_strategy="no", logging_steps=1, learning_rate=3e-2)
asked = str(getattr(args.optim, "value", args.optim))
trainer = Trainer(model=model, args=args, train_dataset=Repeating())
trainer.train()
ray_helpers.uninstall()
print(json.dumps({
    "asked": asked, "device": str(args.device),
    "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                      else trainer.optimizer).__name__,
    "fused": [g.get("fused") for g in trainer.optimizer.param_groups],
    "optim_after": str(getattr(trainer.args.optim, "value", trainer.args.optim)),
    "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    "param_device": next(trainer.model.parameters()).device.type,
    "restored": Trainer.create_optimizer.__module__,
    "warnings": warnings,
}))
"""


def _run(order: str) -> subprocess.Popen:
    env = dict(os.environ, PJRT_DEVICE="CPU", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "XLA_USE_SPMD"):
        env.pop(key, None)
    return subprocess.Popen([sys.executable, "-c", SCRIPT, order], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs():
    procs = {order: _run(order) for order in ("before", "after")}
    out = {}
    for order, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            proc.kill()
        assert proc.returncode == 0, stderr[-4000:]
        out[order] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("order", ["before", "after"])
def test_default_training_arguments_train_on_xla(runs, order):
    rec = runs[order]
    assert rec["asked"] == "adamw_torch_fused"  # TrainingArguments' default with torch >= 2.8
    assert rec["device"].startswith("xla") and rec["param_device"] == "xla"
    assert rec["optimizer"] == "AdamW" and rec["fused"] == [None, None]
    assert rec["optim_after"] == "adamw_torch"
    assert len(rec["losses"]) == 2 and all(loss == loss for loss in rec["losses"])
    assert len(rec["warnings"]) == 1
    assert 'optim="adamw_torch_fused"' in rec["warnings"][0]
    assert 'optim="adamw_torch"' in rec["warnings"][0]
    assert rec["restored"] == "transformers.trainer"  # uninstall put Transformers' method back
