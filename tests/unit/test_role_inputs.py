"""A role's inputs are its argument spec (gpufleet_role_inputs hashes every option
declared for `main`): a default that is not declared would be a setting whose change on a
converged host does nothing, because the role's skip check never sees it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ROLES = sorted(p.parent.parent for p in (REPO / "roles").glob("*/defaults/main.yml"))


def _spec(role: Path) -> dict:
    path = role / "meta" / "argument_specs.yml"
    return yaml.safe_load(path.read_text())["argument_specs"] if path.exists() else {}


def test_only_the_internal_role_has_no_main_entry_point():
    """common is included by the other roles' entry points (each with its own spec) and
    keeps no record of its own; every other role's skip check hashes its main spec."""
    assert [r.name for r in ROLES if "main" not in _spec(r)] == ["common"]


@pytest.mark.parametrize("role", [r for r in ROLES if "main" in _spec(r)],
                         ids=lambda p: p.name)
def test_every_default_is_declared(role):
    defaults = yaml.safe_load((role / "defaults" / "main.yml").read_text()) or {}
    declared = set(_spec(role)["main"].get("options", {}))
    assert sorted(set(defaults) - declared) == [], (
        f"roles/{role.name}/defaults/main.yml sets what meta/argument_specs.yml does not "
        "declare: its change would not reach the role's skip check")


def test_the_check_can_fail(tmp_path):
    role = tmp_path / "roles" / "x"
    (role / "defaults").mkdir(parents=True)
    (role / "meta").mkdir()
    (role / "defaults" / "main.yml").write_text("x_a: 1\nx_b: 2\n")
    (role / "meta" / "argument_specs.yml").write_text(
        "argument_specs:\n  main:\n    options:\n      x_a: {type: int}\n")
    with pytest.raises(AssertionError, match="does not"):
        test_every_default_is_declared(role)
