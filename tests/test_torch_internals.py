"""The private names of torch, torch_xla and the other libraries the package builds on: every one
the source uses is listed in docs/architecture.md ("Private names"), with what it is for; each
listed one is still there in the installed version, and a callable still takes the arguments
the source passes it. `make test` runs this on torch 2.9 (with torch_xla), `make test-native`
again on torch 2.13 (the torch_xla names are checked where torch_xla is installed; the torch-tpu
names in the torch-tpu environment of ``test_native_tpu_contract.py``).

The source is read, not imported (``ast``): a private name is an import from a private module or
of a private name, an attribute chain with a private part that starts at an imported module of
one of those libraries, a private attribute of another object that is not one of our own
(``value._local_tensor``), or a dotted module path in a string."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re

import pytest

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.14.1

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src", "ray_train_xla")
LIBRARIES = ("torch", "torch_xla", "torch_tpu", "torch_neuronx", "ray", "transformers",
             "huggingface_hub", "accelerate", "safetensors", "pyarrow", "libneuronxla")
HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


ATTRIBUTE_CALLS = ("getattr", "hasattr", "setattr")
PYTHONS = ("_fields", "_asdict", "_replace")  # a namedtuple's documented API


def _named_attribute(node: ast.AST) -> tuple[ast.AST, str] | None:
    """(the object, the name) of ``getattr(obj, "_name", ...)`` and its kin."""
    if isinstance(node, ast.Call) and len(node.args) >= 2 and \
            isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else \
            func.attr if isinstance(func, ast.Attribute) else None
        if name in (*ATTRIBUTE_CALLS, "__setattr__"):
            return node.args[0], node.args[1].value
    return None


def _ours(trees: dict[str, ast.AST]) -> set[str]:
    """Attribute names our own code defines: the methods and class attributes of our classes,
    what it sets on ``self`` or ``cls``, or on another object by name (``setattr``,
    ``object.__setattr__``)."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for n in node.body:
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(n.name)
                    targets = n.targets if isinstance(n, ast.Assign) else \
                        [n.target] if isinstance(n, ast.AnnAssign) else []
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in ("self", "cls") and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            named = _named_attribute(node)
            if named and isinstance(node.func, ast.Attribute | ast.Name) and \
                    getattr(node.func, "attr", getattr(node.func, "id", "")) in ("setattr",
                                                                                 "__setattr__"):
                names.add(named[1])
    return names


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None when it does not start at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_names(src: str = SRC) -> dict[str, set[str]]:
    """Each private name of another library the source uses -> the files using it."""
    trees = {}
    for folder, _, files in os.walk(src):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    trees[os.path.relpath(path, src)] = tree = ast.parse(f.read())
                for node in ast.walk(tree):  # a chain is read from its outermost attribute
                    for child in ast.iter_child_nodes(node):
                        child.parent = node
    ours = _ours(trees)
    found: dict[str, set[str]] = {}
    for rel, tree in trees.items():
        modules: dict[str, str] = {}  # a local name -> the library module it was bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in LIBRARIES:
                        modules[a.asname or a.name.split(".")[0]] = \
                            a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] in LIBRARIES and not node.level:
                for a in node.names:
                    modules[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            keys = []
            if isinstance(node, ast.Import):
                keys = [a.name for a in node.names if a.name.split(".")[0] in LIBRARIES
                        and any(map(_private, a.name.split(".")))]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level and \
                    node.module.split(".")[0] in LIBRARIES:
                keys = [f"{node.module}.{a.name}" for a in node.names
                        if any(map(_private, f"{node.module}.{a.name}".split(".")))]
            elif isinstance(node, ast.Attribute):
                chain = _chain(node)
                if chain and chain[0] in modules:
                    # From an imported module, read from the chain's outermost attribute (a
                    # private import is a key of its own: its chain counts when it reaches a
                    # private name further).
                    if not isinstance(getattr(node, "parent", None), ast.Attribute) and \
                            any(map(_private, chain[1:])):
                        keys = [".".join([modules[chain[0]], *chain[1:]])]
                elif _private(node.attr) and node.attr not in ours and \
                        node.attr not in PYTHONS and not (chain and chain[0] in ("sys", "os")):
                    keys = ["." + node.attr]  # (sys._getframe, os._exit: Python's own)
            elif _named_attribute(node) and _private(_named_attribute(node)[1]):
                owner, name = _named_attribute(node)
                chain = _chain(owner)
                if chain and chain[0] in modules:
                    keys = [".".join([modules[chain[0]], *chain[1:], name])]
                elif name not in ours and name not in PYTHONS and not (
                        chain and chain[0] in ("self", "cls", "os", "sys")):
                    keys = ["." + name]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"[A-Za-z_][\w.]*", node.value) and \
                    node.value.split(".")[0] in LIBRARIES and "." in node.value and \
                    any(map(_private, node.value.split("."))):
                keys = [node.value]
            for key in keys:
                found.setdefault(key, set()).add(rel)
    return found


def documented() -> dict[str, str]:
    """The names of the table in docs/architecture.md's "Private names" section -> their row."""
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Private names", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cell = line.split("|")[1]
            for name in re.findall(r"`([^`]+)`", cell):
                rows[name] = line
    return rows


def _listed(key: str, names: dict[str, str]) -> bool:
    return any(key == n or (key.startswith(".") and n.endswith(key)) for n in names)


def test_every_private_name_the_source_uses_is_listed_and_every_listed_one_is_used():
    found = private_names()
    names = documented()
    missing = {k: sorted(v) for k, v in found.items() if not _listed(k, names)}
    assert not missing, f"private names used but not listed in docs/architecture.md: {missing}"
    stale = [n for n in names if not any(k == n or (k.startswith(".") and n.endswith(k))
                                         for k in found)]
    assert not stale, f"listed in docs/architecture.md but no longer used: {stale}"


