"""The ground floor stays the ground floor: resispec/verify/ imports torch, numpy and the standard library, and from
resispec only resispec.verify and resispec.sampling; resispec/sampling.py imports nothing from resispec. (Applications that load models,
compose configs or plot live in resispec/analysis/.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "resispec"
GROUND = sorted((PKG / "verify").rglob("*.py")) + [PKG / "sampling.py"]


def _resispec_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of resispec.* in `path`, at any depth (function-level imports too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "resispec"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative imports would hide the target from this check
                out.append((node.lineno, "." * node.level + (node.module or "")))
            elif node.module and node.module.split(".")[0] == "resispec":
                out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("path", GROUND, ids=lambda p: str(p.relative_to(PKG.parent)))
def test_ground_floor_imports_nothing_above_it(path: Path) -> None:
    allowed = (
        () if path.name == "sampling.py" and path.parent == PKG else ("resispec.verify", "resispec.sampling")
    )
    bad = [
        f"{path.relative_to(PKG.parent)}:{line} imports {mod}"
        for line, mod in _resispec_imports(path)
        if not any(mod == a or mod.startswith(a + ".") for a in allowed)
    ]
    assert not bad, "\n".join(bad)


def test_the_check_sees_the_ground_floor() -> None:
    assert len(GROUND) >= 8 and PKG / "verify" / "__init__.py" in GROUND
