"""examples/finetune_hf.py through real Ray Train (the shared one-node cluster): the same
training function fine-tunes a small random Llama with Ray Data batches under
``TorchXLAConfig(spmd=True)`` (FSDPv2, one worker on 4 virtual XLA CPU devices),
``TorchNeuronConfig(device="cpu")`` and ``TorchTPUConfig(device="cpu")`` (FSDP2, 2 workers). Each
run fails once after its step-4 checkpoint and resumes from it within the same fit
(``FailureConfig``). Three fits, one per config, shared by the tests of that config.

The export test (``consolidate_hf``, then ``from_pretrained``) is skipped while
``ray_train_xla.tools.consolidate.consolidate_hf`` cannot be imported."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from conftest import connected

pytestmark = [pytest.mark.ray, pytest.mark.beside]

STEPS, CRASH_AT = 8, 4
BUCKETS = [64, 128]


@pytest.fixture(scope="module")
def cluster(one_node):
    with connected(one_node):
        yield one_node


def example():
    from ray_train_xla.tools.demo import load_example

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return load_example(os.path.join(root, "examples", "finetune_hf.py"))


def read_logs(out_dir: str) -> dict[int, list[dict]]:
    logs = {}
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".jsonl"):
            with open(os.path.join(out_dir, name)) as f:
                logs[int(name[len("rank"):-len(".jsonl")])] = [json.loads(line) for line in f]
    return logs


@pytest.fixture(scope="module", params=["xla", "neuron", "tpu"])
def run(request, cluster, tmp_path_factory):
    """One fit of the example on this config: 8 steps, a crash after step 4, a resume."""
    name = request.param
    ft = example()
    tmp = tmp_path_factory.mktemp(f"finetune-{name}")
    out = tmp / "out"
    out.mkdir()
    workers = 1 if name == "xla" else 2
    # Two buckets (the example's default has three): fewer graphs for XLA to compile here, and
    # still more than one length to pad to.
    config = ft.ft_config(steps=STEPS, crash_at=CRASH_AT, checkpoint_every=4, eval_every=2,
                          warmup=2, batch_size=4, buckets=BUCKETS, marker_dir=str(tmp),
                          out_dir=str(out))
    trainer = ft.build_trainer(
        config, ft.torch_config(name, "cpu", 4 if name == "xla" else None),
        ft.scaling_config(name, "cpu", workers), str(tmp / "results"), f"finetune-{name}",
        texts=ft.builtin_corpus(120), max_failures=1)
    result = trainer.fit()
    return SimpleNamespace(name=name, ft=ft, result=result, logs=read_logs(str(out)),
                           out=out, tmp=tmp, workers=workers, config=config)


def test_trains_fails_once_and_resumes_from_its_checkpoint(run):
    assert os.path.exists(run.tmp / "finetune_hf_crashed_rank0")  # it did fail once
    assert sorted(run.logs) == list(range(run.workers))
    for rank, events in run.logs.items():
        starts = [e for e in events if e["event"] == "start"]
        steps = [e for e in events if e["event"] == "step"]
        # A fresh start, then one restart from the step-4 checkpoint at the data position that
        # step reached; every step trained exactly once.
        assert [s["resumed_from"] for s in starts] == [None, CRASH_AT], rank
        at_crash = next(s for s in steps if s["step"] == CRASH_AT)
        assert (starts[1]["epoch"], starts[1]["position"]) == (at_crash["epoch"],
                                                               at_crash["position"])
        assert at_crash["position"] > 0
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), rank
    m = run.result.metrics
    assert m["step"] == STEPS
    reports = [e for e in run.logs[0] if e["event"] == "report"]
    assert [r["step"] for r in reports] == [2, 4, 6, 8]
    # The loss goes down (from about ln(264) = 5.6 for random weights).
    evals = [r["eval_loss"] for r in reports]
    assert evals[-1] < evals[0] - 0.2, evals
    assert reports[-1]["loss"] < reports[0]["loss"], [r["loss"] for r in reports]
    assert m["eval_loss"] == pytest.approx(evals[-1]) and m["tokens_per_s"] > 0
    assert m["bf16"] is False  # fp32 on the CPU
    if run.name == "xla":
        # XLA compiles per bucket, not per length: at most a train and an eval graph per
        # bucket in the restarted process, and two more (the optimizer's priming, the load).
        assert 0 < m["xla/compiles"] <= 2 * len(run.config["buckets"]) + 2, m
    else:
        assert m["xla/compiles"] == 0  # native eager: torch.compile graphs only, none here
    names = set(os.listdir(run.result.checkpoint.path))
    assert {".metadata", "extra.pt", "sharded.json"} <= names


def test_export_loads_with_from_pretrained_and_gives_the_trained_logits(run, tmp_path):
    try:
        from ray_train_xla.tools.consolidate import consolidate_hf  # noqa: F401
    except ImportError:
        pytest.skip("ray_train_xla.tools.consolidate.consolidate_hf is not on this branch yet")
    import torch
    from transformers import AutoModelForCausalLM

    hf_dir = str(tmp_path / "hf")
    run.ft.export_hf(run.result.checkpoint.path, hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=run.ft.probe_ids(model.config.vocab_size)).logits
    trained = torch.load(run.out / "probe_logits.pt")
    untrained = run.ft.make_model(run.config).eval()
    with torch.no_grad():
        initial = untrained(input_ids=run.ft.probe_ids(model.config.vocab_size)).logits
    assert not torch.allclose(trained, initial, atol=1e-3)  # it trained
    assert torch.allclose(logits, trained, atol=1e-4, rtol=1e-4), (logits - trained).abs().max()
