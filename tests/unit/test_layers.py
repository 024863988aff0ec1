"""Layers a reader can see (issue 43): the packages of resispec/ stand on floors, and each imports only the packages
its row of `LAYERS` names, all on lower floors. Checked by AST over every file of resispec/ (nothing is imported):

(a) no import outside the table's edges (each to a lower floor, but the one stated in `SIDEWAYS`) (upward, sideways, or of the composition root `resispec/config.py`);
(b) no circle between modules (top-level imports; the circle is printed);
(c) no function-level `import resispec.*` inside resispec/ (only optional third-party imports stay lazy);
(d) no `_private` name imported from another module (`from x import _a`, `from x import _a as b`), nor read off an
    imported module (`from resispec.training import loop` then `loop._step`);
(e) no module over 800 lines and no function over 80 lines, but for the commented `SIZE_EXCEPTIONS`.

Each check has a planted-violation test on a fake package tree (tmp_path), so it can fail. The ground-floor test
(verify/ and sampling.py import nothing above them) stays as it was.

Floors (ground up), and where the table differs from the first design (docs/design.md; STYLE_REVIEW section 5):
  F1 sampling, errors, vllm_venv (vllm_venv: nothing of resispec; it runs inside vLLM's venv)
  F2 verify (F1), models (errors)
  F3 data (models, vllm_venv, F1), decoding (verify, models, sampling, errors): decoding uses models.head (the
     draft head's module: is_head, the RMSNorm/RoPE helpers shared with the fast forward) and models.loading (the
     tokenizer check), which are the models' own code, so the edge is decoding -> models, not the reverse
  F4 losses (verify, sampling, decoding.config only), serving (decoding, data, models, verify, F1)
  F5 training (F1-F4 but serving), benchmark (F1-F4; imported by nothing in the library), analysis (training and
     F1-F4 but serving)
  F6 config (the composition root: the *Config dataclasses of every package; entry scripts and tests import it,
     nothing in resispec/ does)
Top-level modules are packages of their own (`losses`, `sampling`, `errors`, `config`); `resispec/__init__.py` is
the version only and imports nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "resispec"
GROUND = sorted((PKG / "verify").rglob("*.py")) + [PKG / "sampling.py"]

F1_ = {"sampling", "errors", "vllm_venv"}
BELOW_F5 = F1_ | {"verify", "models", "data", "decoding", "losses"}
# package -> (floor, the packages (or package.module) it may import). Every edge goes to a lower floor.
LAYERS: dict[str, tuple[int, frozenset[str]]] = {
    "sampling": (1, frozenset()),
    "errors": (1, frozenset()),
    "vllm_venv": (1, frozenset()),
    "verify": (2, frozenset({"sampling", "errors"})),
    "models": (2, frozenset({"errors"})),
    "data": (3, frozenset({"models"} | F1_)),
    "decoding": (3, frozenset({"verify", "models", "sampling", "errors"})),
    "losses": (4, frozenset({"verify", "sampling", "errors", "decoding.config"})),
    "serving": (4, frozenset({"decoding", "data", "models", "verify"} | F1_)),
    "training": (5, frozenset(BELOW_F5)),
    "benchmark": (5, frozenset(BELOW_F5 | {"serving"})),
    "analysis": (5, frozenset(BELOW_F5 | {"training"})),
    "config": (6, frozenset(BELOW_F5 | {"serving", "training", "benchmark", "analysis"})),
}

# the one stated edge within a floor: analysis (compare: distil two drafts and compare them; loss_memory: measure
# the training loop's memory) is an application of training; training imports nothing of analysis.
SIDEWAYS = {("analysis", "training")}

MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80
# "path relative to resispec/" or "path::function" -> why it stays over the limit. Keep this short.
SIZE_EXCEPTIONS: dict[str, str] = {}


# --------------------------------------------------------------------------------------------------------------
# the reader: modules, their imports, their sizes


def module_name(root: Path, path: Path) -> str:
    """resispec/decoding/engine.py -> resispec.decoding.engine; resispec/decoding/__init__.py -> resispec.decoding."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_of(module: str) -> str:
    """resispec.decoding.engine -> decoding; resispec.losses -> losses; resispec -> '' (the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


class Imp:
    """One import of a resispec module: where, what (absolute module), the names taken, at top level or not."""

    def __init__(self, path: Path, line: int, module: str, names: list[tuple[str, str | None]], top: bool):
        self.path, self.line, self.module, self.names, self.top = path, line, module, names, top

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root.parent)}:{self.line}"


def _absolute(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(root: Path, path: Path) -> list[Imp]:
    """Every import of `root`'s package in `path`, at any depth. Top level = the module body, or an `if`/`try` at
    the module body (e.g. `if TYPE_CHECKING:`); anything inside a def or class is not."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me, is_pkg, top_pkg = module_name(root, path), path.name == "__init__.py", root.name
    out: list[Imp] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.split(".")[0] == top_pkg:
                        out.append(Imp(path, child.lineno, a.name, [], top))
            elif isinstance(child, ast.ImportFrom):
                mod = _absolute(child, me, is_pkg)
                if mod.split(".")[0] == top_pkg:
                    out.append(Imp(path, child.lineno, mod, [(a.name, a.asname) for a in child.names], top))
            inner = top and isinstance(child, (ast.If, ast.Try, ast.ExceptHandler))
            visit(child, inner)

    visit(tree, True)
    return out


