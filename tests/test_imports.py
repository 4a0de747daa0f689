"""The packages' import graph, read from the sources: no cycles (function-level imports
included: a cycle hidden inside a function is still one), the library never imports the
training stack or the benchmarks, no module uses another's private names, and JAX's and
orbax's private APIs are reached from one module only (jax_nvfp4/internals.py)."""

import ast
import os

from conftest import ROOT

PACKAGES = ("jax_nvfp4", "train", "benchmarks")


def _module(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def import_graph() -> dict:
    """``{module: {modules of PACKAGES it imports}}``; ``from pkg import name`` counts as
    ``pkg.name`` when that is a module, else ``pkg``."""
    modules = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    modules[_module(os.path.join(folder, f))] = os.path.join(folder, f)
    graph = {}
    for name, path in modules.items():
        deps = set()
        with open(path) as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        # A package's __init__ imports its submodules; a submodule importing its own package
        # means the package's public names, not a cycle through __init__.
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def find_cycle(graph: dict):
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                cycle = visit(d)
                if cycle:
                    return cycle
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            cycle = visit(n)
            if cycle:
                return cycle
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert "jax_nvfp4.collectives" in graph and "train.step" in graph and "benchmarks.stats" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    # convergence_text imports convergence_recipe, which imports the grid and the statistics, not
    # convergence_text back (not even from inside a function).
    assert {"benchmarks.convergence_recipe", "benchmarks.stats"} <= graph["benchmarks.convergence_text"]
    assert "benchmarks.convergence_text" not in graph["benchmarks.convergence_recipe"]
    # The check finds a cycle when there is one.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_library_never_imports_the_training_stack():
    graph = import_graph()
    bad = {m: sorted(d for d in deps if d.startswith("train")) for m, deps in graph.items() if m.startswith("jax_nvfp4")}
    assert not any(bad.values()), bad


def test_neither_the_library_nor_the_stack_imports_the_benchmarks():
    graph = import_graph()
    bad = {m: sorted(d for d in deps if d.startswith("benchmarks")) for m, deps in graph.items()
           if m.startswith(("jax_nvfp4", "train"))}
    assert not any(bad.values()), bad


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_library_names(path: str, package: str = "jax_nvfp4") -> list:
    """Private names of ``package`` a file uses: ``from jax_nvfp4... import _x`` and attribute
    chains through the names its imports bind (``nv._x``, ``nv.fetch._x``, and ``gemm._x``
    after ``from jax_nvfp4 import gemm``)."""
    with open(path) as fh:
        tree = ast.parse(fh.read())
    aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname or a.name for a in node.names if a.name.split(".")[0] == package)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package:
            found += [f"{node.module}.{a.name}" for a in node.names if _private(a.name)]
            found += [node.module] if any(_private(p) for p in node.module.split(".")) else []
            aliases.update(a.asname or a.name for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(".".join([base.id, *reversed(chain)]))
    return found


def test_the_training_stack_and_the_benchmarks_use_public_library_names_only():
    """train/, benchmarks/ and scripts/ are users of the library: its step, evaluation and
    model go through the public API, so anything a user's model needs is there for them too."""
    bad = {}
    for folder, _, files in (w for pkg in ("train", "benchmarks", "scripts") for w in os.walk(os.path.join(ROOT, pkg))):
        for f in files:
            if f.endswith(".py") and private_library_names(os.path.join(folder, f)):
                bad[os.path.relpath(os.path.join(folder, f), ROOT)] = private_library_names(os.path.join(folder, f))
    assert not bad, bad


def test_benchmarks_use_no_private_name_of_another_benchmark_module():
    """Shared helpers have public names in the module that owns them (benchmarks.stats,
    benchmarks.convergence_grid, benchmarks.arguments, ...), not ``ct._gaps``."""
    bad = {}
    for f in sorted(os.listdir(os.path.join(ROOT, "benchmarks"))):
        if f.endswith(".py"):
            names = private_library_names(os.path.join(ROOT, "benchmarks", f), "benchmarks")
            if names:
                bad[f] = names
    assert not bad, bad


def test_private_names_are_found(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import jax_nvfp4 as nv\nfrom jax_nvfp4.fetch import _manual_specs, Shard\n"
                   "x = nv.fetch._gather_fn\ny = nv.make_step\n")
    assert private_library_names(str(src)) == ["jax_nvfp4.fetch._manual_specs", "nv.fetch._gather_fn"]
    src.write_text("from benchmarks import convergence_text as ct, __main__ as cli\nfrom benchmarks.stats import _t\n"
                   "x = ct._gaps\ny = ct.run_one\nz = cli.main\n")
    assert private_library_names(str(src), "benchmarks") == ["benchmarks.stats._t", "ct._gaps"]


UPSTREAM = ("jax", "orbax", "flax", "optax")


def upstream_private_names(path: str) -> list:
    """Private names of JAX, orbax, Flax or optax a file uses (:func:`private_library_names` of
    each), and ``getattr(x, "_name")``: a private attribute read by its name."""
    found = [n for pkg in UPSTREAM for n in private_library_names(path, pkg)]
    with open(path) as fh:
        tree = ast.parse(fh.read())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            found.append(f"{node.func.id}(..., {node.args[1].value!r})")
    return found


def test_private_upstream_apis_are_used_in_one_module():
    """Where no public JAX or orbax API serves, the private one is reached through
    jax_nvfp4/internals.py, which says why: an upgrade that moves it breaks there only."""
    bad = {}
    for pkg in (*PACKAGES, "scripts"):
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                path = os.path.join(folder, f)
                if f.endswith(".py") and os.path.relpath(path, ROOT) != os.path.join("jax_nvfp4", "internals.py"):
                    if names := upstream_private_names(path):
                        bad[os.path.relpath(path, ROOT)] = names
    assert not bad, bad
    assert upstream_private_names(os.path.join(ROOT, "jax_nvfp4", "internals.py"))  # the holder is seen


def test_upstream_private_names_are_found(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import jax\nfrom jax._src import distributed\nfrom orbax.checkpoint._src.path import async_path\n"
                   "x = jax._src.core\ny = getattr(m, '_cleanup', None)\nz = getattr(m, '__module__', '')\n")
    assert upstream_private_names(str(src)) == ["jax._src", "jax._src", "orbax.checkpoint._src.path",
                                                "getattr(..., '_cleanup')"]
