"""Every ```python block of README.md and docs/*.md is run or compiled, and every
``ray_train_xla`` name it uses exists.

A block runs, in a fresh namespace, unless its first line is a marker comment
``# not run: <why>`` (it needs Trainium, a TPU, a Ray Train fit, ...); a marked block is
compiled only. Either way each ``ray_train_xla`` name it uses must resolve: ``from
ray_train_xla[.mod] import X``, ``import ray_train_xla[.mod]``, and attribute chains on the
names those bind (``rtx.X``, ``ray_train_xla.tools.consolidate.consolidate_hf``). No block
starts Ray.
"""

from __future__ import annotations

import ast
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 350
MARKER = re.compile(r"#\s*not run:\s*\S")
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def doc_files() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(docs) if f.endswith(".md"))


def blocks() -> list[tuple[str, int, str]]:
    """(file, line of the fence, code) of every python block."""
    out = []
    for name in doc_files():
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            text = f.read()
        for m in BLOCK.finditer(text):
            out.append((name, text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


BLOCKS = blocks()


def is_marked(code: str) -> bool:
    first = code.lstrip("\n").splitlines()[0] if code.strip() else ""
    return bool(MARKER.match(first.strip()))


def package_names(tree: ast.AST) -> list[str]:
    """Dotted ray_train_xla names the code uses, as ``module:attr.attr``."""
    aliases: dict[str, str] = {}  # local name -> dotted path inside the package
    used: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "ray_train_xla":
                    used.append(f"{a.name}:")
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases["ray_train_xla"] = "ray_train_xla"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray_train_xla":
            for a in node.names:
                used.append(f"{node.module}:{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = []
            cur: ast.AST = node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in aliases:
                used.append(f"{aliases[cur.id]}:{'.'.join(reversed(chain))}")
    return used


def resolve(ref: str) -> None:
    module, _, attrs = ref.partition(":")
    value = importlib.import_module(module)
    path = module
    for attr in filter(None, attrs.split(".")):
        path = f"{path}.{attr}"
        try:
            value = getattr(value, attr)
        except AttributeError:
            value = importlib.import_module(path)  # a submodule not imported yet


def test_every_block_is_found():
    assert len(BLOCKS) >= 10
    assert any(not is_marked(code) for _, _, code in BLOCKS)  # some do run
    readme = [code for name, _, code in BLOCKS if name == "README.md"]
    assert any(not is_marked(code) for code in readme)


@pytest.mark.parametrize("name,line,code", BLOCKS, ids=[f"{n}:{line}" for n, line, _ in BLOCKS])
def test_block_compiles_and_its_names_resolve(name, line, code):
    tree = ast.parse(code, filename=f"{name}:{line}")  # a SyntaxError names the block
    compile(tree, f"{name}:{line}", "exec")
    for ref in package_names(tree):
        try:
            resolve(ref)
        except (AttributeError, ImportError) as e:
            pytest.fail(f"{name}:{line}: {ref.replace(':', '.').rstrip('.')} does not resolve: {e}")


RUN = [(n, line, c) for n, line, c in BLOCKS if not is_marked(c)]


@pytest.mark.parametrize("name,line,code", RUN, ids=[f"{n}:{line}" for n, line, _ in RUN])
def test_block_runs(name, line, code):
    import ray

    namespace = {"__name__": f"doc_snippet_{os.path.basename(name)}_{line}"}
    exec(compile(code, f"{name}:{line}", "exec"), namespace)  # noqa: S102 - the docs' own code
    assert not ray.is_initialized(), f"{name}:{line} started Ray"


def test_names_are_checked():
    tree = ast.parse("import ray_train_xla as rtx\nfrom ray_train_xla import TorchXLAConfig\n"
                     "rtx.no_such_helper()\n")
    refs = package_names(tree)
    assert "ray_train_xla:no_such_helper" in refs and "ray_train_xla:TorchXLAConfig" in refs
    with pytest.raises((AttributeError, ImportError)):
        resolve("ray_train_xla:no_such_helper")
    resolve("ray_train_xla:tools.consolidate.consolidate_hf")


def test_marker_is_read():
    assert is_marked("# not run: needs Trainium\nx = 1\n")
    assert not is_marked("x = 1  # not run: only on the first line\n")


def test_readme_first_page_is_short():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_api_table_lists_every_public_name_once():
    """docs/api.md's tables name exactly ``ray_train_xla.__all__``, each once."""
    import ray_train_xla

    with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as f:
        rows = re.findall(r"^\| `([A-Za-z_][A-Za-z0-9_]*)` \|", f.read(), re.M)
    assert sorted(rows) == sorted(set(rows)), "a name has two rows"
    assert set(rows) == set(ray_train_xla.__all__), (
        f"missing: {sorted(set(ray_train_xla.__all__) - set(rows))}; "
        f"not public: {sorted(set(rows) - set(ray_train_xla.__all__))}")
