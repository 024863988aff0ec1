"""The README's quickstart has exactly two commands, and CI runs the second one."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_quickstart_has_two_commands_and_ci_runs_the_test_one():
    main_cmd, test_cmd = _quickstart_commands()
    assert main_cmd == "bash scripts/main.sh"
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"exec {test_cmd}" in ci, f".ci/run must run the README's test command {test_cmd!r}"
    for script in (main_cmd, test_cmd):
        assert (ROOT / script.split()[1]).is_file()
