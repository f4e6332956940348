"""The training-loop helpers under real Ray Train and real torch_xla on CPU.

Three fits share one training function: 2 workers uninterrupted (the reference), 1 worker on the
whole batch (the numerical contract), and 2 workers where one dies mid-run (fault tolerance).
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import fit, write_record

pytestmark = [pytest.mark.ray]

SAMPLES, GLOBAL_BATCH, FEATURES = 32, 16, 4
STEPS, CKPT_EVERY = 6, 2  # 2 steps per epoch: checkpoints at epoch ends, 3 epochs
FAIL_AT = 5  # on the first attempt, rank 1 dies after step 5 (checkpoint at 4 is the latest)
CLIP = 0.1  # from the second step on, gradients are clipped to this global norm


def train_regression(config):
    import ray.train
    import torch

    import ray_train_xla as rtx

    r, n = rtx.rank(), rtx.world_size()
    resumed = ray.train.get_checkpoint() is not None
    write_record(config, f"start_pid{os.getpid()}", {
        "rank": r, "pid": os.getpid(), "port": int(os.environ["MASTER_PORT"]), "resumed": resumed,
    })
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.sin(x).sum(dim=1, keepdim=True)
    loader = rtx.prepare_data_loader(torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=GLOBAL_BATCH // n, shuffle=True))
    torch.manual_seed(100 + r)  # each rank starts differently; prepare_model gives rank 0's
    model = rtx.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = rtx.load_checkpoint(model, opt)
    step = start_step = state["step"] if state else 0
    loader.set_epoch(step // (SAMPLES // GLOBAL_BATCH))
    losses, transfers, norms = [], [], []
    while step < STEPS:
        for xb, yb in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            before = transfers_to_host()
            # From step 2, clip_grad_norm_ averages the gradients (the step then does not).
            norm = rtx.clip_grad_norm_(model, CLIP) if step > 0 else None
            # Step 1 with one bucket per parameter, then the default buckets (numerically equal).
            rtx.optimizer_step(opt, **({"bucket_mb": 1e-9} if step == 0 else {}))
            transfers.append(transfers_to_host() - before)
            if norm is not None:
                norms.append(norm.item())
            step += 1
            marker = os.path.join(config["out_dir"], "failed_once.json")
            if config.get("fail") and step == FAIL_AT and r == 1 and not os.path.exists(marker):
                write_record(config, "failed_once", {"pid": os.getpid()})
                # Ray Train V2 registers a reported checkpoint when its controller next polls
                # the workers (every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default, set lower
                # by conftest): let it see step 4's (two polls and a second).
                time.sleep(2 * float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", 2)) + 1)
                os._exit(1)
            losses.append(loss.item())
            m = rtx.metrics(step, warmup_steps=2)
            if step % CKPT_EVERY == 0:
                rtx.save_checkpoint(
                    {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                    {"step": step, "loss": losses[-1], **m},
                )
    record = {
        "rank": r, "resumed": resumed, "start_step": start_step, "step": step, "losses": losses,
        "transfers": transfers, "metrics": m, "norms": norms,
        "params": [p.detach().cpu().reshape(-1).tolist() for p in model.parameters()],
    }
    if config.get("ray_data"):
        batches = list(rtx.iter_xla_batches(ray.train.get_dataset_shard("train"), batch_size=2))
        record["ray_data"] = [
            {"device": b["x"].device.type, "rows": b["x"].shape[0], "x": b["x"].cpu().tolist()}
            for b in batches
        ]
    write_record(config, f"final_rank{r}_pid{os.getpid()}", record)


def transfers_to_host() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("TransferFromDeviceTime")
    return int(data[0]) if data else 0


def finals(records):
    return sorted((r for r in records if "params" in r), key=lambda r: r["rank"])


def assert_params_close(a, b, atol=1e-5):
    import torch

    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(torch.tensor(pa), torch.tensor(pb), atol=atol, rtol=0)


def one_process_run():
    """train_regression's steps in this process with plain torch on the CPU: one replica over
    each whole global batch (the rows the two workers' halves make up), rank 0's start, torch's
    own clip_grad_norm_: (the parameters, the norms clipped)."""
    import torch

    # torch's autograd engine sizes its per-device queues at a process's first backward, from
    # the devices known then: with torch_xla's device started first, later tests that run XLA
    # backward passes in this process still find a queue for it.
    import torch_xla

    torch_xla.device()

    import ray_train_xla as rtx

    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.sin(x).sum(dim=1, keepdim=True)
    loader = rtx.prepare_data_loader(torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=GLOBAL_BATCH, shuffle=True),
        to_device=False)
    torch.manual_seed(100)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader.set_epoch(0)
    step, norms = 0, []
    while step < STEPS:
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            if step > 0:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            opt.step()
            step += 1
    return [p.detach().reshape(-1).tolist() for p in model.parameters()], norms


@pytest.fixture(scope="module")
def uninterrupted(ray_local):
    """2 workers, 6 steps, checkpoints every 2, a Ray Data shard read at the end."""
    import ray

    ds = ray.data.from_items([{"x": float(i)} for i in range(10)])  # 5 rows a worker: 2 + 2
    return fit(train_regression, num_workers=2, datasets={"train": ds},
               loop_config={"ray_data": True})


def test_two_workers_on_half_batches_match_one_worker_on_the_whole_batch(uninterrupted):
    result, records = uninterrupted
    two = finals(records)
    assert [r["rank"] for r in two] == [0, 1]
    assert_params_close(two[0]["params"], two[1]["params"], atol=0)  # same start, same grads
    # Plain torch in one process over the whole global batches ends where the two workers did,
    # and clips by the same norms: those of the averaged gradients, on every worker.
    params, norms = one_process_run()
    assert_params_close(two[0]["params"], params)
    assert min(norms) > CLIP  # every clip clipped
    for rec in two:
        assert rec["norms"] == pytest.approx(norms, rel=1e-5)
    assert two[0]["step"] == STEPS
    # Gradients cross to the host once per bucket: 4 parameters, one float32 bucket; once a
    # step, clip_grad_norm_ or optimizer_step.
    assert two[0]["transfers"][:2] == [4, 1] and set(two[0]["transfers"][1:]) == {1}
    # Loss goes down and the step graphs stopped compiling after warm-up.
    for rec in two:
        assert rec["losses"][-1] < rec["losses"][0]
        assert rec["metrics"]["xla/compiles"] > 0
        assert rec["metrics"]["xla/compiles_after_warmup"] == 0
    # The last checkpoint and its metrics came back through ray.train.report.
    assert result.metrics["step"] == STEPS and result.metrics["xla/compiles"] > 0
    assert result.checkpoint is not None
    # It loads with plain torch where torch_xla cannot be imported, and holds the final params.
    with result.checkpoint.as_directory() as path:
        code = (
            "import sys, json; sys.modules['torch_xla'] = None; import torch; "
            f"s = torch.load({os.path.join(path, 'checkpoint.pt')!r}, weights_only=True); "
            "print(json.dumps({'step': s['step'], 'params': "
            "[v.reshape(-1).tolist() for v in s['model'].values()], "
            "'device': sorted({v.device.type for v in s['model'].values()})}))"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    import json

    saved = json.loads(out)
    assert saved["step"] == STEPS and saved["device"] == ["cpu"]
    assert_params_close(saved["params"], two[0]["params"], atol=0)
    # Ray Data shard: constant-shape batches on the XLA device, the short batch dropped.
    seen = []
    for rec in two:
        assert [b["rows"] for b in rec["ray_data"]] == [2, 2]
        assert {b["device"] for b in rec["ray_data"]} == {"xla"}
        seen += [v for b in rec["ray_data"] for v in b["x"]]
    assert len(set(seen)) == len(seen) == 8  # disjoint shards


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _listeners(port: int) -> str:
    """Which processes have a socket on ``port`` (for a failure message)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except OSError:
            pass
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in fds}
            if any(f"socket:[{i}]" in links for i in inodes):
                with open(f"/proc/{pid}/cmdline") as f:
                    found.append(f"{pid}: {f.read().replace(chr(0), ' ')[:200]}")
        except OSError:
            pass
    return f"sockets {sorted(inodes)}; processes: {found}"


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        if s.connect_ex(("127.0.0.1", port)) == 0:
            return False  # something still listens there
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