def known_modules(root: Path) -> dict[str, Path]:
    return {module_name(root, p): p for p in sorted(root.rglob("*.py"))}


def targets(imp: Imp, modules: dict[str, Path]) -> list[str]:
    """The modules an import loads by name: `from pkg import sub` -> pkg.sub when sub is a module, else pkg."""
    if not imp.names:
        return [imp.module]
    out = []
    for name, _ in imp.names:
        sub = f"{imp.module}.{name}"
        out.append(sub if sub in modules else imp.module)
    return sorted(set(out))


def layer_violations(root: Path, layers=LAYERS) -> list[str]:
    modules, bad = known_modules(root), []
    for mod, path in modules.items():
        src = package_of(mod)
        if src == "":  # resispec/__init__.py: the version string, nothing else
            bad += [
                f"{i.where(root)} resispec/__init__.py imports {i.module}" for i in imports_of(root, path)
            ]
            continue
        if src not in layers:
            bad.append(f"{path.relative_to(root.parent)}: package {src!r} is not in the layer table")
            continue
        allowed = layers[src][1]
        for imp in imports_of(root, path):
            for tgt in targets(imp, modules):
                dst = package_of(tgt)
                if dst == src:
                    continue
                short = tgt.split(".", 1)[1] if "." in tgt else tgt
                if dst in allowed or any(short == a or short.startswith(a + ".") for a in allowed):
                    continue
                bad.append(f"{imp.where(root)} {src} (F{layers[src][0]}) imports {tgt} ({dst or 'resispec'})")
    return bad


