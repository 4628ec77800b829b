"""inventories/sample lists every variable an operator sets, and nothing else.

What counts as an operator's variable is derived from the code, not from a list kept by
hand:
- every inventory variable the planner reads (the gpufleet_plan lookup and the code behind
  it: the test the lookup's documentation has);
- every gpufleet_* variable a role or playbook reads with a default (`gpufleet_x |
  default(...)`), apart from the few results the plays register themselves (INTERNAL);
- the prepare roles' install switches (`*_install`, `*_reboot_allowed` in a role's
  defaults), which a refusal's fix tells the operator to set.
The sample may also list a role's own variables (roles/<role>/defaults/main.yml), and every
name it lists must be one of these, so a renamed variable does not linger there."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from test_plugin_docs import planner_variables

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "inventories" / "sample" / "group_vars" / "all.yml"
HOSTS = REPO / "inventories" / "sample" / "hosts.yml"
PLAYS = [REPO / "site.yml", *(REPO / "playbooks").rglob("*.yml"), *(REPO / "roles").rglob("*.yml"),
         *(REPO / "roles").rglob("*.j2")]
# gpufleet_* names read with a default that are results of the plays themselves
INTERNAL = {
    "gpufleet_acceptance": "the acceptance play's registered result",
    "gpufleet_health": "the health report play's registered result",
    "gpufleet_rdma_hcas": "set by the rdma role's verify for the ucx role",
}
SWITCH = re.compile(r"\w+_(install|reboot_allowed)")


def documented() -> set[str]:
    """The names the sample shows, set or commented out (`# name: value`): in group_vars,
    and the host variables commented out in hosts.yml."""
    names = set()
    for path, form in ((SAMPLE, r"#? ?"), (HOSTS, r"# ?")):
        for line in path.read_text().splitlines():
            found = re.match(form + r"([a-z][a-z0-9_]*):(\s|$)", line.strip())
            if found:
                names.add(found.group(1))
    return names


def read_with_default() -> set[str]:
    found = set()
    for path in PLAYS:
        found |= set(re.findall(r"\b(gpufleet_\w+)\s*\|\s*default\(", path.read_text()))
    return found - set(INTERNAL)


def role_defaults() -> dict[str, set[str]]:
    out = {}
    for path in (REPO / "roles").glob("*/defaults/main.yml"):
        out[path.parts[-3]] = set(yaml.safe_load(path.read_text()) or {})
    return out


def install_switches() -> set[str]:
    return {name for names in role_defaults().values() for name in names
            if SWITCH.fullmatch(name)}


def operator_variables() -> set[str]:
    return planner_variables() | read_with_default() | install_switches()


def test_the_derivation_finds_what_it_should():
    found = operator_variables()
    assert {"gpufleet_target", "gpufleet_workers", "gpufleet_runtime"} <= found  # planner
    assert {"gpufleet_pip_index_url", "gpufleet_node_exporter"} <= found          # roles
    assert {"nvidia_driver_install", "rdma_install", "imex_install"} <= found     # switches
    assert not set(INTERNAL) & found


def test_the_sample_lists_every_variable_an_operator_sets():
    missing = sorted(operator_variables() - documented())
    assert not missing, (f"{SAMPLE.relative_to(REPO)} does not list {missing}: add each, "
                         "commented out, with its default and what it does")


def test_every_name_the_sample_lists_is_read():
    known = operator_variables() | set().union(
        *role_defaults().values())
    stale = sorted(documented() - known)
    assert not stale, f"{SAMPLE.relative_to(REPO)} lists variables nothing reads: {stale}"
