"""Model FLOPs: what a step computes, for model FLOPs utilisation (MFU), counted as torchtitan
and MaxText count them (``docs/observability.md``): :func:`model_flops_per_token` for a Hugging
Face decoder, :func:`count_flops` (torch's own ``FlopCounterMode``) for any model.
``configure_timeline(flops_per_step=...)`` takes the result (``timeline.py``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
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
    matmul, other = 0, []
    for name, m in module.named_modules():
        weight = getattr(m, "weight", None)
        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D":  # GPT-2's is a matmul
            matmul += m.weight.numel()
        elif isinstance(weight, torch.Tensor) and weight.dim() > 1 \
                and not isinstance(m, torch.nn.Embedding):
            other.append(f"{name} ({type(m).__name__})")
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size")
               if not isinstance(getattr(config, k, None), int)]
    if other or missing:
        what = (f"weights of a kind it does not count: {', '.join(other[:3])}" if other
                else f"a config without {', '.join(missing)}")
        raise ValueError(f"model_flops_per_token: {type(module).__name__} has {what}; it counts "
                         "Hugging Face decoders of linear layers: measure this model's step "
                         "with count_flops(step) instead")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = 12 * config.num_hidden_layers * heads * head_dim * seq_len
    return 6.0 * matmul + (attention / 2 if causal_half else attention)


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
