"""The set-up contract: the README opens with two commands (the demo, the tests), and `.ci/run` runs exactly the
README's test command, so a newcomer and CI run the same suite with the same selection (`-m "not slow"`)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", (REPO / "README.md").read_text(), flags=re.S)


def test_ci_runs_the_readmes_test_command_and_it_leaves_out_only_the_slow_marker():
    demo, tests = _readme_commands()[:2]
    assert "zerotrain train" in demo and "--nproc 2" in demo
    ci_lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci_lines[-1] == tests
    assert '-m "not slow"' in tests and "--durations=" in tests
    markers = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^markers = \["slow: ', markers, flags=re.M)  # registered: a typo'd marker is an error