def find_cycle(root: Path) -> list[str] | None:
    """A circle of top-level imports between modules (the first found, as a path a -> b -> ... -> a), or None."""
    modules = known_modules(root)
    graph = {
        mod: sorted(
            {
                t
                for i in imports_of(root, p)
                if i.top
                for t in targets(i, modules)
                if t != mod and t in modules
            }
        )
        for mod, p in modules.items()
    }
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in graph[m]:
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (c := dfs(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := dfs(m)):
            return c
    return None


def lazy_imports(root: Path) -> list[str]:
    return [
        f"{i.where(root)} imports {i.module} inside a function or class"
        for p in known_modules(root).values()
        for i in imports_of(root, p)
        if not i.top
    ]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(root: Path) -> list[str]:
    modules, bad = known_modules(root), []
    for path in modules.values():
        imps = imports_of(root, path)
        bad += [
            f"{i.where(root)} imports private {name} from {i.module}" + (f" as {alias}" if alias else "")
            for i in imps
            for name, alias in i.names
            if _private(name)
        ]
        # names bound to a module of the package: `from pkg import mod [as m]`, `import pkg.mod as m`
        bound = {alias or name: f"{i.module}.{name}" for i in imps for name, alias in i.names}
        bound = {k: v for k, v in bound.items() if v in modules}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                bound.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
            ):
                if _private(node.attr):
                    bad.append(
                        f"{path.relative_to(root.parent)}:{node.lineno} reads private {node.attr} of "
                        f"{bound[node.value.id]}"
                    )
    return sorted(bad)


def size_violations(root: Path, exceptions=SIZE_EXCEPTIONS) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        text = path.read_text()
        n = len(text.splitlines())
        if n > MAX_MODULE_LINES and rel not in exceptions:
            bad.append(f"{rel}: {n} lines (max {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and f"{rel}::{node.name}" not in exceptions:
                    bad.append(f"{rel}:{node.lineno} {node.name}: {length} lines (max {MAX_FUNCTION_LINES})")
    return bad


# --------------------------------------------------------------------------------------------------------------
# the library


def test_the_table_goes_down() -> None:
    """Every edge of the table goes to a strictly lower floor: the table itself has no circle and no sideways edge."""
    for pkg, (floor, allowed) in LAYERS.items():
        for a in allowed:
            dst = a.split(".")[0]
            assert LAYERS[dst][0] < floor or (pkg, dst) in SIDEWAYS, (
                f"{pkg} (F{floor}) may import {a}: not a lower floor"
            )


def test_every_package_is_on_a_floor() -> None:
    pkgs = {package_of(m) for m in known_modules(PKG)} - {""}
    assert pkgs <= set(LAYERS), f"packages without a floor: {sorted(pkgs - set(LAYERS))}"


def test_no_import_outside_the_layer_table() -> None:
    bad = layer_violations(PKG)
    assert not bad, "\n".join(bad)


def test_no_import_circle() -> None:
    cycle = find_cycle(PKG)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_function_level_resispec_import() -> None:
    bad = lazy_imports(PKG)
    assert not bad, "\n".join(bad)


def test_no_private_name_imported_across_modules() -> None:
    bad = private_imports(PKG)
    assert not bad, "\n".join(bad)


def test_module_and_function_sizes() -> None:
    bad = size_violations(PKG)
    assert not bad, "\n".join(bad)
    stale = [k for k in SIZE_EXCEPTIONS if not (PKG / k.split("::")[0]).exists()]
    assert not stale, f"exceptions for files that no longer exist: {stale}"


@pytest.mark.parametrize("path", GROUND, ids=lambda p: str(p.relative_to(PKG.parent)))
def test_ground_floor_imports_nothing_above_it(path: Path) -> None:
    allowed = (
        () if path.name == "sampling.py" and path.parent == PKG else ("resispec.verify", "resispec.sampling")
    )
    bad = [
        f"{i.where(PKG)} imports {i.module}"
        for i in imports_of(PKG, path)
        if not any(i.module == a or i.module.startswith(a + ".") for a in allowed)
    ]
    assert not bad, "\n".join(bad)


def test_the_check_sees_the_ground_floor() -> None:
    assert len(GROUND) >= 8 and PKG / "verify" / "__init__.py" in GROUND
    assert len(known_modules(PKG)) > 80


# --------------------------------------------------------------------------------------------------------------
# planted violations: each check fails on a fake tree that breaks its rule


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "resispec"
    for rel, text in {"__init__.py": "", **files}.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        if p.parent != root and not (p.parent / "__init__.py").exists():
            (p.parent / "__init__.py").write_text("")
    return root


def test_planted_upward_and_sideways_imports_fail(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "sampling.py": "",
            "models/world.py": "import resispec.sampling\nfrom resispec.decoding import engine\n",
            "decoding/engine.py": "from resispec.data.prompts import load\nfrom ..config import C\n",
            "data/prompts.py": "from resispec.models import world\n",
            "losses.py": "from resispec.decoding.config import D\nfrom resispec.decoding.engine import E\n",
            "config.py": "from resispec.training.config import T\n",
        },
    )
    bad = "\n".join(layer_violations(root))
    assert "models (F2) imports resispec.sampling" in bad  # models may import errors only
    assert "models (F2) imports resispec.decoding.engine" in bad  # upward
    assert "decoding (F3) imports resispec.data.prompts" in bad  # sideways
    assert "decoding (F3) imports resispec.config" in bad  # the composition root, by a relative import
    assert "losses (F4) imports resispec.decoding.engine" in bad and "decoding.config (" not in bad
    assert "data/prompts" not in bad and "config.py" not in bad
    assert (
        len(
            layer_violations(
                _tree(tmp_path / "ok", {"data/prompts.py": "from resispec.models import world\n"})
            )
        )
        == 0
    )


