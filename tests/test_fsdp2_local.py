"""FSDP2's pieces that need no process group: the block policies every form of which the
torch_xla path accepts, mixed precision, the HSDP grid, and the names optimizer state is kept
under in sharded checkpoints; and, on a one-rank gloo group, a model the user sharded with
``fully_shard`` itself."""

from __future__ import annotations

import functools

import pytest
import torch

from ray_train_xla.errors import CheckpointMismatchError, ShardedStateError
from ray_train_xla.toolkit import fsdp2
from ray_train_xla.toolkit.checkpoint import names

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.13


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.out = torch.nn.Linear(4, 2)


def test_every_policy_form_names_the_same_blocks_innermost_first():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

    model = Net()
    forms = [{Block}, [Block], ModuleWrapPolicy({Block}),
             functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})]
    for policy in forms:
        assert fsdp2.chosen_blocks(model, policy) == list(model.blocks), policy
    assert fsdp2.chosen_blocks(model, None) == []
    # A size-based callable sees the numel not yet inside chosen blocks, as FSDP gives it.
    big = fsdp2.chosen_blocks(model, lambda module, recurse, nonwrapped_numel: (
        not recurse and isinstance(module, torch.nn.Linear) and nonwrapped_numel >= 20))
    assert big == [model.inp, model.blocks[0].fc, model.blocks[1].fc]  # not out: 10 parameters
    with pytest.raises(TypeError, match="not of torch.nn.Module classes"):
        fsdp2.chosen_blocks(model, {"Block"})
    with pytest.raises(TypeError, match="none of"):
        fsdp2.chosen_blocks(model, 3)


def test_mixed_precision_bf16_computes_in_bf16_and_reduces_in_fp32():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = fsdp2.mixed_precision_policy("bf16")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    mine = MixedPrecisionPolicy(param_dtype=torch.float16)
    assert fsdp2.mixed_precision_policy(mine) is mine and fsdp2.mixed_precision_policy(None) is None
    with pytest.raises(ValueError, match="'fp8'"):
        fsdp2.mixed_precision_policy("fp8")


def test_hsdp_grid_is_nodes_by_workers_per_node_or_refused(monkeypatch):
    from ray_train_xla.planning import contract

    def at(rank, local_rank, node_rank, per_node=2, world=4):
        ctx = contract.WorkerContext(rank=rank, local_rank=local_rank, node_rank=node_rank,
                                     world_size=world, local_world_size=per_node)
        monkeypatch.setattr(contract, "worker_context", lambda: ctx)
        monkeypatch.setattr(fsdp2, "rank", lambda: ctx.rank)
        monkeypatch.setattr(fsdp2, "local_rank", lambda: ctx.local_rank)
        monkeypatch.setattr(fsdp2, "node_rank", lambda: ctx.node_rank)
        monkeypatch.setattr(fsdp2, "world_size", lambda: ctx.world_size)
        return fsdp2.hsdp_shape()

    assert at(3, 1, 1) == (2, 2)
    with pytest.raises(ValueError, match="does not lie in row node_rank"):
        at(1, 1, 1)  # ranks not grouped by node
    with pytest.raises(ValueError, match="give the shape yourself"):
        at(0, 0, 0, per_node=3)  # 4 workers in nodes of 3


def test_optimizer_state_goes_under_parameter_names_and_back():
    model = Net()
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [params["out.weight"], params["inp.weight"]]},
                             {"params": [params["inp.bias"]], "lr": 0.5}], lr=0.1)
    for p in (params["out.weight"], params["inp.weight"], params["inp.bias"]):
        p.grad = torch.ones_like(p)
    opt.step()
    osd = opt.state_dict()
    # Without names (no param_names, the optimizer over no prepared model): refused.
    with pytest.raises(ShardedStateError, match="does not name its parameters"):
        names.named_optimizer_state(osd)
    groups = names.optimizer_param_names(model, opt, "test")
    assert groups == [["out.weight", "inp.weight"], ["inp.bias"]]
    named = names.name_optimizer_state(osd, groups)
    assert sorted(named["state"]) == ["inp.bias", "inp.weight", "out.weight"]
    assert named["param_groups"][1]["params"] == ["inp.bias"] and named["param_groups"][1]["lr"] == 0.5
    # Into an optimizer listing the same parameters in another order: by name, not position.
    other = torch.optim.AdamW([{"params": [params["inp.weight"], params["out.weight"]]},
                               {"params": [params["inp.bias"]]}], lr=0.1)
    other_groups = names.optimizer_param_names(model, other, "test")
    indexed = names.index_optimizer_state(named, other.state_dict(), other_groups, "test")
    other.load_state_dict(indexed)
    for name in ("inp.weight", "out.weight", "inp.bias"):
        assert torch.equal(other.state[params[name]]["exp_avg"], opt.state[params[name]]["exp_avg"])
    assert other.param_groups[1]["lr"] == 0.5
    # Groups that hold other parameters are refused, naming the counts.
    one_group = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointMismatchError, match="parameter groups"):
        names.index_optimizer_state(named, one_group.state_dict(),
                                    names.optimizer_param_names(model, one_group, "test"), "test")
    # An optimizer built from named_parameters() names itself (torch writes param_names).
    named_opt = torch.optim.SGD(model.named_parameters(), lr=0.1)
    assert names.named_optimizer_state(named_opt.state_dict())["param_groups"][0]["params"] == [
        n for n, _ in model.named_parameters()]
    assert names.module_name("_orig_module.blocks.0._checkpoint_wrapped_module.fc.weight") == \
        "blocks.0.fc.weight"


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.fixture
def one_native_cpu_rank(monkeypatch, tmp_path):
    """A one-rank gloo process group on the native CPU twin (the environment the plan gives a
    TorchNeuronConfig(device="cpu") worker), without Ray."""
    import torch.distributed as dist

    from ray_train_xla.planning import contract

    monkeypatch.setenv(contract.RUNTIME_VAR, "native")
    monkeypatch.setenv(contract.DEVICE_VAR, "cpu")
    contract.reload()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    monkeypatch.undo()
    contract.reload()


def test_a_model_sharded_with_fully_shard_is_taken_as_is_then_stepped(one_native_cpu_rank):
    """The path for a model the user sharded with FSDP2 (docs/api.md, docs/sharded-models.md):
    optimizer_step refuses its DTensors until prepare_sharded_model has taken the model (as is:
    the same object, its own mesh and blocks), then steps it and counts the step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.steps import steps_done

    torch.manual_seed(0)
    model = Stack()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))  # the user's own axis name
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ShardedStateError) as info:
        rtx.optimizer_step(opt)
    message = str(info.value)
    assert "a DTensor" in message and "rtx.prepare_sharded_model(model)" in message
    assert "torch_xla.sync()" not in message  # the native path's fix, not FSDPv2's
    assert rtx.prepare_sharded_model(model) is model
    before = [p.full_tensor().clone() for p in model.parameters()]
    rtx.optimizer_step(opt)
    assert all(not torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
    assert steps_done() == 1  # the refused call counted none
