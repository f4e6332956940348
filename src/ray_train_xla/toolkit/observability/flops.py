"""Model FLOPs: what a step computes, for model FLOPs utilisation (MFU), counted as torchtitan
and MaxText count them (``docs/observability.md``): :func:`model_flops_per_token` for a Hugging
Face decoder, :func:`count_flops` (torch's own ``FlopCounterMode``) for any model.
``configure_timeline(flops_per_step=...)`` takes the result (``timeline.py``).

Without it the timeline counts them itself where the package saw the model and the batches
(:class:`ModelFlops`, held by the runtime): ``prepare_model``, ``prepare_sharded_model`` and
``load_pretrained`` note the model and its rule (:func:`flops_rule`), the toolkit's loaders
hand each batch's tokens to the timeline (:func:`batch_counts`), and a step's FLOPs are the
rule applied to the tokens of the batches handed out since the step before.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


def model_flops_per_token(model: Any, seq_len: int, causal_half: bool = False) -> float:
    """Training FLOPs (forward and backward) per token of a Hugging Face decoder ``model`` (a
    ``PreTrainedModel`` or its ``PretrainedConfig``) on sequences of ``seq_len`` tokens: 6 for
    each weight that takes part in a matmul (every ``nn.Linear`` and GPT-2's ``Conv1D``, the
    output projection included, tied or not; not the input embedding, a lookup), plus
    attention's ``12 x layers x heads x head_dim x seq_len``, causal attention counted whole (the
    math and eager kernels compute the masked half) unless ``causal_half=True`` (MaxText).
    Another kind of weight, or a config without layers and heads, raises ``ValueError``."""
    import torch

    config = getattr(model, "config", model)
    if isinstance(model, torch.nn.Module):
        module = model
    else:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            module = AutoModelForCausalLM.from_config(config)
    if seq_len < 1:
        raise ValueError(f"model_flops_per_token: seq_len={seq_len!r} must be >= 1")
    rule = _decoder_rule(*_weights(module), config)
    if isinstance(rule, str):
        raise ValueError(f"model_flops_per_token: {type(module).__name__} has {rule}; it counts "
                         "Hugging Face decoders of linear layers: measure this model's step "
                         "with count_flops(step) instead")
    attention = rule.per_token_position * seq_len
    return rule.per_token + (attention / 2 if causal_half else attention)


@dataclass(frozen=True)
class FlopsRule:
    """A model's training FLOPs (forward and backward): ``per_token`` for each token (or, with
    ``tokens_only`` False, each sample), plus ``per_token_position`` for each token times the
    length of its sequence (attention's); ``name`` says which rule gave them."""

    per_token: float
    per_token_position: float
    name: str
    tokens_only: bool

    def flops(self, tokens: float, token_positions: float, samples: float) -> float | None:
        """The FLOPs of ``tokens`` (their sequences' lengths summed over them:
        ``token_positions``), else of ``samples`` where the rule counts samples; None where
        the batches give it nothing to count."""
        if tokens:
            return self.per_token * tokens + self.per_token_position * token_positions
        if samples and not self.tokens_only:
            return self.per_token * samples
        return None


HF_DECODER = "the Hugging Face decoder's config (model_flops_per_token)"
SIX_N = "6 x trainable parameters"


def _weights(module: Any) -> tuple[int, list[str]]:
    """(weights of the matmuls: every ``nn.Linear`` and GPT-2's ``Conv1D``; the names of the
    other weights of 2 or more dimensions, embeddings aside)."""
    import torch

    matmul, other = 0, []
    for name, m in module.named_modules():
        weight = getattr(m, "weight", None)
        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D":  # GPT-2's is a matmul
            matmul += m.weight.numel()
        elif isinstance(weight, torch.Tensor) and weight.dim() > 1 \
                and not isinstance(m, torch.nn.Embedding):
            other.append(f"{name} ({type(m).__name__})")
    return matmul, other


def _decoder_rule(matmul: int, other: list[str], config: Any) -> FlopsRule | str:
    """``model_flops_per_token``'s rule for a Hugging Face decoder of ``matmul`` weights in
    matmuls and ``other`` weights (``_weights``), or what it lacks."""
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size")
               if not isinstance(getattr(config, k, None), int)]
    if other:
        return f"weights of a kind it does not count: {', '.join(other[:3])}"
    if missing:
        return f"a config without {', '.join(missing)}"
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return FlopsRule(6.0 * matmul, 12.0 * config.num_hidden_layers * heads * head_dim,
                     HF_DECODER, tokens_only=True)