def test_planted_circle_fails(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "decoding/a.py": "from resispec.decoding.b import x\n",
            "decoding/b.py": "from resispec.decoding import c\n",
            "decoding/c.py": "import resispec.decoding.a\n",
            "decoding/d.py": "def f():\n    from resispec.decoding import a\n",  # lazy: not an edge (check c)
        },
    )
    cycle = find_cycle(root)
    assert cycle is not None and cycle[0] == cycle[-1] and len(cycle) == 4
    assert set(cycle) == {"resispec.decoding.a", "resispec.decoding.b", "resispec.decoding.c"}
    (root / "decoding/c.py").write_text("if True:\n    x = 1\n")
    assert find_cycle(root) is None


def test_planted_function_level_import_fails(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "training/loop.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from resispec.data import pack\n"
                "def f():\n    import wandb\n    from resispec.models import load_pair\n"
                "class C:\n    def g(self):\n        from . import memory_plan\n"
            ),
            "training/memory_plan.py": "",
        },
    )
    bad = lazy_imports(root)
    assert len(bad) == 2, bad
    assert "loop.py:6 imports resispec.models" in bad[0] and "loop.py:9 imports resispec.training" in bad[1]


def test_planted_private_import_fails(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "models/world.py": "_lock = 1\nlock = _lock\n",
            "models/standin.py": "from resispec.models.world import _lock as lk, lock\nfrom .world import __doc__\n",
            "models/loading.py": (
                "from resispec.models import world\nimport resispec.models.world as w\nfrom resispec import models\n"
                "world.lock(world._lock)\nw._lock\nmodels._x\nworld.__doc__\n"
            ),
        },
    )
    bad = private_imports(root)
    assert bad == [
        "resispec/models/loading.py:4 reads private _lock of resispec.models.world",
        "resispec/models/loading.py:5 reads private _lock of resispec.models.world",
        "resispec/models/loading.py:6 reads private _x of resispec.models",
        "resispec/models/standin.py:1 imports private _lock from resispec.models.world as lk",
    ], bad


def test_planted_sizes_fail(tmp_path: Path) -> None:
    long_fn = "def long():\n" + "    x = 1\n" * 80
    root = _tree(
        tmp_path, {"models/big.py": "x = 1\n" * 801, "models/fn.py": long_fn + "def short():\n    pass\n"}
    )
    bad = size_violations(root, exceptions={})
    assert any("models/big.py: 801 lines" in b for b in bad)
    assert any("models/fn.py:1 long: 81 lines" in b for b in bad) and not any("short" in b for b in bad)
    assert (
        size_violations(root, exceptions={"models/big.py": "planted", "models/fn.py::long": "planted"}) == []
    )
