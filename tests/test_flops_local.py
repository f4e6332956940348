"""Model FLOPs and MFU (``toolkit/observability/flops.py``, ``planning/peaks.py``, the
timeline's TFLOP/s and MFU): the decoder formula against torch's own ``FlopCounterMode`` on a
Llama and a Qwen2, a stack of matmuls of known FLOPs, the peak table, and the timeline's
figures from a step time it measured."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import ray_train_xla as rtx
from ray_train_xla.planning.peaks import LNC_VAR, PEAKS, device_peak, neuron_peak, peak_tflops
from ray_train_xla.toolkit import runtime as rt_mod
from ray_train_xla.toolkit.observability import timeline as tl_mod
from ray_train_xla.toolkit.observability.flops import (
    HF_DECODER,
    NO_MODEL,
    SIX_N,
    THE_CALL,
    batch_counts,
    cpu_peak_tflops,
    flops_rule,
    note_model,
)
from ray_train_xla.toolkit.observability.timeline import Timeline
from ray_train_xla.toolkit.runtime import TimelineOptions, runtime

from conftest import HAS_TORCH_XLA

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.13

SEQ, BATCH = 64, 2


@pytest.fixture(scope="module", autouse=True)
def xla_device_first():
    """torch's autograd engine sizes its per-device queues at a process's first backward, from
    the devices known then: with torch_xla's device started first, later tests that run XLA
    backward passes in this process still find a queue for it."""
    from conftest import HAS_TORCH_XLA

    if HAS_TORCH_XLA:
        import torch_xla

        torch_xla.device()


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=3,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
                       tie_word_embeddings=False, attn_implementation="eager")


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=3,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=SEQ,
                       tie_word_embeddings=True, attn_implementation="eager")


@pytest.mark.parametrize("make", [_llama, _qwen2], ids=["llama", "qwen2-tied"])
def test_the_formula_is_flop_counter_modes_count_of_a_forward_and_backward(make):
    from transformers import AutoModelForCausalLM

    config = make()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    counted = rtx.count_flops(step)
    per_token = rtx.model_flops_per_token(config, seq_len=SEQ)
    # The config and the model give the same figure.
    assert rtx.model_flops_per_token(model, seq_len=SEQ) == per_token
    assert per_token * BATCH * SEQ == pytest.approx(counted, rel=0.01), (per_token * BATCH * SEQ,
                                                                       counted)
    # The attention term is what changes with the length; halved, MaxText's count.
    layers, heads, head_dim = 3, 8, 16
    attention = 12 * layers * heads * head_dim * SEQ
    assert per_token - rtx.model_flops_per_token(config, SEQ, causal_half=True) == attention / 2
    # The input embedding is a lookup: not counted; the output projection is, tied or not.
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert per_token == 6 * linear + attention
    assert model.lm_head.weight.numel() == config.vocab_size * config.hidden_size
    with pytest.raises(ValueError, match="seq_len"):
        rtx.model_flops_per_token(config, seq_len=0)


def test_with_sdpa_on_cpu_the_counter_may_miss_attention_and_only_attention():
    """torch's CPU flash-attention kernel of ``scaled_dot_product_attention`` has no entry in
    ``FlopCounterMode``'s table on torch 2.9 (its count is then the matmul weights' alone): the
    difference is the attention term, exactly, and nothing else."""
    from transformers import AutoModelForCausalLM

    config = _llama()
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    counted = rtx.count_flops(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss.backward())
    per_token = rtx.model_flops_per_token(config, seq_len=SEQ)
    attention = 12 * 3 * 8 * 16 * SEQ
    assert counted in (per_token * BATCH * SEQ, (per_token - attention) * BATCH * SEQ), counted


def test_gpt2s_conv1d_counts_and_a_model_it_cannot_count_is_refused_naming_count_flops():
    """GPT-2's matmuls are transformers' Conv1D: counted, equal to FlopCounterMode's count. A
    model with weights of another kind (a convolution) or a config without layers and heads is
    refused, never counted short."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ,
                        attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 256, (BATCH, SEQ))
    counted = rtx.count_flops(lambda: model(input_ids=ids, labels=ids).loss.backward())
    assert rtx.model_flops_per_token(model, SEQ) * BATCH * SEQ == pytest.approx(counted, rel=0.01)
    model.transformer.add_module("stem", torch.nn.Conv2d(3, 8, 3))
    with pytest.raises(ValueError, match="stem \\(Conv2d\\).*count_flops"):
        rtx.model_flops_per_token(model, SEQ)
    with pytest.raises(ValueError, match="config without num_hidden_layers.*count_flops"):
        rtx.model_flops_per_token(torch.nn.Linear(4, 4), SEQ)