@pytest.mark.e2e
def test_dead_worker_is_replaced_and_training_resumes_from_the_last_checkpoint(uninterrupted):
    import tempfile

    from ray.train import FailureConfig, RunConfig

    _, reference = uninterrupted
    result, records = fit(
        train_regression, num_workers=2, loop_config={"fail": True},
        run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="rtx-test-results-"),
                             failure_config=FailureConfig(max_failures=1)),
    )
    starts = [r for r in records if "port" in r]
    first = [r for r in starts if not r["resumed"]]
    second = [r for r in starts if r["resumed"]]
    assert len(first) == 2 and len(second) == 2, starts
    assert any(r.get("pid") in {s["pid"] for s in first} for r in records if "port" not in r)
    final = finals(records)
    assert all(r["resumed"] for r in final) and len(final) == 2
    # Resumed from the last checkpoint (step 4), not from scratch or an older one.
    (start,) = {r["start_step"] for r in final}
    assert start == FAIL_AT - 1
    assert [len(r["losses"]) for r in final] == [STEPS - start] * 2
    assert_params_close(final[0]["params"], finals(reference)[0]["params"])
    assert result.metrics["step"] == STEPS
    # Nothing of the failed attempt is left: its processes and its rendezvous port.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_pid_alive(r["pid"]) for r in first):
        time.sleep(0.5)
    assert [r["pid"] for r in first if _pid_alive(r["pid"])] == []
    (port,) = {r["port"] for r in first}
    assert _port_free(port), (port, {r["port"] for r in second}, _listeners(port))
