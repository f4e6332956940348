"""What the checkpoint benchmarks share: measure (or take the committed figures again with
``--markdown``), then write ``results/<name>.json`` and the ``<name>.md`` made from it."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))


def interval(values: list[float], level: float = 0.9, resamples: int = 2000) -> list[float]:
    """The bootstrap interval of the median of ``values`` (``level``: 90%), seeded."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    cut = int(resamples * (1 - level) / 2)
    return [medians[cut], medians[-cut - 1]]


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--markdown", action="store_true",
                        help="write the .md again from the committed .json, measuring nothing")


def write(args: argparse.Namespace, name: str, measure: Callable[[argparse.Namespace], dict],
          markdown: Callable[[dict], str]) -> int:
    path = os.path.join(args.out, f"{name}.json")
    if args.markdown:
        with open(path) as f:
            results = json.load(f)
    else:
        results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                   **measure(args)}
        os.makedirs(args.out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
    text = markdown(results)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)
    return 0
