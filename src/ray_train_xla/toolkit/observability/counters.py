"""This process's compile and execution counters, the one reader of them (``timeline.py``,
``metrics.py``, ``compile_causes.py``): torch_xla's, or on the native stacks ``torch.compile``'s
(graphs Dynamo compiled, each new shape or guard failure one more, and the time spent
compiling; executions there are eager and not counted: 0)."""

from __future__ import annotations

import sys

_NS = 1e-9


class Counters:
    """``compiles()``, ``compile_time_s()``, and ``count(name)``, ``seconds(name)`` of any other
    torch_xla counter or metric, at a few microseconds a call. A metric costs more than a
    counter: read ``CompileTime`` again only when the compile count moved, and ``ExecuteTime``
    only when asked for (torch_xla returns its last 1,024 samples with it, about 0.2 ms once
    its buffer is full). Raises ``ImportError`` without torch_xla on the XLA stack."""

    def __init__(self) -> None:
        from ray_train_xla.toolkit.stacks import stack

        self.native = stack().native
        if self.native:
            # Dynamo is imported by the first torch.compile: until then nothing was compiled, and
            # importing it here would cost every worker about a CPU second at its start.
            def compiles() -> float:
                if "torch._dynamo.utils" not in sys.modules:
                    return 0.0
                from torch._dynamo.utils import counters

                return float(counters["stats"]["unique_graphs"])

            def compile_time_s() -> float:
                if "torch._dynamo.utils" not in sys.modules:
                    return 0.0
                from torch._dynamo.utils import compilation_time_metrics

                return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))

            self.compiles, self.compile_time_s = compiles, compile_time_s
            self.count = self.seconds = lambda name: 0.0
            return
        import torch_xla

        counter, metric = torch_xla._XLAC._xla_counter_value, torch_xla._XLAC._xla_metric_data

        def seconds(name: str) -> float:
            data = metric(name)
            return float(data[1]) * _NS if data else 0.0

        self.count = lambda name: float(counter(name) or 0)
        self.seconds = seconds
        self.compiles = lambda: float(counter("UncachedCompile") or 0)
        self.compile_time_s = lambda: seconds("CompileTime")
