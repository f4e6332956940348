"""test_tensor_parallel_local.py's scenarios: tensor parallelism with FSDP2 on the CPU (gloo),
without Ray. ``python tp_worker.py OUT_DIR [SCENARIO,...]`` trains the unsharded references
(one process, the whole batch), then forks 4 ranks (the imports are paid once); every rank runs
each scenario on its mesh of ``(dp_replicate, dp_shard, tp)`` and rank 0 writes
``results.json``: each scenario's losses and final parameters against its reference."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback

import torch

VOCAB, SEQ, BATCH, STEPS, LR, EPS = 128, 16, 8, 3, 1e-2, 1e-4


def config(kind: str = "llama", tied: bool = False):
    from transformers import LlamaConfig, Qwen3Config

    cls = Qwen3Config if kind == "qwen3" else LlamaConfig
    return cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4 if tied else 2, head_dim=16,
               max_position_embeddings=64, tie_word_embeddings=tied, attn_implementation="eager")


def make(kind: str = "llama", tied: bool = False, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(kind, tied))


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=EPS)


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def reference(kind: str, tied: bool) -> tuple[list[float], dict]:
    """One process, plain torch, the whole batch each step."""
    model = make(kind, tied)
    opt = optimizer(model)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, tokens(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def whole(state: dict) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in state.items()}


def mean_diff(a: dict, b: dict) -> float:
    return sum(float((a[k].float() - b[k].float()).abs().sum()) for k in b) / sum(b[k].numel() for k in b)


def placements(model) -> dict:
    return {n: [str(getattr(p, "device_mesh", None) and p.device_mesh.mesh_dim_names),
                [str(x) for x in getattr(p, "placements", ())]]
            for n, p in model.named_parameters()}


def train(model, mesh, *, parallel_loss=False, peers_differ=False):
    """STEPS AdamW steps with clipping; each data-parallel rank its share of the global batch,
    TP peers the same rows (``peers_differ``: not, as a broken loader would). Returns the
    losses averaged over the data-parallel ranks."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from ray_train_xla.toolkit.tensor_parallel import clip_grad_norm_

    replicas, shards = mesh["dp_replicate"], mesh["dp_shard"]
    dp_rank = replicas.get_local_rank() * shards.size() + shards.get_local_rank()
    dp_size = replicas.size() * shards.size()
    tp_rank = mesh["tp"].get_local_rank()
    per = BATCH // dp_size
    opt = optimizer(model)
    losses = []
    for step in range(STEPS):
        ids = tokens(step + (100 * tp_rank if peers_differ else 0))[dp_rank * per:(dp_rank + 1) * per]
        opt.zero_grad()
        if parallel_loss:
            with loss_parallel():
                loss = loss_of(model, ids)
                loss.backward()
        else:
            loss = loss_of(model, ids)
            loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
        dist.all_reduce(value)  # TP peers hold the same loss: the mean over all is over dp
        losses.append(float(value) / dist.get_world_size())
    return losses


def my_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


@functools.cache
def layout(shape):
    """The mesh of ``shape``, made once per rank: the scenarios of one shape share its groups."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


def scenarios():
    """name -> (model kind, tied, mesh shape, parallelize kwargs, train kwargs)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {
        # TP 2 x FSDP 2, per-layer FSDP and activation checkpointing.
        "tp2_dp2": ("llama", False, (1, 2, 2),
                    {"auto_wrap_policy": {LlamaDecoderLayer}, "activation_checkpointing": True}, {}),
        # Sequence parallelism, the logits split on the vocabulary, the loss computed on them.
        "tp2_dp2_sp": ("llama", False, (1, 2, 2),
                       {"sequence_parallel": True, "loss_parallel": True,
                        "auto_wrap_policy": {LlamaDecoderLayer}}, {"parallel_loss": True}),
        # TP 4 alone (4 key/value heads) with sequence parallelism, the logits gathered; tied
        # embeddings (embed_tokens and lm_head one parameter).
        "tp4_tied_sp": ("llama", True, (1, 1, 4), {"sequence_parallel": True}, {}),
        # HSDP (2 replicas) x TP 2; Qwen3's per-head q_norm/k_norm (replicated_with_grad_allreduce).
        "hsdp_tp2_qwen3": ("qwen3", False, (2, 1, 2), {}, {}),
        # Mixed precision (bf16 compute, fp32 gradient reduction) with sequence parallelism.
        "tp2_dp2_bf16": ("llama", False, (1, 2, 2),
                         {"mixed_precision": "bf16", "sequence_parallel": True}, {}),
        # Controls: each must differ from the unsharded run.
        "peers_differ": ("llama", False, (1, 2, 2), {}, {"peers_differ": True}),
        "qwen3_no_norm_sum": ("qwen3", False, (1, 2, 2), {"drop": "norm"}, {}),
        "swapped": ("llama", False, (1, 2, 2), {"drop": "swap"}, {}),
    }


