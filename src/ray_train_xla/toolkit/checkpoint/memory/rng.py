"""Each rank's random number generators, kept with every memory generation (``keep_in_memory``)
as a small file of that rank (``rng-<rank>.pkl``), and set again when ``load_checkpoint``
restores that generation in a world of the same size: after a recovery (in place, or a restart
from memory) a rank draws what it would have drawn without the fault (dropout masks, random
crops, a data loader's worker seeds).

The generators: torch's CPU generator, the accelerator's when torch has one
(``torch.accelerator``), Python's ``random`` and NumPy's global one. A restore in a world of
another size, or of a generation kept without them, leaves them as they are, and says so; so
does an accelerator's generator restored in a process without that accelerator.
"""

from __future__ import annotations

import logging
import pickle
import random
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


def file_name(rank: int) -> str:
    return f"rng-{rank}.pkl"


def capture() -> bytes:
    """This process's generators' states, as a rank's file holds them."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    device = _accelerator()
    if device is not None:
        state["device"] = (device, torch.get_device_module(device).get_rng_state())
    return pickle.dumps(state)


def restore(data: bytes) -> list[str]:
    """Set this process's generators from ``data`` (:func:`capture`'s); returns their names."""
    state = pickle.loads(bytes(data))  # noqa: S301 (written by this run's ranks, read back here)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    names = ["torch", "python", "numpy"]
    if "device" in state:
        device, value = state["device"]
        if device == _accelerator():
            torch.get_device_module(device).set_rng_state(value)
            names.append(device)
        else:
            logger.warning("the %s generator kept with this generation is not restored: this "
                           "process has %s", device, _accelerator() or "no accelerator")
    return names


def _accelerator() -> str | None:
    """The accelerator's device type whose generator is kept, None on CPU."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return None
    device = accelerator.current_accelerator()
    module = torch.get_device_module(device.type) if device is not None else None
    return device.type if module is not None and hasattr(module, "get_rng_state") else None
