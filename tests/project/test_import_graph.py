"""gpt2attn's import graph is a tree reading downward: no module imports, at the top or inside a
function, anything that (through any chain) imports it back.

The graph is read from the source with `ast`, so imports that only run on some code path count too.
Last, what the command line's --help imports (nothing heavy: its parser is built without torch).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpt2attn

PACKAGE_DIR = Path(gpt2attn.__file__).resolve().parent



def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking_block(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` bodies never run, so their imports are not edges."""
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_names(tree: ast.AST, importer: str, is_package: bool) -> set[str]:
    """Every dotted module name the file may import (with the names it takes from each)."""
    names: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if is_type_checking_block(node):
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = importer.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)  # `from pkg import module`
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) == "importlib.import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value)
    return names


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for importer, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = set()
        for name in imported_names(tree, importer, path.name == "__init__.py"):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
                target = ".".join(parts[:i])
                is_own_package = importer == target or importer.startswith(target + ".")
                if target in files and not is_own_package:
                    targets.add(target)
        graph[importer] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path [a, b, ..., a], or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph[node]):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def test_the_graph_is_read():
    graph = import_graph()
    assert "gpt2attn.generation.generate" in graph["gpt2attn.model"] | graph["gpt2attn.generation"]
    assert "gpt2attn.cache" in graph["gpt2attn.layers"]
    assert "gpt2attn.model" in graph["gpt2attn.commands.generate"]  # a function-level import counts


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# The floors above the model: bridges to other libraries, the commands and the CLI. They import the
# model; nothing on the model's floors imports them (the package's __init__ installs the import hooks).
ABOVE_THE_MODEL = ("gpt2attn.interop", "gpt2attn.commands", "gpt2attn.cli", "gpt2attn.__main__")


def is_above(module: str) -> bool:
    return any(module == top or module.startswith(top + ".") for top in ABOVE_THE_MODEL)


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() if a != "gpt2attn" and not is_above(a)
                  for b in targets if is_above(b))


def test_the_model_imports_nothing_above_it():
    arrows = upward_arrows(import_graph())
    assert not arrows, "imports pointing up from the model's floors: " + ", ".join(arrows)


def test_upward_arrows_are_found():
    graph = {"gpt2attn.pretrained": {"gpt2attn.interop.peft", "gpt2attn.config"}, "gpt2attn.interop.peft": set(),
             "gpt2attn": {"gpt2attn.interop.hooks"}}
    assert upward_arrows(graph) == ["gpt2attn.pretrained -> gpt2attn.interop.peft"]


def modules_after(code: str, *args: str) -> set[str]:
    """sys.modules at the end of `python -c CODE ARGS` in a fresh process (CODE prints them last)."""
    done = subprocess.run([sys.executable, "-c", code + "\nprint(*sys.modules, file=sys.stderr)", *args],
                          cwd=PACKAGE_DIR.parent, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    return set(done.stderr.splitlines()[-1].split())


# `python -m gpt2attn ARGS`, ending normally (as --help and --version do) instead of exiting
RUN_THE_CLI = """import runpy, sys
sys.argv[0] = "gpt2attn"
try:
    runpy.run_module("gpt2attn", run_name="__main__", alter_sys=True)
except SystemExit as end:
    assert end.code == 0, end.code"""


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["--version"]])
def test_the_command_lines_help_imports_no_torch(args):
    """`gpt2attn --help` is fast: the parser is built from the command modules' HELP and
    add_arguments, which import neither torch nor the tokenizers library (each command's run() does)."""
    imported = modules_after(RUN_THE_CLI, *args)
    assert {"gpt2attn.cli", "gpt2attn.commands.train"} <= imported  # the modules were read
    assert not imported & {"torch", "numpy", "tokenizers"}


def test_import_gpt2attn_imports_the_model_only_when_a_name_is_used():
    """`import gpt2attn` is light; `gpt2attn.GPT2LMHeadModel` (or `from gpt2attn import ...`) imports it."""
    assert "torch" not in modules_after("import sys, gpt2attn")
    assert {"torch", "gpt2attn.model"} <= modules_after("import sys, gpt2attn; gpt2attn.GPT2LMHeadModel")
    assert "gpt2attn.heads" in modules_after("import sys; from gpt2attn import GPT2DoubleHeadsModel")