def flops_rule(model: Any) -> FlopsRule | str:
    """The rule of ``model``'s FLOPs, or why there is none: a Hugging Face decoder's config gives
    them exactly (``model_flops_per_token``, per token); any other model of linear layers
    6 x its trainable parameters, embeddings aside (lookups), per token of ``input_ids`` or per
    sample. A model with other weights (convolutions, which reuse each weight across
    positions) has none: 6 x parameters would undercount it."""
    import torch

    matmul, other = _weights(model)
    rule = _decoder_rule(matmul, other, getattr(model, "config", None))
    if isinstance(rule, FlopsRule):
        return rule
    if other:
        return (f"{type(model).__name__} has weights that 6 x parameters does not count "
                f"({', '.join(other[:3])})")
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    trainable = sum(p.numel() for p in model.parameters()
                    if p.requires_grad and id(p) not in lookups)
    if not trainable:
        return f"{type(model).__name__} has no trainable parameters outside its embeddings"
    return FlopsRule(6.0 * trainable, 0.0, SIX_N, tokens_only=False)


# The call that gives a step's model FLOPs where the timeline cannot count them itself.
THE_CALL = ("add rtx.configure_timeline(flops_per_step=...): rtx.model_flops_per_token(model, "
            "seq_len) x the tokens of a step, or rtx.count_flops(train_step, batch)")
NO_MODEL = ("the package saw no model (prepare_model, prepare_sharded_model and load_pretrained "
            f"note it); {THE_CALL}")


class ModelFlops:
    """The models the package prepared on this worker, each with its rule (``flops_rule``), and
    the devices its batches' FLOPs are spread over (held by the runtime; see the module
    docstring)."""

    def __init__(self) -> None:
        self.models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()  # (the timeline's thread reads them)
        self.devices: int | None = None  # ``_devices()``, at the first step counted

    def note(self, model: Any) -> None:
        """``prepare_model``, ``prepare_sharded_model`` or ``load_pretrained`` was given
        ``model`` (the plain module, before any wrapper). Never raises."""
        with self.lock:
            if model in self.models:
                return
        try:
            rule = flops_rule(model)
        except Exception as exc:  # noqa: BLE001 (observation never fails the preparation)
            rule = f"counting {type(model).__name__}'s FLOPs failed: {type(exc).__name__}: {exc}"
        with self.lock:
            self.models[model] = rule

    def per_step(self, tokens: float, token_positions: float, samples: float,
                 steps: int) -> tuple[float | None, str]:
        """(model FLOPs a step of one device of this worker, the rule) over ``steps`` steps whose
        batches held ``tokens`` (``token_positions``) and ``samples``; (None, why) where the
        package cannot know them."""
        with self.lock:
            models = list(self.models.items())
        rules = [rule for _, rule in models]
        if len(rules) > 1:
            names = ", ".join(sorted(type(m).__name__ for m, _ in models))
            return None, (f"{len(rules)} models were prepared ({names}): a step's FLOPs are "
                          f"not one model's; {THE_CALL}")
        if not rules:
            return None, NO_MODEL
        rule = rules[0]
        if isinstance(rule, str):
            return None, f"{rule}; {THE_CALL}"
        if not (tokens or samples):
            return None, ("no batch of these steps came from prepare_data_loader or "
                          f"iter_xla_batches (with gradients on), so their tokens are unknown; "
                          f"{THE_CALL}")
        flops = rule.flops(tokens, token_positions, samples)
        if flops is None:
            return None, (f"the model is counted per token ({rule.name}) but the batches hold "
                          f"no input_ids; {THE_CALL}")
        if self.devices is None:
            self.devices = _devices()
        return flops / steps / self.devices, rule.name


