"""``scripts/``: a short toolkit, each tool listed in its README and runnable with ``--help`` from the
repository root of a fresh checkout (``python3 -m scripts.<name>`` or ``bash scripts/<name>.sh``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = sorted(p for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py")


def test_scripts_is_a_short_toolkit_and_its_readme_lists_every_tool():
    assert 0 < len(TOOLS) <= 10, [p.name for p in TOOLS]
    readme = (ROOT / "scripts" / "README.md").read_text()
    for tool in TOOLS:
        command = f"bash scripts/{tool.name}" if tool.suffix == ".sh" else f"python3 -m scripts.{tool.stem}"
        assert command in readme, f"scripts/README.md does not list {command}"


@pytest.mark.parametrize("tool", TOOLS, ids=lambda p: p.name)
def test_every_tool_prints_its_usage(tool):
    command = ["bash", str(tool)] if tool.suffix == ".sh" else [sys.executable, "-m", f"scripts.{tool.stem}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the checkout itself
    done = subprocess.run([*command, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower() or "Knobs" in done.stdout, done.stdout[:500]