def test_a_stack_of_matmuls_counts_its_known_flops():
    a, w = torch.randn(32, 48), [torch.randn(48, 48) for _ in range(5)]

    def stack():
        x = a
        for m in w:
            x = x @ m
        return x

    assert rtx.count_flops(stack) == 5 * 2 * 32 * 48 * 48


def test_the_peak_table_is_keyed_by_device_and_generation():
    assert peak_tflops("trn1") == 95.0
    assert peak_tflops("trn2.48xlarge") == 158.0  # a logical NeuronCore at LNC=2
    assert peak_tflops("trn2", logical_cores=1) == 79.0
    assert peak_tflops("trn3") == 158.0 and peak_tflops("trn3", "fp8") is None
    assert peak_tflops("v4-16") == 275.0 and peak_tflops("TPU-V5E") == 197.0
    assert peak_tflops("v5litepod-16") == 197.0 and peak_tflops("v5p-128") == 459.0
    assert peak_tflops("v6e-16") == 918.0
    assert peak_tflops("tpu7x-32") == 1153.5 and peak_tflops("v7x", "fp8") == 2307.0
    assert peak_tflops("h100") is None and device_peak("") is None
    assert all(p.source.startswith("https://") for p in PEAKS.values())
    with pytest.raises(ValueError, match="bf16"):
        peak_tflops("v4", "fp16")


def test_each_peak_is_its_sources_published_figure_and_the_arithmetic_it_states():
    """Every entry's source names one published figure and the arithmetic that makes it one
    device's; and the arithmetic holds (``plan`` prints the source beside the figure)."""
    import re

    number = r"([\d,]+(?:\.\d+)?)"
    for key, peak in PEAKS.items():
        found = re.search(rf": {number} BF16 .*?TFLOPS per (.+?); per device: BF16 {number}"
                          rf"(?: ([x/]) {number} = {number})?", peak.source)
        assert found, (key, peak.source)
        published, _, first, op, by, result = found.groups()
        value = float(published.replace(",", ""))
        assert float(first.replace(",", "")) == value, (key, peak.source)
        if op:
            share = float(by) if op == "x" else 1 / float(by)
            assert value * share == float(result.replace(",", "")) == peak.bf16, (key, peak.source)
        else:
            assert value == peak.bf16, (key, peak.source)
    trn2 = PEAKS["trn2"].source
    assert "neuron-core-v3.html: 79 BF16 and 158 cFP8 TFLOPS per NeuronCore-v3; per device: " \
           "BF16 79 x 2 = 158, cFP8 158 x 2 = 316" in trn2
    assert "667 BF16 and 1,299 FP8 per chip of 8 NeuronCore-v3 (83.4 and 162.4 a core), not " \
           "8 x 79 = 632" in trn2
    assert "671 BF16 per chip of 8 NeuronCore-v4 (83.9 a core)" in PEAKS["trn3"].source
    assert 667 / 8 == pytest.approx(83.4, abs=0.05) and 671 / 8 == pytest.approx(83.9, abs=0.05)


def test_the_trainium_peak_follows_the_instance_type_and_the_logical_core_config():
    """What a Neuron worker knows without a network: the instance type its firmware names, and
    NEURON_LOGICAL_NC_CONFIG (Trainium2 and 3 group 2 physical cores unless it says 1)."""
    assert neuron_peak("trn2.48xlarge\n", {}).bf16 == 158.0
    assert neuron_peak("trn2.48xlarge", {LNC_VAR: "2"}).bf16 == 158.0
    assert neuron_peak("trn2u.48xlarge", {LNC_VAR: "1"}).bf16 == 79.0
    assert neuron_peak("trn3.48xlarge", {LNC_VAR: " 1 "}).bf16 == 79.0
    assert neuron_peak("trn1.32xlarge", {LNC_VAR: "1"}).bf16 == 95.0  # Trn1: no LNC
    assert neuron_peak("trn1n.32xlarge", {}).bf16 == 95.0
    for other in ("", "inf2.48xlarge", "m5.large", "Standard PC (Q35 + ICH9, 2009)"):
        assert neuron_peak(other, {}) is None


