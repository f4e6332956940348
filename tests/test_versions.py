"""The Python and torch of each stack are stated once (``planning/versions.py``): the README's
table of stacks, the package's own torch pin and the Makefile's native torch agree with it."""

from __future__ import annotations

import os
import re

from ray_train_xla.planning import versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_stacks() -> dict[str, dict[str, str]]:
    """The README's first table (stack | hardware | config | Python | torch), by stack name."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    table = re.search(r"^\| stack \| hardware \| config \| Python \| torch \|\n\|[-|]+\|\n((?:\|.*\|\n)+)",
                      text, re.M)
    assert table, "README: the table of stacks (stack | hardware | config | Python | torch) is gone"
    rows = {}
    for line in table.group(1).splitlines():
        stack, hardware, config, python, torch = (c.strip() for c in line.strip("|").split("|"))
        rows[stack] = {"hardware": hardware, "config": config.strip("`").removesuffix("()"),
                       "python": python, "torch": torch}
    return rows


def _span(text: str) -> tuple[str, str]:
    """'3.12 to 3.14' -> ('3.12', '3.14'); '2.13, 2.14' -> ('2.13', '2.14'); '2.9' -> ('2.9', '2.9')."""
    found = re.findall(r"\d+\.\d+", text)
    return found[0], found[-1]


def test_the_readme_table_states_each_stacks_python_and_torch():
    rows = _readme_stacks()
    for name in ("native TorchNeuron", "native TorchTPU", "torch_xla"):
        stack = versions.stack(name)
        [row] = [r for key, r in rows.items() if key.startswith(name)]
        assert row["config"] == stack.config, (name, row)
        assert _span(row["python"]) == stack.python, (name, row["python"], stack.python)
        assert _span(row["torch"]) == stack.torch, (name, row["torch"], stack.torch)
    # The XLA SDK's narrower Python is said in the torch_xla row.
    sdk = versions.stack("Trainium XLA SDK")
    [xla] = [r for key, r in rows.items() if key.startswith("torch_xla")]
    assert f"Python {sdk.python[0]} to {sdk.python[1]}" in xla["hardware"], xla


def test_the_package_pin_and_the_native_environment_follow_the_supported_range():
    """pyproject's torch pin ends at the newest torch a config supports; `make test-native` runs
    the newest torch the native TorchNeuron stack ships."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        pin = re.search(r'"torch>=([\d.]+),<([\d.]+)"', f.read())
    newest = max((high for _, _, high in versions.SUPPORTED_TORCH),
                 key=lambda v: tuple(map(int, v.split("."))))
    oldest = min((low for _, low, _ in versions.SUPPORTED_TORCH),
                 key=lambda v: tuple(map(int, v.split("."))))
    major, minor = map(int, newest.split("."))
    assert pin and pin.group(1) == oldest and pin.group(2) == f"{major}.{minor + 1}", pin
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        native = re.search(r"^NATIVE_TORCH \?= (\S+)", f.read(), re.M).group(1)
    assert native in versions.TESTED_TORCH
    assert versions.in_range(native, *versions.stack("native TorchNeuron").torch)
    assert native.rsplit(".", 1)[0] == versions.stack("native TorchNeuron").torch[1]


def test_in_range_and_python_problem():
    assert versions.in_range("2.13.0+cpu", "2.9", "2.14")
    assert not versions.in_range("2.15.0", "2.9", "2.14")
    assert versions.python_problem("3.11.7", "native TorchNeuron").startswith("native TorchNeuron")
    assert versions.python_problem("3.12.0", "native TorchNeuron") == ""
    assert versions.python_problem("3.11.0", None) == ""
