"""The layer rules of docs/layout.md, enforced on every import in the tree (function-level imports included).

Layers, highest first; a module may import its own layer and the ones below it, never one above:

    mint.cli > mint.train > mint.serve > mint.hub > mint.rollout > mint.models > mint.rl > mint.config > mint
        > mint.errors > longstraw > mint_kernels

and third-party rules: Ray and DeepSpeed only in mint.train; triton only in kernels/; kernels/ imports torch and
triton only; outside mint/hub, code reaches MinT through `mint.hub`'s public API, never its modules; serving stands
apart from the store: mint.hub never imports mint.serve, and mint.serve imports no `_`-prefixed module or name of
another package (the rollout engine through its public names). Within mint.train, Ray calls (`ray.get`, `.remote`)
stay with the owners of the actors (the learner group, the rollout fleet, the engine servers) and the driver.
"""

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    "mint.cli",
    "mint.train",
    "mint.serve",
    "mint.hub",
    "mint.rollout",
    "mint.envs",  # environments and tools: the rollout side runs episodes; no Ray, no torch
    "mint.models",
    "mint.rl",
    "mint.config",
    "mint",  # mint/__init__.py (re-exports MintError); a new top-level mint module must be given its own layer
    "mint.errors",
    "longstraw",
    "mint_kernels",
]
ONLY_IN = {"ray": "mint.train", "deepspeed": "mint.train", "triton": "mint_kernels"}
KERNELS_MAY_IMPORT = {"torch", "triton", "math", "itertools", "__future__", "functools", "os", "mint_kernels"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":  # kernels/mint_kernels/... is the library mint_kernels (kernels/pyproject.toml)
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> int | None:
    """Index of the most specific layer that `module` belongs to (None: not ours)."""
    best = None
    for i, layer in enumerate(LAYERS):
        if (module == layer or module.startswith(layer + ".")) and (best is None or len(layer) > len(LAYERS[best])):
            best = i
    return best


def _imports(path: Path, with_typing: bool = True) -> list[str]:
    """Every module `path` imports, function-level imports included; `with_typing=False` leaves out the imports under
    `if TYPE_CHECKING:`, which never run."""
    tree = ast.parse(path.read_text())
    skipped = set()
    if not with_typing:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
                skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _imported_names(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for every `from module import name` (absolute), and (module, None) for every `import module`."""
    pairs: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            pairs += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            pairs += [(node.module, a.name) for a in node.names]
    return pairs


def _sources():
    for folder in ("mint", "longstraw", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, _module_name(path)


# Pairs of modules that still import each other (through a function-level import), each with why it is not yet
# undone. The list may only shrink: a pair that no longer cycles fails the test below until it is taken off.
KNOWN_CYCLES = {
    # The DSA kind's context-parallel pages (IndexedLatentPages) build on this module's classes; cp_kinds names them.
    ("longstraw.context_parallel", "longstraw.context_parallel_dsa"),
}


def test_no_two_modules_import_each_other():
    """Two modules that import each other (one of them inside a function, or the import fails) hide a layer that
    is in the wrong place: a type or helper that both need belongs below both. Imports for type hints alone
    (`if TYPE_CHECKING:`) never run and do not count."""
    modules = {module: path for path, module in _sources()}
    edges = {
        module: {name for name in _imports(path, with_typing=False) if name in modules and name != module}
        | {f"{mod}.{name}" for mod, name in _imported_names(path) if name and f"{mod}.{name}" in modules}
        for module, path in modules.items()
    }
    cycles = {tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges.get(b, ())}
    assert not cycles - KNOWN_CYCLES, f"modules that import each other: {sorted(cycles - KNOWN_CYCLES)}"
    assert not KNOWN_CYCLES - cycles, f"no longer cycles, take off KNOWN_CYCLES: {sorted(KNOWN_CYCLES - cycles)}"


def test_layers_point_downward():
    bad = []
    for path, module in _sources():
        own = _layer(module)
        for name in _imports(path):
            target = _layer(name)
            if target is not None and target < own:
                bad.append(f"{path.relative_to(ROOT)} ({LAYERS[own]}) imports {name} ({LAYERS[target]})")
    assert not bad, "\n".join(bad)


def test_heavy_dependencies_stay_in_their_layer():
    bad = []
    for path, module in _sources():
        for name in _imports(path):
            home = ONLY_IN.get(name.split(".")[0])
            if home is not None and not (module == home or module.startswith(home + ".")):
                bad.append(f"{path.relative_to(ROOT)} imports {name}: only {home} may")
    assert not bad, "\n".join(bad)


def test_kernels_import_torch_and_triton_only():
    bad = []
    for path in (ROOT / "kernels").rglob("*.py"):
        for name in _imports(path):
            top = name.split(".")[0]
            if top not in KERNELS_MAY_IMPORT:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


ENVS_MAY_NOT_IMPORT = {"torch", "ray", "deepspeed", "transformers", "triton"}


def test_environments_need_no_torch_and_no_ray():
    """mint.envs runs wherever episodes do (a rollout actor, a sandbox host, a user's laptop): its environments
    take token ids and a tokenizer object, never a model or a cluster."""
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path, module in _sources()
        if module == "mint.envs" or module.startswith("mint.envs.")
        for name in _imports(path)
        if name.split(".")[0] in ENVS_MAY_NOT_IMPORT
    ]
    assert not bad, bad


def test_hub_is_reached_through_its_public_api():
    bad = []
    for path, module in _sources():
        if module.startswith("mint.hub"):
            continue
        bad += [f"{path.relative_to(ROOT)} imports {n}" for n in _imports(path) if n.startswith("mint.hub.")]
    assert not bad, bad
    import mint.hub

    for name in mint.hub.__all__:
        assert getattr(mint.hub, name) is not None, name


def test_serving_stands_apart_from_the_store():
    """mint.hub never imports the server; mint.serve reaches other packages (the store, the rollout engine) only
    through public names: no `_`-prefixed module or name, so the server cannot grow into anyone's internals."""
    bad = []
    for path, module in _sources():
        if module.startswith("mint.hub"):
            bad += [
                f"{path.relative_to(ROOT)} imports {n}" for n in _imports(path) if n.split(".")[:2] == ["mint", "serve"]
            ]
        if module == "mint.serve" or module.startswith("mint.serve."):
            for source, name in _imported_names(path):
                if source == "__future__" or source == "mint.serve" or source.startswith("mint.serve."):
                    continue
                if any(part.startswith("_") for part in source.split(".")) or (name or "").startswith("_"):
                    bad.append(f"{path.relative_to(ROOT)} imports {source}{'.' + name if name else ''}")
    assert not bad, "\n".join(bad)
    import mint.serve

    assert list(mint.serve.__all__) == ["add_parsers", "run_command", "serve"]
    for name in mint.serve.__all__:
        assert getattr(mint.serve, name) is not None, name


def test_every_package_is_installed():
    """Each pyproject lists its packages explicitly (Mint's and kernels/'s); a new sub-package must be listed."""
    listed = {
        name
        for project in ("pyproject.toml", "kernels/pyproject.toml")
        for name in tomllib.loads((ROOT / project).read_text())["tool"]["setuptools"]["packages"]
    }
    found = {
        _module_name(p.parent / "__init__.py")
        for folder in ("mint", "longstraw", "kernels")
        for p in (ROOT / folder).rglob("__init__.py")
    }
    assert found == listed, (found - listed, listed - found)


# The modules that call Ray actors and tasks: each owner of a kind of actor, and the cluster start-up (docs/layout.md).
RAY_CALLERS = {
    "mint.train.learner_group",  # the learner ranks
    "mint.train.rollout_fleet",  # the rollout actors, and the engine-recovery path
    "mint.train.engine_servers",  # the engine server actors
    "mint.train.cluster",  # the per-node checks before any actor starts
}


def _ray_calls(path: Path) -> list[int]:
    """Lines of `ray.get(...)` and `<anything>.remote(...)` calls in a file."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "remote" or (f.attr == "get" and isinstance(f.value, ast.Name) and f.value.id == "ray"):
                lines.append(node.lineno)
    return lines


def test_ray_calls_stay_with_the_owners_of_the_actors():
    """ray.get and .remote calls live only in the learner group, the rollout fleet, the engine servers and the
    driver: every other module asks one of them."""
    found = {module: lines for path, module in _sources() if (lines := _ray_calls(path))}
    bad = [
        f"{module} (lines {', '.join(map(str, lines))})" for module, lines in found.items() if module not in RAY_CALLERS
    ]
    assert not bad, "Ray calls outside " + ", ".join(sorted(RAY_CALLERS)) + ": " + "; ".join(bad)
    assert set(found) == RAY_CALLERS, set(found)  # the scan sees them where they are


def test_modules_stay_small():
    """STYLE 7: modules under about 500 lines, so each reads in one sitting."""
    big = [f"{p.relative_to(ROOT)}: {n}" for p, _ in _sources() if (n := len(p.read_text().splitlines())) > 500]
    assert not big, big