def test_a_neuron_worker_finds_its_peak_or_says_why_not(monkeypatch, tmp_path, caplog):
    product = tmp_path / "product_name"
    product.write_text("trn2.48xlarge\n")
    assert tl_mod.instance_type(str(product)) == "trn2.48xlarge"
    assert tl_mod.instance_type(str(tmp_path / "missing")) == ""
    monkeypatch.setattr(tl_mod, "instance_type", lambda: "trn2.48xlarge")
    monkeypatch.delenv(LNC_VAR, raising=False)
    assert tl_mod.device_peak("neuron")[0] == 158.0
    monkeypatch.setenv(LNC_VAR, "1")
    peak, source = tl_mod.device_peak("neuron")
    assert peak == 79.0 and source == ("the published bf16 peak of a Trainium2 physical "
                                       "NeuronCore-v3 (LNC=1), from instance type "
                                       "'trn2.48xlarge', NEURON_LOGICAL_NC_CONFIG=1")
    monkeypatch.setattr(tl_mod, "instance_type", lambda: "")
    tl = Timeline(device="neuron", rank=3)
    with caplog.at_level("WARNING", logger=tl_mod.__name__):
        assert tl.peak_tflops() is None and tl.peak_tflops() is None
    (warning,) = [r.getMessage() for r in caplog.records]  # once
    assert warning.startswith("rank 3: timeline: no published peak for an instance type not "
                              "named here (/sys/devices/virtual/dmi/id/product_name unreadable)")
    assert "give the config's peak_tflops or configure_timeline(peak_tflops=...)" in warning
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-16")
    assert tl_mod.device_peak("tpu") == (918.0, "the published bf16 peak of a TPU v6e chip, "
                                                "from TPU_ACCELERATOR_TYPE='v6e-16'")


def test_the_cpu_probe_measures_a_positive_rate():
    assert 0 < cpu_peak_tflops(size=128, seconds=0.05) < 100


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_the_timeline_gives_tflops_and_mfu_of_the_steps_it_timed(monkeypatch):
    monkeypatch.setattr(tl_mod, "instance_type", lambda: "")  # a Neuron worker off EC2
    rt_mod.begin()
    clock = Clock(10.0)
    tl = Timeline(attempt="A", rank=0, world=1, device="neuron", clock=clock,
                  options=lambda: runtime().options(TimelineOptions))
    flops = 4e12
    try:
        for t in (10.5, 11.0, 11.5, 12.0):  # 0.5 s steps
            clock.t = t
            tl.on_step(0)
        assert "timeline/tflops_per_s" not in tl.report_metrics()  # nothing said: no figure
        tl_mod.configure_timeline(flops_per_step=flops)
        for t in (12.4, 12.8):  # 0.4 s steps
            clock.t = t
            tl.on_step(0)
        out = tl.report_metrics()
        assert out["timeline/tflops_per_s"] == pytest.approx(flops / 0.4 / 1e12, rel=0.01)
        assert "timeline/mfu" not in out  # no peak known for this device here: none invented
        tl_mod.configure_timeline(peak_tflops=20.0)
        clock.t = 13.2
        tl.on_step(0)
        out = tl.report_metrics()
        assert out["timeline/mfu"] == pytest.approx(flops / 0.4 / 1e12 / 20.0, rel=0.01)
        with pytest.raises(ValueError, match="peak_tflops"):
            tl_mod.configure_timeline(peak_tflops=30.0)
        with pytest.raises(ValueError, match="flops_per_step"):
            tl_mod.configure_timeline(flops_per_step=-1)
    finally:
        rt_mod.end()