def test_the_scan_finds_each_kind_of_private_name(tmp_path):
    """The scan itself: what it must find, and what is ours or Python's."""
    (tmp_path / "m.py").write_text(
        "import torch\nimport torch.distributed as dist\nimport sys\n"
        "from torch.distributed.checkpoint._nested_dict import flatten_state_dict\n"
        "from torch.distributed.checkpoint.filesystem import _StorageInfo\n"
        "class A:\n    def __init__(self):\n        self._mine = 1\n"
        "    def f(self, stager):\n        stager._hidden(self._mine)\n"
        "        dist.distributed_c10d._get_default_store()\n"
        "        torch._C.PyTorchFileReader(b'').get_record_offset('x')\n"
        "        sys._getframe(0)\n        return 'torch._dynamo.utils' in sys.modules\n")
    assert set(private_names(str(tmp_path))) == {
        "torch.distributed.checkpoint._nested_dict.flatten_state_dict",
        "torch.distributed.checkpoint.filesystem._StorageInfo", "._hidden",
        "torch.distributed.distributed_c10d._get_default_store", "torch._C.PyTorchFileReader",
        "torch._dynamo.utils"}


def test_the_versions_tested_are_stated():
    import ray
    import torch

    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        section = f.read().split("## Private names", 1)[1].split("\n## ", 1)[0]
    assert f"torch {torch.__version__.split('+')[0]}" in section
    assert f"Ray {ray.__version__}" in section
    if HAS_TORCH_XLA:
        import torch_xla

        assert f"torch_xla {torch_xla.__version__.split('+')[0]}" in section


def _resolve(name: str):
    """The object a dotted name names: its longest importable module, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def _dtensor_class():
    from torch.distributed.tensor import DTensor

    return DTensor  # its __slots__: the local shard


def _wrap_policy():
    import torch
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return ModuleWrapPolicy({torch.nn.Linear})


class _SetOnShards:
    """torch_xla's FSDP marks each flat parameter shard it makes (``p._is_sharded = True``)."""

    def __init__(self) -> None:
        import inspect

        from torch_xla.distributed.fsdp import xla_fully_sharded_data_parallel as fsdp

        if "._is_sharded = True" in inspect.getsource(fsdp):
            self._is_sharded = True


def _functional_library():
    import torch

    return torch.library.Library("_ray_train_xla_probe", "FRAGMENT")


def _pretrained_class():
    import transformers

    return transformers.PreTrainedModel


def _tensor():
    import torch

    return torch.ones(1)


def _module():
    import torch

    return torch.nn.Linear(1, 1)


# The private attributes of objects (not of a module): where each lives.
ON_OBJECTS = {
    "._local_tensor": _dtensor_class,
    "._module_classes": _wrap_policy,
    "._destroy": _functional_library,
    "._version": _tensor,
    "._parameters": _module,
    "._buffers": _module,
    "._non_persistent_buffers_set": _module,
    "._from_config": _pretrained_class,
    "._init_weights": _pretrained_class,
    "._tied_weights_keys": _pretrained_class,
    "._tp_plan": _pretrained_class,
    "._keep_in_fp32_modules": _pretrained_class,
    "._keys_to_ignore_on_load_unexpected": _pretrained_class,
    "._is_sharded": _SetOnShards,
}

# How the source calls the private callables: (positional arguments, keywords). A signature
# that no longer takes them fails here (where Python can read the signature).
CALLS = {
    "torch.distributed.checkpoint.state_dict_loader._load_state_dict":
        (1, ["storage_reader", "planner", "no_dist"]),
    "torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner": (0, ["keys"]),
    "torch.distributed.checkpoint._dedup_save_plans.dedup_save_plans":
        (1, ["save_to_lowest_rank"]),
    "torch.distributed.checkpoint._nested_dict.flatten_state_dict": (1, []),
    "torch.distributed.checkpoint._consolidate_hf_safetensors."
    "consolidate_safetensors_files_on_every_rank": (3, ["process_group"]),
    "torch.distributed.checkpoint._hf_utils._gen_file_name": (2, []),
    "torch.distributed.distributed_c10d._get_default_store": (0, []),
    "torch._disable_dynamo": (1, []),
    "torch.distributed._composable.checkpoint": (1, []),
    "torch_xla.experimental.distributed_checkpoint._helpers._sharded_cpu_state_dict": (1, []),
}


def _checkable(key: str) -> str | None:
    """Why ``key`` is not checked in this environment, or None."""
    if key.startswith("torch_xla") or key == "._is_sharded":
        return None if HAS_TORCH_XLA else "torch_xla is not installed here"
    if key.startswith(("torch_tpu", "torch_neuronx", "libneuronxla")):
        return "checked where the package is installed (test_native_tpu_contract.py for torch_tpu)"
    return None


@pytest.mark.parametrize("key", sorted(private_names()))
def test_each_private_name_is_there_and_takes_what_we_pass(key):
    why = _checkable(key)
    if why is not None:
        pytest.skip(why)
    if key.startswith("."):
        owner = ON_OBJECTS[key]()
        assert hasattr(owner, key[1:]), f"{type(owner).__name__}{key} is gone"
        obj = getattr(owner, key[1:])
    else:
        obj = _resolve(key)
    if key in CALLS:
        args, kwargs = CALLS[key]
        assert callable(obj), key
        try:
            signature = inspect.signature(obj)
        except (TypeError, ValueError):  # a C function: no signature to read
            return
        signature.bind(*[None] * args, **dict.fromkeys(kwargs))


