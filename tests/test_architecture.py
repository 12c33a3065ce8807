"""Structure the package keeps: no import cycles between its modules (module-level or deferred imports alike), no
library code that writes environment variables (settings travel as values), no private names imported across
modules."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_muon"

def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules `path` imports anywhere (a `from pkg import submodule` names the submodule, not pkg)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = [a.name for a in node.names if f"{node.module}.{a.name}" in modules]
            found |= {f"{node.module}.{name}" for name in submodules}
            if node.module in modules and len(submodules) < len(node.names):
                found.add(node.module)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state, stack, cycles = {}, [], []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module] - {module}):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycles_between_package_modules():
    modules = _modules()
    graph = {name: _imports(path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def _environment_writes(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        for target in targets:
            if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "os.environ":
                lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, name = ast.unparse(node.func.value), node.func.attr
            if (owner == "os.environ" and name in ("update", "setdefault", "pop", "clear")) or \
                    (owner == "os" and name in ("putenv", "unsetenv")):
                lines.append(node.lineno)
    return lines


def test_the_environment_write_finder_sees_every_form(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("import os\nos.environ['A'] = '1'\nos.environ.update(B='2')\nos.putenv('C', '3')\n"
                    "os.environ['D'] += 'x'\nos.environ.get('E')\n")
    assert sorted(_environment_writes(path)) == [2, 3, 4, 5]


def test_library_code_writes_no_environment_variables():
    writers = {str(path.relative_to(PACKAGE)): lines for path in PACKAGE.rglob("*.py")
               if (lines := _environment_writes(path))}
    assert writers == {}


def test_megatron_glue_holds_no_kernels():
    """`megatron_muon/megatron/` only connects the plugin to megatron; kernels live in kernels/ and optimizer/."""
    glue = [str(path.relative_to(PACKAGE)) for path in (PACKAGE / "megatron").rglob("*.py")
            if "triton.jit" in path.read_text() or "import triton" in path.read_text()]
    assert glue == []


def test_no_module_imports_another_modules_private_names():
    """Private names stay inside their module; what another module (or a benchmark) needs is public."""
    found = []
    for root in (PACKAGE, PACKAGE.parent / "benchmarks"):
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_muon"):
                    found += [f"{path.name}:{node.lineno} {node.module}.{alias.name}" for alias in node.names
                              if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert found == []
