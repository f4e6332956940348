"""A tiny Hugging Face Llama trained sharded on every layout (torch_xla FSDPv2, FSDP2), the
unsharded plain-torch reference of the same model and data, and the whole state of a sharded
model and optimizer under the module's names, for exact comparisons (test_fsdp2_ray.py)."""

from __future__ import annotations

import torch

VOCAB, SEQ, BATCH, LR, WD = 64, 16, 12, 1e-2, 0.1  # BATCH: split evenly over 1-4 ranks


def lm_config(hidden: int = 32):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=64, tie_word_embeddings=False,
                       attn_implementation="eager")


def make_lm(hidden: int = 32) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(lm_config(hidden))


def block_class():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def optimizer(model: torch.nn.Module, eps: float = 1e-8) -> torch.optim.Optimizer:
    """AdamW; ``eps=1e-4`` where float rounding must not be amplified (Adam divides by the root
    of the squared gradients: near zero, by eps)."""
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=eps)


def tokens(step: int) -> torch.Tensor:
    """The global batch of ``step``: BATCH rows of SEQ tokens."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def rows(step: int, rank: int, world: int) -> torch.Tensor:
    per = BATCH // world
    return tokens(step)[rank * per:(rank + 1) * per]


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    # No key/value cache: with activation checkpointing the recomputed forward would append to
    # the cache a second time (Transformers turns it off for its own gradient checkpointing).
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def reference(steps: int, eps: float = 1e-8, losses: list | None = None,
              max_norm: float = 1.0) -> dict[str, torch.Tensor]:
    """The unsharded run: one process, plain torch on the CPU, the whole batch every step, the
    gradients clipped to ``max_norm`` (each step's loss appended to ``losses``)."""
    model = make_lm()
    opt = optimizer(model, eps)
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model, tokens(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        if losses is not None:
            losses.append(float(loss))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def whole(value):
    """A whole CPU copy of a DTensor, an SPMD XLA tensor or a plain tensor."""
    full = getattr(value, "full_tensor", None)
    value = full() if full is not None else value
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def named_state(model, opt=None) -> dict:
    """The model's and optimizer's state, whole, under the module's names."""
    from ray_train_xla.toolkit.checkpoint.names import module_name, optimizer_param_names

    out = {"model": {module_name(k): whole(v) for k, v in model.state_dict().items()}}
    if opt is not None:
        names = [n for g in optimizer_param_names(model, opt, "test") for n in g]
        osd = opt.state_dict()
        ids = [i for g in osd["param_groups"] for i in g["params"]]
        by_id = dict(zip(ids, names))
        out["optimizer"] = {by_id[i]: {k: whole(v) for k, v in s.items()}
                            for i, s in osd["state"].items()}
    return out


def exact(a, b) -> bool:
    """Bit-exact equality of nested tensors (the same dtype, shape and values)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a) == sorted(b) and all(exact(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    return a == b


def max_diff(model_state: dict, ref: dict) -> float:
    assert sorted(model_state) == sorted(ref), (sorted(model_state), sorted(ref))
    return max(float((model_state[k].float() - ref[k].float()).abs().max()) for k in ref)


def mean_diff(a: dict, b: dict) -> float:
    """The mean absolute difference over every element of every tensor."""
    total = sum(float((a[k].float() - b[k].float()).abs().sum()) for k in b)
    return total / sum(b[k].numel() for k in b)


def assert_consolidated_hf(checkpoint: str, dump: str, tmp_path) -> None:
    """``consolidate_hf`` of ``checkpoint`` (this module's Llama) loads with
    ``from_pretrained`` and gives the logits of the trained model dumped at ``dump``."""
    from transformers import AutoModelForCausalLM

    from ray_train_xla.tools.consolidate import consolidate_hf

    lm_config().save_pretrained(tmp_path / "config")
    consolidate_hf(checkpoint, str(tmp_path / "hf"), config=str(tmp_path / "config"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    trained = make_lm().eval()
    trained.load_state_dict(torch.load(dump, weights_only=False)["model"])
    ids = tokens(99)
    with torch.no_grad():
        want, got = trained(input_ids=ids).logits, exported(input_ids=ids).logits
    assert not torch.allclose(want, make_lm().eval()(input_ids=ids).logits, atol=1e-3)  # trained
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def native_cpu_env(rank: int, world: int, port: int, run: str, timeout_s: int) -> None:
    """This process as rank ``rank`` of ``world`` on one host, the native CPU twin over gloo,
    as the config plans it (for ranks started without Ray)."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), RAY_TRAIN_XLA_DEVICE="cpu",
                      RAY_TRAIN_XLA_RUNTIME="native", RAY_TRAIN_XLA_PG_BACKEND="gloo",
                      TORCHELASTIC_RUN_ID=f"{run}-{port}", RAY_TRAIN_XLA_TIMEOUT_S=str(timeout_s))
