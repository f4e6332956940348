"""The planning core imports neither Ray nor torch, and the package has no import cycle."""

import ast
import os
import subprocess
import sys

import ray_train_xla

PACKAGE_DIR = os.path.dirname(ray_train_xla.__file__)

# Run in a fresh interpreter where ray, torch and torch_xla cannot be imported at all.
BLOCKED = r"""
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "torch", "torch_xla"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
"""

CORE = r"""
import io, contextlib, json
import ray_train_xla.errors, ray_train_xla.options, ray_train_xla.topology, ray_train_xla.runtimes
from ray_train_xla import XLAOptions, XLAConfigError
from ray_train_xla.cli import main

try:
    XLAOptions(device="gpu")
except XLAConfigError as exc:
    print("error:", exc)
out = io.StringIO()
with contextlib.redirect_stdout(out):
    assert main(["plan", "--device", "neuron", "--nodes", "2", "--workers-per-node", "2", "--json"]) == 0
plans = json.loads(out.getvalue())
print("planned", len(plans), plans[3]["env"]["NEURON_RT_VISIBLE_CORES"])
for spmd_device in ("tpu", "neuron"):
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["plan", "--device", spmd_device, "--spmd", "--cores-per-worker", "4"]) == 0
print("loaded", sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "torch", "torch_xla")))
"""


def test_planning_core_and_plan_command_need_neither_ray_nor_torch():
    out = subprocess.run([sys.executable, "-c", BLOCKED + CORE], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "error: XLAOptions.device='gpu'" not in out.stdout  # the class users see is named
    assert "error: TorchXLAConfig.device='gpu' is not valid" in out.stdout
    assert "planned 4 0,1" in out.stdout
    assert "loaded []" in out.stdout


def test_blocking_works():
    # The guard itself: importing ray in the blocked interpreter fails.
    out = subprocess.run([sys.executable, "-c", BLOCKED + "import ray"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "blocked in this test" in out.stderr


def _package_imports(path: str, module: str) -> set[str]:
    """Package modules that ``module`` imports anywhere (module level or inside functions),
    leaving out ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                base = f"{module.rsplit('.', node.level)[0]}.{node.module}"
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("ray_train_xla")}


# The one place where the config names the backend: Ray's ``backend_cls`` hook.
ALLOWED = {("ray_train_xla.config", "ray_train_xla.backend")}


def test_no_import_cycle_in_the_package():
    modules: dict[str, str] = {}
    for root, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, name), os.path.dirname(PACKAGE_DIR))
                mod = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
                modules[mod] = os.path.join(root, name)
    graph = {}
    for mod, path in modules.items():
        deps = {d for d in _package_imports(path, mod) if d in modules and d != mod}
        graph[mod] = {d for d in deps if (mod, d) not in ALLOWED}
    # Depth-first search for a back edge.
    state: dict[str, int] = {}
    cycle: list[str] = []

    def dfs(node, stack):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle.extend(stack[stack.index(dep):] + [node, dep] if dep in stack else [node, dep])
                return True
            if dep not in state and dfs(dep, stack + [node]):
                return True
        state[node] = 2
        return False

    for mod in sorted(graph):
        if mod not in state and dfs(mod, []):
            break
    assert not cycle, " -> ".join(cycle)
    # The package root imports its names on first use: the planning core stays light.
    root = ast.parse(open(modules["ray_train_xla"]).read())
    assert not [n for n in root.body if isinstance(n, ast.ImportFrom) and n.module
                and n.module.startswith("ray_train_xla")]
