"""Every phase is tagged: `--tags cache`, `serve` or `health` selects that phase alone
(with the plan and the preflight, which are `always`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PHASES = ["Prepare", "Cache", "Firewall", "Serve", "Verify", "Smoke", "Health"]


def listed(tag: str) -> dict[str, list[str]]:
    """Play name -> the tasks --list-tasks shows for it (argument checks left out)."""
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,",
         "site.yml", "--list-tasks", "--tags", tag], cwd=REPO, capture_output=True,
        text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plays: dict[str, list[str]] = {}
    current = None
    for line in proc.stdout.splitlines():
        play = re.match(r"\s+play #\d+ \([^)]*\): (\w+) \|", line)
        if play:
            current = play.group(1)
            plays.setdefault(current, [])
        elif current and line.startswith("      ") and "Validating arguments" not in line:
            plays[current].append(line.strip())
    return plays


@pytest.mark.parametrize("tag", ["cache", "serve", "verify", "health"])
def test_a_phase_tag_selects_that_phase_alone(tag):
    plays = listed(tag)
    selected = [p for p in PHASES if plays.get(p)]
    assert selected == [tag.capitalize()], plays
    assert plays["Plan"] and plays["Preflight"]  # always


def test_the_prepare_roles_have_their_own_tags():
    plays = listed("ucx")
    assert [p for p in PHASES if plays.get(p)] == ["Prepare"]
    assert [t for t in plays["Prepare"] if t.startswith("Prepare |")] == \
        ["Prepare | UCX\tTAGS: [prepare, rdma, ucx]"]
