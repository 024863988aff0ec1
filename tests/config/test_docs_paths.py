"""Every path and command named in README.md, docs/*.md and recipes/*/README.md exists, and every Hydra command in
their code blocks composes.

What is checked, per page:
- markdown links to files in the repository (relative to the page), URLs and anchors aside;
- repository paths in code (inline spans and fenced blocks): tokens under conf/, resispec/, train/, serve/, bench/, recipes/,
  docs/, tests/, scripts/ or .ci/, taken as relative to the repository root;
- `python X.py`, `bash X.sh` and `python -m package.module`: the file or module exists;
- in fenced blocks, `python train|serve|bench/X.py key=value ...` (also under `accelerate launch` or `torchrun`): the
  script's Hydra config composes with those overrides, so a misspelled key or group fails here, not on a GPU.
Placeholders (`<name>`, `$VAR`, globs, `{a,b}`), `outputs/...` and `exports/...` (written by runs) are not paths.
The frozen journal (docs/journal/, and the record page docs/journal.md, which names removed paths on purpose) is
checked for its links only.
"""

import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from resispec.config import register_configs, to_typed

ROOT = Path(__file__).resolve().parents[2]
TOP = ("conf", "resispec", "train", "serve", "bench", "recipes", "docs", "tests", "scripts", ".ci")
PAGES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "recipes").glob("*/README.md")],
    key=lambda p: str(p),
)
# names removed paths on purpose / cites other projects' files: links only
RECORD = {ROOT / "docs" / "journal.md", ROOT / "docs" / "eagle3_notes.md"}
JOURNAL = sorted((ROOT / "docs" / "journal").glob("*.md"))

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
SPAN = re.compile(r"`([^`\n]+)`")
PATHLIKE = re.compile(r"^(?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*$")
PLACEHOLDER = re.compile(r"[<>*{}$]|\.\.\.|…")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    missing = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            missing.append(target)
    return missing


def _code(text: str) -> list[str]:
    """The text of every fenced block and inline code span."""
    blocks = FENCE.findall(text)
    return blocks + SPAN.findall(FENCE.sub("", text))


def _tokens(code: str) -> list[str]:
    out = []
    for raw in re.split(r"[\s=]+", code):
        tok = raw.strip("'\"`,;:()[]")
        tok = re.sub(r"(::\w+|:\d+(-\d+)?)$", "", tok)  # tests/x.py::name, file.py:12
        if tok:
            out.append(tok)
    return out


def _missing_code_paths(page: Path) -> list[str]:
    missing = []
    for code in _code(page.read_text()):
        toks = _tokens(code)
        for i, tok in enumerate(toks):
            if PLACEHOLDER.search(tok):
                continue
            if PATHLIKE.match(tok) and not (ROOT / tok).exists():
                missing.append(tok)
            prev = toks[i - 1] if i else ""
            if prev in ("python", "bash") and tok.endswith((".py", ".sh")) and not (ROOT / tok).is_file():
                missing.append(tok)
            if prev == "-m" and i >= 2 and toks[i - 2] == "python" and tok.startswith("resispec"):
                mod = ROOT / tok.replace(".", "/")
                if not (mod.with_suffix(".py").is_file() or (mod / "__main__.py").is_file()):
                    missing.append(f"python -m {tok}")
    return sorted(set(missing))


def _commands(page: Path) -> list[tuple[str, list[str]]]:
    """(script, hydra overrides) of every `python train|serve|bench/X.py ...` line in the page's fenced blocks."""
    found = []
    for block in FENCE.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            try:
                words = shlex.split(line.replace("`", " "))
            except ValueError:
                continue
            script = next((w for w in words if re.match(r"^(train|serve|bench)/\w+\.py$", w)), None)
            if script is None:
                continue
            args = words[words.index(script) + 1 :]
            overrides, skip = [], False
            for w in args:
                if skip:
                    skip = False
                elif w.startswith("-"):
                    skip = "=" not in w  # --flag value
                elif "=" in w and not PLACEHOLDER.search(w.split("=", 1)[0]) and "$" not in w:
                    overrides.append(w)
            found.append((script, overrides))
    return found


def _config_name(script: str) -> str | None:
    m = re.search(r'config_name="(\w+)"', (ROOT / script).read_text())
    return m.group(1) if m else None


@pytest.mark.parametrize("page", PAGES + JOURNAL, ids=_rel)
def test_links_point_at_files(page):
    assert _links(page) == [], f"{_rel(page)} links to files that do not exist"


@pytest.mark.parametrize("page", [p for p in PAGES if p not in RECORD], ids=_rel)
def test_code_paths_exist(page):
    assert _missing_code_paths(page) == [], f"{_rel(page)} names paths that do not exist"


COMMANDS = list({(s, tuple(ov)): (page, s, ov) for page in PAGES for s, ov in _commands(page)}.values())


@pytest.mark.parametrize(
    "page,script,overrides", COMMANDS, ids=[f"{_rel(p)}:{s}:{' '.join(o)}"[:120] for p, s, o in COMMANDS]
)
def test_hydra_commands_compose(page, script, overrides):
    assert (ROOT / script).is_file(), f"{_rel(page)}: {script} does not exist"
    name = _config_name(script)
    if name is None:  # an argparse script (export.py): its file exists, nothing to compose
        return
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        to_typed(compose(config_name=name, overrides=overrides))


def test_the_checker_catches_what_it_should(tmp_path):
    (tmp_path / "design.md").write_text("")
    page = tmp_path / "probe.md"
    page.write_text(
        "[a](nowhere.md) [b](design.md) [c](https://x.org/y) `resispec/no_such.py` `outputs/x/y` `recipes/<name>/x`\n"
        "```bash\npython train/no_such.py\npython -m resispec.no_such\npython train/distill.py train.max_stepz=3\n```\n"
    )
    assert _links(page) == ["nowhere.md"]
    assert _missing_code_paths(page) == [
        "python -m resispec.no_such",
        "resispec/no_such.py",
        "train/no_such.py",
    ]
    assert ("train/distill.py", ["train.max_stepz=3"]) in _commands(page)
    register_configs()
    with (
        initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"),
        pytest.raises(ConfigCompositionException),
    ):
        compose(config_name="distill", overrides=["train.max_stepz=3"])


def test_the_pages_stay_short():
    """Issue 43's sizes: the README at most ~150 lines, a recipe card at most ~100 (120 allowed), and recipes/ holds
    launch configs, cards and a few scripts, not an experiment record (at most 40 files)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    for card in (ROOT / "recipes").glob("*/README.md"):
        assert len(card.read_text().splitlines()) <= 120, _rel(card)
    files = [p for p in (ROOT / "recipes").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert len(files) <= 40, (
        f"{len(files)} files under recipes/: raw runs belong under outputs/ (docs/journal.md)"
    )