def _devices() -> int:
    """The devices one batch of this worker's loaders is computed on: under SPMD on an
    accelerator a process feeds every device of its host (its batch is theirs); with tensor
    parallelism the ``tp`` peers that share each batch (each computes its share of the model);
    else one."""
    from ray_train_xla.planning.contract import worker_context

    if worker_context().spmd:
        if not worker_context().spmd_global or "torch_xla" not in sys.modules:
            return 1
        import torch_xla.runtime as xr

        return max(1, xr.addressable_runtime_device_count())
    from ray_train_xla.toolkit.parallel import get_layout

    return get_layout().tp


def note_model(model: Any) -> None:
    """Note a model the package prepared (see ``ModelFlops.note``)."""
    from ray_train_xla.toolkit.runtime import runtime

    runtime().part("model_flops", ModelFlops).note(model)


def batch_counts(batch: Any) -> tuple[int, int, int] | None:
    """(tokens, tokens x their sequence's length, samples) of one batch of the toolkit's loaders;
    None when gradients are off (an evaluation loop's batch is no training step's). Tokens are
    the ``input_ids`` of a mapping (padding included), or a first tensor of token ids (int64 or
    int32) ``[batch, seq]``; samples the rows of the first tensor. About 1 to 2 us."""
    import torch

    if not torch.is_grad_enabled():
        return None
    first = _first_tensor(batch, torch.Tensor)
    if first is None:
        return None
    shape = first.shape
    if len(shape) == 2 and first.dtype in (torch.int64, torch.int32):
        rows, seq = shape
        return rows * seq, rows * seq * seq, rows
    return (0, 0, shape[0]) if shape else None


def _first_tensor(value: Any, tensor: type, depth: int = 0) -> Any:
    """A mapping's ``input_ids``, else the first ``tensor`` in ``value`` (tuples, lists,
    mappings; a padded batch is ``(batch, mask)``)."""
    if isinstance(value, tensor):
        return value
    if isinstance(value, (list, tuple)):
        items = value
    elif isinstance(value, Mapping):
        ids = value.get("input_ids")
        if isinstance(ids, tensor):
            return ids
        items = value.values()
    else:
        return None
    if depth < 3:
        for item in items:
            found = _first_tensor(item, tensor, depth + 1)
            if found is not None:
                return found
    return None


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """The FLOPs torch's ``FlopCounterMode`` counts in one call of ``fn(*args, **kwargs)`` (the
    matmuls, convolutions and attention kernels of its forward and backward).

    Where torch_xla is loaded (a ``TorchXLAConfig`` worker), its device is started first:
    torch's autograd engine sizes its device queues at the process's first backward pass, and
    a CPU backward before XLA's device existed would leave every later XLA backward without
    one (an internal assert of the engine)."""
    from torch.utils.flop_counter import FlopCounterMode

    if "torch_xla" in sys.modules:
        from ray_train_xla.toolkit.device import get_device

        get_device()

    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return float(counter.get_total_flops())


def matmul_tflops(size: int = 512, seconds: float = 0.2, dtype: Any = None, device: Any = None,
                  chain: int = 4) -> float:
    """This process's matmul TFLOP/s, measured: rounds of ``chain`` products of ``size`` square
    matrices in ``dtype`` (float32 by default) on ``device`` (the CPU by default; on an XLA
    device each round is one graph, run and waited for; on a native one, waited for), for
    about ``seconds`` after one untimed round (an XLA device compiles it); the best round."""
    import torch

    from ray_train_xla.toolkit import device as device_layer

    dev = torch.device("cpu") if device is None else torch.device(device)
    dtype = torch.float32 if dtype is None else dtype
    a = torch.randn(size, size, dtype=dtype).to(dev)
    b = (torch.randn(size, size) / size ** 0.5).to(dtype).to(dev)  # products stay near 1

    def one_round() -> None:
        c = a
        for _ in range(chain):
            c = torch.mm(c, b)
        if dev.type != "cpu":
            device_layer.sync()
            device_layer.wait()

    one_round()
    flops, best, deadline = 2.0 * size ** 3 * chain, 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        one_round()
        best = max(best, flops / (time.perf_counter() - start))
    return best / 1e12


# The peak MFU is taken against on CPU workers, where no published figure applies: the probe
# at its defaults (float32, the CPU).
cpu_peak_tflops = matmul_tflops
