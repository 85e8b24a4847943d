"""The README is a user's guide whose every command runs (tools/readme_check.py runs them in CI), the
design it cites is in the repository, and no file numbers past runs."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_check():
    spec = importlib.util.spec_from_file_location("readme_check", ROOT / "tools" / "readme_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_is_short():
    assert (ROOT / "README.md").stat().st_size <= 12 * 1024


def test_readme_opens_with_the_two_commands():
    cmds = _readme_check().readme_commands((ROOT / "README.md").read_text())
    assert cmds[:4] == ['pip install torch==2.13.0', 'pip install -e ".[dev,rl,tune]"',
                        "python tuning/optuna_search.py", "python -m pytest -q"]


def test_every_readme_command_is_run_by_the_check():
    rc = _readme_check()
    cmds = rc.readme_commands((ROOT / "README.md").read_text())
    assert len(cmds) >= 10
    assert [c for c in cmds if rc.rule(c)[0] is None] == []
    # a placeholder (FILE, OUT.npz, ...) is not a command a user can run as written
    assert [c for c in cmds if re.search(r"(^|\s)[A-Z][A-Z_]{2,}(\.\w+)?(\s|$)", c)] == []


def test_readme_parser():
    rc = _readme_check()
    text = "x\n```bash\na && b   # note\n# only a comment\nc \\\n  --flag 1\n```\n```python\nimport x\n```\n"
    assert rc.readme_commands(text) == ["a", "b", "c    --flag 1"]
    assert rc.python_blocks(text) == ["import x\n"]
    assert rc.rule("tokenbatch tune --seed 1")[0] == "tiny"
    assert rc.rule("tokenbatch tuned")[0] is None


def test_design_citations_resolve():
    """Every ``docs/design.md section N`` cited in the code is a section of docs/design.md."""
    design = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\d+)\.", design, re.M))
    cited = set()
    for p in [*ROOT.glob("tokenbatch_env/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("tools/*.py"),
              *ROOT.glob("agents/*.py"), *ROOT.glob("tuning/*.py"), *ROOT.glob("benchmarks/*.py")]:
        text = p.read_text()
        assert p.name == "test_readme.py" or "DESIGN.md" not in text, \
            f"{p.relative_to(ROOT)} cites DESIGN.md, which is not in the repository"
        for m in re.finditer(r"docs/design\.md\s+sections?\s+(\d+)(?:\s+and\s+(\d+))?", text):
            cited.update(x for x in m.groups() if x)
    assert cited and cited <= sections, sorted(cited - sections)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_no_numbered_history_of_runs():
    r = subprocess.run(["git", "grep", "-niE", r"sessions? [0-9]+"], cwd=ROOT, capture_output=True, text=True)
    assert r.stdout == "", r.stdout[:2000]
