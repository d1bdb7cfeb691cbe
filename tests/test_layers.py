"""The floor plan, enforced: imports run one way, entry layer -> router / worker -> core.

Read from the source with ast (nothing is imported or run), lazy imports inside functions
included. docs/architecture.md has the file map these rules guard.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("shardflow", "orchestrator", "router", "worker")
# The engine: how the owner shard decides. The router and the workers use the core (transport,
# store, messages, program format) but never these.
ENGINE = (
    "orchestrator.transitions",
    "orchestrator.machine",
    "orchestrator.owner",
    "orchestrator.ordering",
    "orchestrator.plans",
)  # docs/layers.json's Engine, the whiteboard this guards
# package -> what it may never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "orchestrator": ("shardflow", "router", "worker"),
    "router": ("shardflow", "worker", *ENGINE),
    "worker": ("shardflow", "router", *ENGINE),
    "shardflow": (),
}


def imports(source: str) -> list[tuple[int, str]]:
    """(line, module) for every import in a module's source, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from orchestrator import transitions` names a module too
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def wrong_way(package: str, name: str, source: str) -> list[str]:
    """Every import in `source` (file `name` of `package`) that runs against the plan."""
    faults: dict[int, str] = {}  # one per import statement
    forbidden = FORBIDDEN[package]
    this = name.removesuffix(".py").replace("/", ".")
    # The rest of the core stays below the owner's logic (the package's facade names both).
    if package == "orchestrator" and this not in (*ENGINE, "orchestrator.__init__"):
        forbidden += ENGINE
    for line, module in imports(source):
        banned = [b for b in forbidden if module == b or module.startswith(b + ".")]
        if banned and line not in faults:
            faults[line] = f"{name}:{line}: {package}/ imports {module}"
    return list(faults.values())


def test_every_import_runs_the_right_way() -> None:
    faults = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            faults += wrong_way(package, str(path.relative_to(ROOT)), path.read_text())
    assert not faults, "imports that run the wrong way:\n" + "\n".join(faults)


def test_a_wrong_way_import_is_named_with_its_file_and_line() -> None:
    source = "import json\n\n\ndef lazy():\n    from worker.pool import Worker\n"
    assert wrong_way("orchestrator", "orchestrator/x.py", source) == [
        "orchestrator/x.py:5: orchestrator/ imports worker.pool"
    ]
    engine = "from orchestrator import transitions\n"
    assert wrong_way("router", "router/y.py", engine) == [
        "router/y.py:1: router/ imports orchestrator.transitions"
    ]
    assert wrong_way("router", "router/z.py", "from orchestrator.store import Store\n") == []
    core = "from orchestrator import machine\n"
    assert wrong_way("orchestrator", "orchestrator/metrics.py", core) == [
        "orchestrator/metrics.py:1: orchestrator/ imports orchestrator.machine"
    ]
    assert wrong_way("orchestrator", "orchestrator/owner.py", core) == []


def test_every_package_and_the_entry_point_exist() -> None:
    for package in PACKAGES:
        assert (ROOT / package / "__init__.py").is_file(), package
    assert (ROOT / "shardflow" / "__main__.py").is_file()
    assert 'shardflow = "shardflow.cli:main"' in (ROOT / "pyproject.toml").read_text()
