"""The import map of schedule/ and planner/ (DESIGN.md's layering): no module imports itself
back through others, the schedule model needs nothing from the planner but the registry's
generators, and neither package imports torch."""
import ast
import os

import megatron_vshape

ROOT = os.path.dirname(megatron_vshape.__file__)
PACKAGES = ("schedule", "planner")


def _imports(pkg, name):
    """The project modules `pkg/name.py` imports, as 'pkg.mod', and the top-level packages."""
    tree = ast.parse(open(os.path.join(ROOT, pkg, name + ".py")).read())
    out, top = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                top.add(node.module.split(".")[0])
                continue
            base = pkg if node.level == 1 else None
            parts = (node.module or "").split(".") if node.module else []
            if base is None:  # from ..other.mod import x / from ..other import mod
                base, parts = parts[0], parts[1:]
            if parts:
                out.add(f"{base}.{parts[0]}")
            else:
                out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if os.path.exists(os.path.join(ROOT, *m.split(".")) + ".py")}, top


def _graph():
    return {f"{pkg}.{f[:-3]}": _imports(pkg, f[:-3]) for pkg in PACKAGES
            for f in os.listdir(os.path.join(ROOT, pkg)) if f.endswith(".py") and f != "__init__.py"}


def test_no_import_circle():
    graph = {k: v[0] for k, v in _graph().items()}
    done, path = set(), []

    def visit(m):
        assert m not in path, "import circle: " + " -> ".join(path[path.index(m):] + [m])
        if m in done:
            return
        path.append(m)
        for n in sorted(graph.get(m, ())):
            visit(n)
        path.pop()
        done.add(m)
    for m in sorted(graph):
        visit(m)


def test_the_model_needs_the_planner_only_for_the_registry_and_no_torch():
    for mod, (deps, top) in _graph().items():
        assert "torch" not in top, mod
        if mod.startswith("schedule.") and mod != "schedule.registry":
            assert not any(d.startswith("planner.") for d in deps), (mod, deps)
    assert "planner.generators" in _graph()["schedule.registry"][0]
