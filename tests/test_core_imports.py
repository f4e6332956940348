"""The planning core imports neither Ray nor torch; the package's folders import one way (down
``LAYERS``), no private name crosses modules, and there is no import cycle."""

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
import ray_train_xla.errors, ray_train_xla.planning
from ray_train_xla import XLAOptions, XLAConfigError
from ray_train_xla.tools.cli import main

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
        assert main(["plan", "--device", spmd_device, "--spmd", "--accelerators-per-worker", "4"]) == 0
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


def _module_importing(path: str, name: str) -> str:
    """The module that the file ``path`` imports ``name`` from (``from M import name``)."""
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            return node.module
    raise AssertionError(f"{path} does not import {name}")


def test_the_driver_and_the_memory_store_load_no_torch():
    # The backend starts the memory tier's stores: the module it takes them from, the stores'
    # own, loads no torch (nor do the packages above it), as the rest of the driver does not.
    store = _module_importing(os.path.join(PACKAGE_DIR, "driver", "backend.py"), "start_stores")
    code = ("import importlib, sys\n"
            "import ray_train_xla.driver.backend\n"
            f"store = importlib.import_module({store!r})\n"
            "assert store.MemoryStore and store.start_stores\n"
            "print('loaded', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_xla')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "loaded []" in out.stdout, f"{store} loads torch: {out.stdout[:300]}"


def test_blocking_works():
    # The guard itself: importing ray in the blocked interpreter fails.
    out = subprocess.run([sys.executable, "-c", BLOCKED + "import ray"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "blocked in this test" in out.stderr


def _modules() -> dict[str, str]:
    """Every module of the package: dotted name -> file."""
    modules: dict[str, str] = {}
    for root, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, name), os.path.dirname(PACKAGE_DIR))
                modules[rel[:-3].replace(os.sep, ".").removesuffix(".__init__")] = os.path.join(root, name)
    return modules


def _tree(path: str) -> ast.AST:
    """The module's syntax tree without its ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    return tree


def _package_imports(path: str, module: str, modules) -> set[str]:
    """Package modules that ``module`` imports anywhere (module level or inside functions):
    ``from pkg import sub`` counts as an import of ``pkg.sub`` when that is a module, else of
    ``pkg``."""
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                base = f"{module.rsplit('.', node.level)[0]}.{node.module}"
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(base)
    return {m for m in found if m.startswith("ray_train_xla")}


# The package's folders, lowest first: a module may import its own folder and the ones before
# it, never one after it. ``errors`` is below them all.
LAYERS = ("errors", "planning", "toolkit", "startup", "driver", "tools")


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return LAYERS.index("tools")  # the public root (lazy names): only the tools use it
    return LAYERS.index(parts[1])


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {mod: {d for d in _package_imports(path, mod, modules) if d in modules and d != mod}
            for mod, path in modules.items()}


def test_every_module_is_in_a_layer_and_imports_go_down():
    wrong = []
    for mod, deps in _graph().items():
        assert len(mod.split(".")) == 1 or mod.split(".")[1] in LAYERS, f"{mod}: not in {LAYERS}"
        wrong += [f"{mod} -> {d}" for d in deps if _layer(d) > _layer(mod)]
    assert not wrong, "imports that go up the layers " + str(LAYERS) + ":\n" + "\n".join(wrong)


def test_no_private_name_crosses_modules():
    modules = _modules()
    crossings = []
    for mod, path in modules.items():
        tree = _tree(path)
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray_train_xla"):
                for a in node.names:
                    if f"{node.module}.{a.name}" in modules:
                        aliases.add(a.asname or a.name)
                    elif a.name.startswith("_"):
                        crossings.append(f"{mod}: from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                aliases.update(a.asname for a in node.names
                               if a.name.startswith("ray_train_xla") and a.asname)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                crossings.append(f"{mod}: {node.value.id}.{node.attr}")
    assert not crossings, "\n".join(crossings)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    # The guard itself: a planning module importing the driver is reported.
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from ray_train_xla.driver import backend\n")
    deps = _package_imports(str(path), "ray_train_xla.planning.bad", _modules())
    assert deps == {"ray_train_xla.driver.backend"}
    assert _layer("ray_train_xla.driver.backend") > _layer("ray_train_xla.planning.bad")


def test_no_import_cycle_in_the_package():
    modules = _modules()
    graph = _graph()
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
