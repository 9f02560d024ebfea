"""The house style, enforced by the test command: ruff's lint (pycodestyle, pyflakes, import
order, bugbear, pyupgrade) and its formatter, as pyproject.toml configures them, over every
Python file the repository tracks. `ruff check --fix . && ruff format .` mends most of it."""

import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.processes  # every test here starts processes


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing_to_change(command):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--no-cache", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