def altered_plan(model, how: str):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ray_train_xla.toolkit.tensor_parallel import tp_plan

    plan = tp_plan(model)
    if how == "norm":  # the per-head norms left plain: their gradients miss the other heads
        return {k: v for k, v in plan.items() if not k.endswith(("q_norm", "k_norm"))}
    # colwise and rowwise swapped in the MLP
    return {k: (RowwiseParallel() if isinstance(v, ColwiseParallel) and ".mlp." in k else
                ColwiseParallel() if isinstance(v, RowwiseParallel) and ".mlp." in k else v)
            for k, v in plan.items()}


def run_scenario(name, kind, tied, shape, kwargs, train_kwargs, refs) -> dict:
    from ray_train_xla.toolkit.tensor_parallel import parallelize

    started = time.perf_counter()
    mesh = layout(shape)
    model = make(kind, tied, seed=my_rank())  # each rank its own start: parallelize gives rank 0's
    kwargs = dict(kwargs)
    drop = kwargs.pop("drop", None)
    if drop:
        kwargs["plan"] = altered_plan(model, drop)
    rec: dict = {}
    try:
        parallelize(model, mesh, **kwargs)
        rec["placements"] = placements(model)
        if kwargs.get("loss_parallel"):
            from torch.distributed.tensor import DTensor

            logits = model(input_ids=tokens(0)[:1], use_cache=False).logits
            rec["logits"] = [type(logits).__name__, str(getattr(logits, "placements", None))]
            assert isinstance(logits, DTensor)
        if kwargs.get("sequence_parallel"):
            try:
                model(input_ids=tokens(0)[:1, :-1], use_cache=False)
            except ValueError as e:
                rec["uneven"] = str(e)
        losses = train(model, mesh, **train_kwargs)
        state = whole(model.state_dict())
    except Exception as e:  # the controls may fail loudly instead of numerically
        if not drop:
            raise
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
        return rec
    ref_losses, ref_state = refs[(kind, tied)]
    rec.update(losses=losses, ref_losses=ref_losses,
               loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)),
               param_diff=max(float((state[k] - ref_state[k]).abs().max()) for k in ref_state),
               keys_match=sorted(state) == sorted(ref_state),
               mean_diff=mean_diff(state, ref_state),
               moved=mean_diff(ref_state, make(kind, tied).state_dict()),
               tied_after=bool(tied and model.lm_head.weight is model.model.embed_tokens.weight),
               seconds=time.perf_counter() - started)
    return rec


def today_vs_tp1(refs) -> dict:
    """tp 1, dp_replicate 1: the same placements and bit-for-bit the same training as
    prepare_fsdp2 on today's 1-D ("fsdp",) mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ray_train_xla.toolkit.fsdp2 import prepare_fsdp2
    from ray_train_xla.toolkit.tensor_parallel import parallelize

    world = dist.get_world_size()
    mesh = layout((1, world, 1))
    new = parallelize(make(seed=my_rank()), mesh)
    old = prepare_fsdp2(make(seed=my_rank()), init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)))
    rec = {"placements": [placements(m) for m in (new, old)]}
    states = []
    for model in (new, old):
        train(model, mesh)  # the same rows: rank r is dp rank r of both
        states.append(whole(model.state_dict()))
    rec["bit_exact"] = all(torch.equal(states[0][k], states[1][k]) for k in states[1])
    ref_state = refs[("llama", False)][1]
    rec["param_diff"] = max(float((states[0][k] - ref_state[k]).abs().max()) for k in ref_state)
    return rec


def rank_main(rank: int, world: int, port: int, out: str, table: dict, refs: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    started = time.perf_counter()
    try:
        for name, spec in table.items():
            if name != "today":
                results[name] = run_scenario(name, *spec, refs)
        if "today" in table:
            results["today"] = today_vs_tp1(refs)
    except BaseException:
        results["error"] = traceback.format_exc()
        raise
    finally:
        results["seconds"] = time.perf_counter() - started
        if rank == 0:
            with open(os.path.join(out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()


def main(out: str, wanted: list[str] | None, world: int = 4) -> int:
    import multiprocessing
    import socket

    torch.set_num_threads(1)  # before any operation: the forked ranks inherit no thread pool
    table = {k: v for k, v in {**scenarios(), "today": None}.items() if wanted is None or k in wanted}
    kinds = {("llama", False)} | {(v[0], v[1]) for v in table.values() if v}
    refs = {kind: reference(*kind) for kind in sorted(kinds)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=rank_main, args=(r, world, port, out, table, refs)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    return 0 if codes == [0] * world else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else None))