def test_the_configs_peak_is_the_timelines_and_configure_timeline_may_not_change_it(monkeypatch):
    """``peak_tflops`` on the config reaches the worker through its planned environment and
    starts the timeline's options: MFU is taken against it, and a configure_timeline that gives
    another peak raises, naming both values."""
    from ray_train_xla import TorchNeuronConfig
    from ray_train_xla.planning import Rendezvous, contract, plan
    from ray_train_xla.planning.topology import Topology

    env = plan(Topology.uniform([1]), TorchNeuronConfig(device="cpu", peak_tflops=79.0),
               Rendezvous(master_addr="10.0.0.1", master_port=29500, run_id="r"), "cpu")[0].env
    monkeypatch.setenv(contract.PEAK_TFLOPS_VAR, env[contract.PEAK_TFLOPS_VAR])
    contract.reload()
    rt_mod.begin()
    try:
        clock = Clock(10.0)
        tl = Timeline(device="cpu", clock=clock, options=lambda: runtime().options(TimelineOptions))
        assert tl.peak() == (79.0, "given: the config's or configure_timeline's peak_tflops")
        tl_mod.configure_timeline(flops_per_step=7.9e12, peak_tflops=79.0)  # the same: fine
        for t in (11.0, 12.0):
            clock.t = t
            tl.on_step(0)
        assert tl.report_metrics()["timeline/mfu"] == pytest.approx(0.1)  # 7.9 TFLOP/s of 79
        with pytest.raises(ValueError) as info:
            tl_mod.configure_timeline(peak_tflops=95.0)
        assert str(info.value) == ("configure_timeline: peak_tflops=95.0 conflicts with "
                                   "peak_tflops=79.0, which the config's peak_tflops field sets")
    finally:
        rt_mod.end()
        monkeypatch.delenv(contract.PEAK_TFLOPS_VAR)
        contract.reload()
    rt_mod.begin()
    try:  # without it on the config, configure_timeline gives it
        tl_mod.configure_timeline(peak_tflops=95.0)
        assert runtime().options(TimelineOptions).peak_tflops == 95.0
    finally:
        rt_mod.end()


def test_on_cpu_the_peak_is_a_probe_measured_once():
    rt_mod.begin()
    try:
        tl = Timeline(device="cpu", options=lambda: runtime().options(TimelineOptions))
        first = tl.peak_tflops()
        assert first > 0 and tl.peak_tflops() == first
    finally:
        rt_mod.end()


@pytest.mark.skipif(not HAS_TORCH_XLA, reason="torch_xla is not installed")
def test_count_flops_first_in_a_torch_xla_process_leaves_its_backward_working():
    """A fresh process with torch_xla loaded, as on a TorchXLAConfig worker: count_flops runs a
    CPU backward before anything used XLA's device, then an XLA backward must still run."""
    code = (
        "import torch, torch_xla\n"
        "import ray_train_xla as rtx\n"
        "n = rtx.count_flops(lambda: torch.nn.Linear(4, 1)(torch.ones(2, 4)).sum().backward())\n"
        "dev = torch_xla.device()\n"
        "m = torch.nn.Linear(4, 1).to(dev)\n"
        "m(torch.ones(2, 4, device=dev)).sum().backward()\n"
        "print(n, float(m.weight.grad.sum().cpu()))\n")
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["32.0", "8.0"], out.stdout


# ---- model FLOPs without configure_timeline: the model and the batches the package saw -----


class _Tokens(torch.utils.data.Dataset):
    """Hugging Face-style samples: ``{"input_ids": [SEQ]}``."""

    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 64, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i]}


class _TinyLM(torch.nn.Module):
    """A language model of one matmul over its embeddings: 6 x (64 x 16 + 64) FLOPs a token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


@pytest.fixture
def a_device(monkeypatch):
    """The XLA CPU device where torch_xla is installed, else the native configs' CPU twin."""
    from ray_train_xla.planning import contract

    if not HAS_TORCH_XLA:
        monkeypatch.setenv(contract.RUNTIME_VAR, "native")
        contract.reload()
    yield
    monkeypatch.delenv(contract.RUNTIME_VAR, raising=False)
    contract.reload()


