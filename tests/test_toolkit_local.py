"""The data and metrics helpers in one process (real torch_xla on CPU, no Ray): constant batch
shapes keep the compile count constant across epochs; a naive loop recompiles and is warned about."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import ray_train_xla as rtx

SAMPLES, BATCH, EPOCHS = 20, 8, 3  # batches of 8, 8 and a ragged 4


@pytest.fixture(scope="module", autouse=True)
def cpu_xla():
    """torch_xla on the CPU in this process, as one worker (no RANK/WORLD_SIZE planned)."""
    old = os.environ.get("PJRT_DEVICE")
    os.environ["PJRT_DEVICE"] = "CPU"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PJRT_DEVICE", None)
        else:
            os.environ["PJRT_DEVICE"] = old


def make_data(features: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, features, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))


def train(batches_per_epoch, features: int):
    """Run EPOCHS epochs; return (compiles after each epoch, warnings, steps per epoch)."""
    torch.manual_seed(0)
    model = rtx.prepare_model(torch.nn.Linear(features, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    monitor = rtx.CompileMonitor(warmup_steps=2)
    compiles, steps, step = [], [], 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(EPOCHS):
            n = 0
            for x, y in batches_per_epoch(epoch):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                rtx.optimizer_step(opt)
                step += 1
                n += 1
                m = monitor.metrics(step)
            compiles.append(m["xla/compiles"])
            steps.append(n)
    return compiles, [w for w in caught if issubclass(w.category, rtx.RecompilationWarning)], steps, m


def test_prepared_loader_compiles_constant_naive_loop_recompiles_and_is_warned():
    features = 5
    loader = rtx.prepare_data_loader(
        torch.utils.data.DataLoader(make_data(features), batch_size=BATCH, shuffle=True)
    )
    prepared, prepared_warnings, prepared_steps, m = train(lambda e: loader, features)
    assert prepared_steps == [SAMPLES // BATCH] * EPOCHS  # the short batch was dropped
    assert prepared[0] > 0
    assert prepared[0] == prepared[-1], f"compiles per epoch grew: {prepared}"
    assert prepared_warnings == []
    assert m["xla/compiles_after_warmup"] == 0
    # Executions finish asynchronously: the last step may still be running.
    assert m["xla/executions"] >= sum(prepared_steps) - 1 and m["xla/compile_time_s"] > 0

    # Same model shape on fresh graphs (another feature count, so no cache hit from above).
    features = 7
    naive_loader = torch.utils.data.DataLoader(make_data(features), batch_size=BATCH, shuffle=True)
    device = rtx.get_device()
    naive, naive_warnings, naive_steps, m = train(
        lambda e: ((x.to(device), y.to(device)) for x, y in naive_loader), features
    )
    assert naive_steps == [-(-SAMPLES // BATCH)] * EPOCHS
    assert naive[-1] > prepared[-1], f"naive {naive} vs prepared {prepared}"
    assert m["xla/compiles_after_warmup"] >= 1
    assert len(naive_warnings) == 1, "the storm warning fires once"
    text = str(naive_warnings[0].message)
    assert "by step 3" in text and "shapes" in text and "Python scalars" in text


def test_pad_mode_keeps_shape_and_masks_the_padding():
    loader = rtx.prepare_data_loader(
        torch.utils.data.DataLoader(make_data(3), batch_size=BATCH), ragged="pad",
        background=True,  # torch_xla's MpDeviceLoader (the default only on accelerators)
    )
    batches = list(loader)
    assert len(batches) == 3
    rows = [x.shape[0] for (x, _), _ in batches]
    assert rows == [BATCH] * 3
    masks = torch.cat([mask.cpu() for _, mask in batches])
    assert masks.sum().item() == SAMPLES
    assert batches[0][1].device.type == "xla"
    (x_last, _), mask_last = batches[-1]
    assert torch.all(x_last.cpu()[mask_last.cpu() == 0] == 0)


def test_bad_ragged_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="ragged='keep'"):
        rtx.prepare_data_loader(torch.utils.data.DataLoader(make_data(2), batch_size=4),
                                ragged="keep")


def test_metrics_come_from_counters_and_execute_time_only_on_request():
    import torch_xla
    import torch_xla.debug.metrics as met

    x = torch.arange(6.0, device=rtx.get_device())
    (x * 3).sum().cpu()  # at least one compilation and execution in this process
    cheap = rtx.metrics()
    assert "xla/execute_time_s" not in cheap  # reading it costs ~0.2 ms: only on request
    full = rtx.metrics(execute_time=True)
    assert full["xla/execute_time_s"] > 0
    # Counts since the process started, equal to torch_xla's own metrics.
    assert full["xla/compiles"] == met.metric_data("CompileTime")[0]
    assert full["xla/compile_time_s"] == pytest.approx(met.metric_data("CompileTime")[1] * 1e-9)
    assert full["xla/executions"] == met.metric_data("ExecuteTime")[0]
    torch_xla.sync()
