"""The package's layers run one way (docs/design.md section 1): every import of every module,
including those inside functions, goes to the same layer or a lower one, the modules' import graph
has no cycle, and no module imports another module's underscore names."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tokenbatch_env"

#: (layer, module-name prefixes), lowest first; the longest matching prefix decides a module's layer.
#: Command modules (``*_cli``, ``cli``) sit on top whatever their package.
LAYERS = (
    ("base", ("tokenbatch_env.errors", "tokenbatch_env._io", "tokenbatch_env.util", "tokenbatch_env.config_cli")),
    ("engine model", ("tokenbatch_env.engine._jit", "tokenbatch_env.engine.scoring", "tokenbatch_env.engine.cost_model",
                      "tokenbatch_env.engine.profiles")),
    ("traces", ("tokenbatch_env.traces",)),
    ("engine", ("tokenbatch_env.engine",)),
    ("policies/metrics", ("tokenbatch_env.policies", "tokenbatch_env.predictors", "tokenbatch_env.metrics",
                          "tokenbatch_env.bounds", "tokenbatch_env.params", "tokenbatch_env.workload")),
    ("envs/evaluation", ("tokenbatch_env.envs", "tokenbatch_env.control", "tokenbatch_env.evaluate",
                         "tokenbatch_env.report", "tokenbatch_env.capacity", "tokenbatch_env.capacity_bridge",
                         "tokenbatch_env.plan", "tokenbatch_env.plan_pd", "tokenbatch_env.integrations")),
    ("tuning/agents", ("tokenbatch_env.tuning", "tokenbatch_env.robust", "tokenbatch_env.agents",
                       "tokenbatch_env.sb3")),
    ("commands", ()),
)
TOP = len(LAYERS) - 1


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def layer_of(mod: str) -> int:
    named = [i for i, (_, prefixes) in enumerate(LAYERS) if mod in prefixes]
    if named:
        return named[0]
    last = mod.rsplit(".", 1)[-1]
    if mod == "tokenbatch_env.cli" or last.endswith("_cli") or mod == "tokenbatch_env.__main__":
        return TOP
    if mod == "tokenbatch_env":           # the package's __init__: Trace, the errors, the env's registration
        return LAYERS.index(next(x for x in LAYERS if x[0] == "traces"))
    best, layer = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    assert layer is not None, f"{mod} is in no layer: add it to LAYERS (and docs/design.md section 1)"
    return layer


def from_target(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module name of ``from <target> import ...`` in module ``mod``."""
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mod: str, path: Path, known: dict) -> list:
    """(line, imported module, names imported from it) of every import in the file, resolved to the
    package's modules (``from . import x`` of a submodule x counts as importing x)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    out.append((node.lineno, a.name, ()))
        elif isinstance(node, ast.ImportFrom):
            target = from_target(mod, is_pkg, node)
            if target not in known:
                continue
            names = []
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in known:
                    out.append((node.lineno, sub, ()))
                else:
                    names.append(a.name)
            if names:
                out.append((node.lineno, target, tuple(names)))
    return out


def graph() -> tuple:
    known = modules()
    edges, where = {}, {}
    for mod, path in known.items():
        for line, target, names in imports(mod, path, known):
            if target == mod or mod.startswith(target + "."):   # a package's own __init__ (always loaded)
                continue
            edges.setdefault(mod, set()).add(target)
            where.setdefault((mod, target), []).append((line, names))
    return known, edges, where


def test_every_module_has_a_layer():
    for mod in modules():
        layer_of(mod)


def test_no_upward_import():
    known, edges, where = graph()
    bad = []
    for mod, targets in edges.items():
        for t in targets:
            if layer_of(t) > layer_of(mod):
                lines = ", ".join(str(ln) for ln, _ in where[(mod, t)])
                bad.append(f"{mod} (layer {LAYERS[layer_of(mod)][0]}) imports {t} (layer {LAYERS[layer_of(t)][0]}) "
                           f"at line {lines}")
    assert bad == [], "\n".join(sorted(bad))


def strongly_connected(edges: dict) -> list:
    """Tarjan's algorithm, iterative: the components with more than one module."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]
    nodes = set(edges) | {t for ts in edges.values() for t in ts}
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return comps


def test_no_import_cycle():
    _, edges, _ = graph()
    assert strongly_connected(edges) == []


def test_cycle_finder_finds_cycles():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_underscore_names_across_modules():
    known, _, where = graph()
    bad = [f"{mod} imports {', '.join(n for n in names if n.startswith('_'))} from {t} (line {line})"
           for (mod, t), uses in where.items() for line, names in uses
           if any(n.startswith("_") and not n.startswith("__") for n in names)]
    assert bad == [], "\n".join(sorted(bad))


def module_aliases(mod: str, path: Path, known: dict) -> dict:
    """Names bound in the file to one of the package's modules (``from ..engine import kernel as K``,
    ``import tokenbatch_env.engine.kernel as kernel``): alias -> module."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known and a.asname:
                    out[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            target = from_target(mod, is_pkg, node)
            for a in node.names:
                if f"{target}.{a.name}" in known:
                    out[a.asname or a.name] = f"{target}.{a.name}"
    return out


def test_no_underscore_attributes_across_modules():
    """``K._name`` on another module bound to a name is the same breach as importing ``_name``."""
    known = modules()
    bad = []
    for mod, path in known.items():
        aliases = module_aliases(mod, path, known)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != mod):
                bad.append(f"{mod} reads {aliases[node.value.id]}.{node.attr} (line {node.lineno})")
    assert bad == [], "\n".join(sorted(bad))


def test_import_light():
    """``import tokenbatch_env`` imports no numba, torch, SB3 or Optuna (docs/design.md section 1)."""
    from conftest import heavy_modules_loaded
    assert heavy_modules_loaded("tokenbatch_env", ("numba", "torch", "stable_baselines3", "optuna")) == []