def test_a_loop_of_the_toolkits_loader_and_model_reports_tflops_and_mfu_by_itself(a_device):
    """prepare_data_loader + prepare_model and no configure_timeline(flops_per_step=...):
    rtx.metrics() gives each step's model FLOPs (the model's FLOPs a token x the tokens of the
    step's 2 accumulated batches; an evaluation batch under no_grad is no step's), TFLOP/s over
    the step time the loop measured itself, and MFU against the peak given."""
    rt_mod.begin()
    tl = tl_mod.begin()
    ends = []
    try:
        rtx.configure_timeline(peak_tflops=2.0)
        torch.manual_seed(0)
        model = rtx.prepare_model(_TinyLM())
        loader = rtx.prepare_data_loader(torch.utils.data.DataLoader(_Tokens(24), batch_size=BATCH))
        evaluation = rtx.prepare_data_loader(
            torch.utils.data.DataLoader(_Tokens(4), batch_size=BATCH, shuffle=False))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        batches = iter(loader)
        for _ in range(3):
            for _ in range(2):  # gradient accumulation: 2 batches a step
                ids = next(batches)["input_ids"]
                logits = model(ids)
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
            rtx.optimizer_step(opt)
            ends.append(time.time())
            opt.zero_grad()
            with torch.no_grad():  # evaluation: its tokens are no training step's
                for batch in evaluation:
                    model(batch["input_ids"])
        out = rtx.metrics()
    finally:
        tl_mod.end()
        rt_mod.end()
    per_token = 6 * (16 * 64 + 64)  # the embedding is a lookup
    per_step = per_token * 2 * BATCH * SEQ
    own_step_s = (ends[-1] - tl.begin) / 3  # the loop's own clock
    assert out["timeline/steps"] == 3
    assert out["timeline/step_time_s"] == pytest.approx(own_step_s, rel=0.01)
    assert out["timeline/flops_per_step"] == per_step
    assert out["timeline/flops_from"] == SIX_N
    assert out["timeline/tokens_per_s"] == pytest.approx(2 * BATCH * SEQ / own_step_s, rel=0.01)
    assert out["timeline/samples_per_s"] == pytest.approx(2 * BATCH / own_step_s, rel=0.01)
    assert out["timeline/tflops_per_s"] == pytest.approx(per_step / own_step_s / 1e12, rel=0.01)
    assert out["timeline/mfu"] == pytest.approx(per_step / own_step_s / 1e12 / 2.0, rel=0.01)
    assert "timeline/mfu_missing" not in out


def test_the_rules_6_x_trainable_parameters_per_sample_or_token_and_where_none_applies():
    from transformers import LlamaForCausalLM

    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    mlp[2].bias.requires_grad_(False)  # frozen: not counted
    rule = flops_rule(mlp)
    assert rule.name == SIX_N and rule.per_token == 6 * (8 * 16 + 16 + 16)
    assert rule.flops(0, 0, samples=4) == 6 * 160 * 4 and rule.flops(12, 12 * 3, 4) == 6 * 160 * 12
    lm = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 100))
    assert flops_rule(lm).per_token == 6 * (8 * 100 + 100)  # the embedding is a lookup
    config = _llama()
    with torch.device("meta"):
        decoder = LlamaForCausalLM(config)
    rule = flops_rule(decoder)
    assert rule.name == HF_DECODER and rule.tokens_only
    assert rule.flops(BATCH * SEQ, BATCH * SEQ * SEQ, BATCH) == \
        rtx.model_flops_per_token(config, SEQ) * BATCH * SEQ
    assert rule.flops(0, 0, samples=BATCH) is None  # a decoder needs tokens
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8, 1))
    assert "weights that 6 x parameters does not count (0 (Conv2d))" in flops_rule(conv)
    # What a batch holds: input_ids of a mapping, a first tensor of token ids, else rows.
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    assert batch_counts({"attention_mask": ids, "input_ids": ids}) == (BATCH * SEQ,
                                                                        BATCH * SEQ * SEQ, BATCH)
    assert batch_counts(((ids, ids), torch.ones(BATCH))) == (BATCH * SEQ, BATCH * SEQ * SEQ, BATCH)
    assert batch_counts((torch.zeros(BATCH, 8), torch.zeros(BATCH, 1))) == (0, 0, BATCH)
    with torch.no_grad():
        assert batch_counts({"input_ids": ids}) is None


