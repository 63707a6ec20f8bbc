"""The package's shape: no import circle between its files, and no module outside the
registries branching on a registered name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

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
                found.update(
                    filter(None, (_resolve(f"{node.module}.{a.name}") for a in node.names))
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


# Function-level imports allowed to close a circle, each a registration that cannot move
# without harm: the built-in rollout strategies are registered beside their registry, so
# ``creditrl.rollout`` lists them on import (``rollout.strategy``'s choices; what
# ``ROLLOUT_STRATEGIES`` holds), while the agent and environment layers they build import
# ``creditrl.rollout.continuation`` (so ``creditrl/rollout/__init__.py``). Each builder imports
# its layer when a rollout is built, after every module has loaded.
LAZY_REGISTRATIONS = {
    "creditrl.rollout.strategies": {
        "creditrl.agents.rollout",
        "creditrl.agents.program",
        "creditrl.environments.verifiers",
        "creditrl.environments.openenv",
    },
}


def _lazy_imports(tree: ast.AST) -> set[str]:
    """The creditrl modules ``tree`` imports inside its functions only."""
    inside = {
        name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for statement in node.body
        for name in _imports(statement)
    }
    top = _imports(
        ast.Module(
            body=[
                n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            ],
            type_ignores=[],
        )
    )
    return inside - top


def _allowed_graph() -> dict[str, set[str]]:
    """The import graph without the allowed registrations' lazy edges (and the packages those
    edges run)."""
    graph = _graph(MODULES)
    for importer, targets in LAZY_REGISTRATIONS.items():
        graph[importer] -= {run for target in targets for run in _runs(importer, target)}
        graph[importer] |= {
            run
            for target in _imports(ast.parse(MODULES[importer].read_text())) - targets
            for run in _runs(importer, target)
        }
    return graph


def test_no_import_circle_between_files() -> None:
    assert _cycles(_allowed_graph()) == []


def test_the_allowed_registrations_are_lazy_and_still_circles() -> None:
    """Each allowed edge is a function-level import that is still there, and without the
    allowance the circle it closes is reported (an allowance no longer needed is removed)."""
    for importer, targets in LAZY_REGISTRATIONS.items():
        assert targets <= _lazy_imports(ast.parse(MODULES[importer].read_text())), importer
    circles = _cycles(_graph(MODULES))
    assert any("creditrl.rollout.strategies" in circle for circle in circles)


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
