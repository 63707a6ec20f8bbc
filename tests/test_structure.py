"""The package's shape: no import circle between its files, and no module outside the
registries branching on a registered name."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any

import creditrl

ROOT = Path(creditrl.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in ROOT.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The creditrl module an import of ``name`` loads (a name inside a module: the module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _homes(package: str) -> dict[str, str]:
    """A package ``__init__``'s ``_HOMES`` ({name: module}, imported on first use), or {}."""
    path = MODULES.get(package)
    if path is None or path.name != "__init__.py":
        return {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_HOMES" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    return {}


HOMES = {name: _homes(name) for name in MODULES}


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name | ast.Attribute) and "TYPE_CHECKING" in ast.unparse(
        node.test
    )


def _imports(tree: ast.AST) -> set[str]:
    """Every creditrl module ``tree`` imports, at module level or inside a function (both run
    sooner or later), except under ``if TYPE_CHECKING:``."""
    found: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "creditrl":
                homes = HOMES.get(node.module, {})
                found.update(
                    filter(
                        None,
                        (
                            _resolve(homes.get(a.name, f"{node.module}.{a.name}"))
                            for a in node.names
                        ),
                    )
                )
        elif isinstance(node, ast.Import):
            found.update(
                filter(
                    None, (_resolve(a.name) for a in node.names if a.name.startswith("creditrl"))
                )
            )
        stack.extend(ast.iter_child_nodes(node))
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _runs(importer: str, target: str) -> set[str]:
    """The modules ``importer`` importing ``target`` runs: ``target`` and the package
    ``__init__`` files above it (``a.b.c`` runs ``a`` and ``a.b`` first), except the packages
    ``importer`` lies in, which ran before it did."""
    parts = target.split(".")
    above = {".".join(parts[:i]) for i in range(1, len(parts))}
    mine = importer.split(".")
    own = {".".join(mine[:i]) for i in range(1, len(mine))} | {importer}
    return ({target} | (above & MODULES.keys())) - own


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the creditrl modules importing it runs}: what it imports (at module level or in
    a function), each with the package ``__init__`` files above it."""
    return {
        name: {
            run for target in _imports(ast.parse(path.read_text())) for run in _runs(name, target)
        }
        for name, path in modules.items()
    }


def test_no_import_circle_between_files() -> None:
    assert _cycles(_graph(MODULES)) == []


def test_a_lazy_package_name_is_an_edge_to_its_home() -> None:
    """``from creditrl.core import masked_mean`` imports ``creditrl.core.masked`` (the name's
    home in the package's ``_HOMES``), and each home holds the name."""
    tree = ast.parse("from creditrl.core import masked_mean")
    assert _imports(tree) == {"creditrl.core.masked"}
    for package, homes in HOMES.items():
        for name, module in homes.items():
            assert module in MODULES, (package, name)
            assert hasattr(importlib.import_module(module), name), (package, name)


CONFIG_LAYERS_ABOVE = ("core", "rollout", "agents", "asynchronous", "workers")


def test_config_imports_no_registry() -> None:
    """``creditrl.config`` is the vocabulary (schema, loader, fields, options, limits, doc): it
    imports nothing from the layers that own the registries, not even in a function; their
    checks live with them (``creditrl.config.checks``)."""
    offenders = sorted(
        f"{name} -> {target}"
        for name, path in MODULES.items()
        if name == "creditrl.config" or name.startswith("creditrl.config.")
        for target in _imports(ast.parse(path.read_text()))
        if target.split(".")[1] in CONFIG_LAYERS_ABOVE
    )
    assert offenders == []


def test_importing_a_submodule_runs_its_packages() -> None:
    """``from creditrl.config.fields import Range`` runs ``creditrl/config/__init__.py``: an
    edge to it, so a circle through a package's ``__init__`` is seen."""
    assert _runs("creditrl.core.kl", "creditrl.config.fields") == {
        "creditrl.config",
        "creditrl.config.fields",
    }  # creditrl/__init__.py ran before creditrl.core.kl did
    assert _runs("creditrl.config.validate", "creditrl.config.fields") == {"creditrl.config.fields"}
    assert _runs("creditrl.cli", "creditrl.rollout.engine") == {
        "creditrl.rollout",
        "creditrl.rollout.engine",
    }


def test_the_circle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# settings whose value is a registered name, and a comparison of one with a literal
REGISTERED = ("policy_loss", "adv_estimator", "engine", "loss_agg_mode", "kl_loss_type",
              "kl_penalty", r"kl_ctrl\.type")  # fmt: skip
NAME_BRANCH = re.compile(
    rf"""\.({"|".join(REGISTERED)})\s*(==|!=|(not\s+)?in\s*[(\[{{])\s*["'(\[{{]"""
    rf"""|["']\s*(==|!=)\s*[\w.]*\.({"|".join(REGISTERED)})\b"""
)


def test_no_module_branches_on_a_registered_name() -> None:
    """Outside creditrl/core/ and creditrl/rollout/ (where the registries live), no module
    compares a setting holding a registered name (estimator, loss, aggregation, KL estimator or
    controller, engine) with a literal: code reads what the entry declared."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).parts[0] in ("core", "rollout"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if NAME_BRANCH.search(line):
                offenders.append(f"{path.relative_to(ROOT.parent)}:{number}: {line.strip()}")
    assert offenders == []


def test_the_name_branch_pattern_catches_the_forms() -> None:
    lines = ('if cfg.actor.policy_loss == "ppo":', "x = cfg.rollout.engine != 'hf'",
             'if c.actor.loss_agg_mode in ("token-mean", "x"):',
             'if "gae" == cfg.algorithm.adv_estimator:')  # fmt: skip
    for line in lines:
        assert NAME_BRANCH.search(line), line
    assert not NAME_BRANCH.search("if name in POLICY_LOSSES:")


def _engine_capabilities() -> set[str]:
    """Every name ``RolloutEngine`` declares (attributes, methods) and every registered trait."""
    from dataclasses import fields

    from creditrl.rollout.engine import EngineTraits, RolloutEngine

    declared = {name for name in vars(RolloutEngine) if not name.startswith("__")}
    declared |= set(RolloutEngine.__annotations__)
    return declared | {f.name for f in fields(EngineTraits)}


def _capability_probes(tree: ast.AST, capabilities: set[str]) -> list[str]:
    """``getattr``/``hasattr`` calls in ``tree`` naming a capability by a literal."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in ("getattr", "hasattr") or len(node.args) < 2:
            continue
        name = node.args[1]
        if isinstance(name, ast.Constant) and name.value in capabilities:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_probes_an_engine_capability() -> None:
    """What an engine can do (keeps turn KV, EOS ids, a capped view, stats, its model and
    generator, sleep/wake, how weights reach it, ...) is declared on RolloutEngine with
    conservative defaults and read from there: no module asks with getattr/hasattr."""
    capabilities = _engine_capabilities()
    assert {"keeps_turn_kv", "eos_token_ids", "capped", "last_stats", "weights_via"} <= capabilities
    offenders = [
        f"{path.relative_to(ROOT.parent)}:{probe}"
        for path in sorted(ROOT.rglob("*.py"))
        for probe in _capability_probes(ast.parse(path.read_text()), capabilities)
    ]
    assert offenders == []


def test_the_probe_finder_finds_probes() -> None:
    tree = ast.parse('x = getattr(engine, "capped", None)\nif hasattr(e, "last_stats"): pass')
    assert len(_capability_probes(tree, {"capped", "last_stats"})) == 2
    assert _capability_probes(ast.parse('getattr(cfg, "seed")'), {"capped"}) == []


def test_the_async_learner_keeps_only_what_is_async() -> None:
    """The learner is creditrl train's loop (trainers/loop.py) with samplers as its batch
    source: its file stays at most half the 602 lines it had as a second loop."""
    learner = ROOT / "asynchronous" / "learner.py"
    assert len(learner.read_text().splitlines()) <= 301
    source = learner.read_text()
    assert "class Learner(GroupReceiver, TrainingLoop)" in source
    assert "def fit(" not in source  # the loop is TrainingLoop.fit, shared with RLTrainer


def _registry_homes() -> dict[str, str]:
    """{registry kind: the module that makes it (``Registry("kind")`` in its source)}."""
    from creditrl.registry import REGISTRIES

    return {
        kind: next(
            name for name, path in MODULES.items() if f'Registry("{kind}")' in path.read_text()
        )
        for kind in REGISTRIES
    }


HOOK_PATH = re.compile(r"^creditrl(\.\w+)+:\w+$")


def _declared_paths(registry: Any) -> list[str]:
    """Every dotted path ``registry`` holds: its entries', and those its entries declare (a
    strategy's ``datasets`` and ``preflight`` hooks)."""
    found = list(registry.paths().values())
    for name in registry:
        for value in registry.info(name).values():
            fields = dataclasses.asdict(value).values() if dataclasses.is_dataclass(value) else ()
            found += [v for v in fields if isinstance(v, str) and HOOK_PATH.match(v)]
    return found


def _path_edges() -> dict[str, set[str]]:
    """{module making a registry: the modules its dotted paths name}: edges in strings,
    imported when an entry (or a hook it declares) is asked for."""
    from creditrl.registry import REGISTRIES

    edges: dict[str, set[str]] = {}
    for kind, home in _registry_homes().items():
        for path in _declared_paths(REGISTRIES[kind]):
            edges.setdefault(home, set()).add(path.partition(":")[0])
    return edges


def test_every_registry_path_names_its_entry() -> None:
    """Each built-in entry's dotted path imports, and names a callable (a function or class)."""
    from creditrl.registry import REGISTRIES, import_path

    paths = [(kind, path) for kind, r in REGISTRIES.items() for path in _declared_paths(r)]
    assert len(paths) >= 30
    assert ("rollout strategy", "creditrl.environments.openenv:check_environment") in paths
    for kind, path in paths:
        assert callable(import_path(path)), (kind, path)


def test_a_registry_path_is_an_edge_that_stays_in_its_package() -> None:
    """With every registry's paths read as import edges (its module imports each entry when
    asked), the only circles are a registry and its own entries importing it back (the
    interface they share, a dispatcher): none leaves the registry's package."""
    graph = _graph(MODULES)
    edges = _path_edges()
    assert "creditrl.agents.program" in edges["creditrl.rollout.strategies"]
    for home, targets in edges.items():
        graph[home] |= {run for target in targets for run in _runs(home, target)}
    for circle in _cycles(graph):
        assert len({module.split(".")[1] for module in circle}) == 1, circle


def test_the_circle_judge_sees_a_path_edge() -> None:
    """A path from ``a.x`` to ``b.y`` with ``b.y`` importing ``a.x`` is a circle across
    packages, which the judge above refuses."""
    graph = {"creditrl.a.x": set(), "creditrl.b.y": {"creditrl.a.x"}}
    graph["creditrl.a.x"] |= {"creditrl.b.y"}
    (circle,) = _cycles(graph)
    assert len({module.split(".")[1] for module in circle}) == 2