def test_without_the_model_or_the_loader_metrics_say_why_there_is_no_mfu_naming_the_call(
        monkeypatch):
    """Each reason the timeline cannot count a step's FLOPs, then the peak it cannot know, in
    ``timeline/mfu_missing``, naming the one call that adds what is missing; a
    configure_timeline(flops_per_step=...) that differs from what was counted wins, no error."""
    monkeypatch.setattr(tl_mod, "instance_type", lambda: "")  # a Neuron worker off EC2: no peak
    call = "rtx.configure_timeline(flops_per_step=...)"
    rt_mod.begin()
    clock = Clock(10.0)
    tl = Timeline(device="neuron", clock=clock, options=lambda: runtime().options(TimelineOptions),
                  model_flops=lambda: runtime().model_flops)

    def step(*batches) -> dict:
        for batch in batches:
            tl.add_batch(batch)
        clock.t += 0.5
        tl.on_step(0)
        return tl.report_metrics()

    x = torch.zeros(4, 8)
    try:
        out = step(x)
        assert "timeline/tflops_per_s" not in out
        assert out["timeline/mfu_missing"] == f"no model FLOPs a step: {NO_MODEL}"
        assert "the package saw no model" in NO_MODEL and call in NO_MODEL
        model = torch.nn.Linear(8, 1)  # (the runtime holds the models it saw weakly)
        note_model(model)
        out = step()  # a batch of a loader of the user's own: not seen
        assert out["timeline/mfu_missing"].startswith(
            "no model FLOPs a step: no batch of these steps came from prepare_data_loader or "
            "iter_xla_batches")
        assert call in out["timeline/mfu_missing"]
        out = step(x, x)
        assert out["timeline/flops_per_step"] == 6 * 9 * 8 and out["timeline/flops_from"] == SIX_N
        assert out["timeline/tflops_per_s"] == pytest.approx(6 * 9 * 8 / 0.5 / 1e12)
        assert out["timeline/samples_per_s"] == 8 / 0.5
        assert out["timeline/mfu_missing"] == (
            "no peak TFLOP/s: no published peak for an instance type not named here "
            "(/sys/devices/virtual/dmi/id/product_name unreadable); give the config's "
            "peak_tflops= or rtx.configure_timeline(peak_tflops=...)")
        tl_mod.configure_timeline(flops_per_step=1e12, peak_tflops=4.0)  # wins, no error
        out = step(x)
        assert out["timeline/flops_per_step"] == 1e12
        assert out["timeline/flops_from"] == "configure_timeline"
        assert out["timeline/mfu"] == pytest.approx(1e12 / 0.5 / 1e12 / 4.0)
        assert "timeline/mfu_missing" not in out
    finally:
        rt_mod.end()
    for models, why in (
            ([torch.nn.Linear(8, 1), torch.nn.Conv1d(8, 1, 1)], "2 models were prepared (Conv1d, "
                                                               "Linear): a step's FLOPs are not "
                                                               "one model's"),
            ([torch.nn.Conv1d(8, 1, 1)], "Conv1d has weights that 6 x parameters does not count")):
        rt_mod.begin()
        try:
            for model in models:
                note_model(model)
            flops, reason = runtime().model_flops.per_step(0, 0, 4, 1)
            assert flops is None and reason.startswith(why) and reason.endswith(THE_CALL)
        finally:
            rt_mod.end()


def test_one_devices_share_of_a_batch_it_computes_with_others(monkeypatch):
    """One device's FLOPs: under SPMD on an accelerator one process feeds every device of its
    host (its batch's FLOPs are over those devices, as the peak is one device's); with tensor
    parallelism the tp peers train on the same batch, each on its share of the model."""
    from ray_train_xla.planning import contract
    from ray_train_xla.toolkit.observability.flops import ModelFlops

    cases = [("0", "cpu", "", 1), ("0", "cpu", "dp_replicate=1,dp_shard=2,tp=2", 2)]
    if HAS_TORCH_XLA:
        import torch_xla.runtime as xr

        monkeypatch.setattr(xr, "addressable_runtime_device_count", lambda: 4)
        cases += [("1", "tpu", "", 4), ("1", "cpu", "", 1)]
    model = torch.nn.Linear(8, 1)
    try:
        for spmd, device, layout, devices in cases:
            monkeypatch.setenv(contract.SPMD_VAR, spmd)
            monkeypatch.setenv(contract.DEVICE_VAR, device)
            monkeypatch.setenv(contract.LAYOUT_VAR, layout)
            monkeypatch.setenv("WORLD_SIZE", "4")
            contract.reload()
            rt_mod.begin()
            counted = ModelFlops()
            counted.note(model)
            assert counted.per_step(0, 0, 8, 1) == (6 * 9 * 8 / devices, SIX_N), (spmd, layout)
            rt_mod.end()
    finally:
        for var in (contract.SPMD_VAR, contract.DEVICE_VAR, contract.LAYOUT_VAR, "WORLD_SIZE"):
            monkeypatch.delenv(var)
        contract.reload()
