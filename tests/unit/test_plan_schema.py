"""The plan's JSON is the only interface between Python and Ansible: every key a role,
template or playbook reads must be one the model produces, and docs/plan.md must list
every key the model produces."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gpufleet import catalog, inventory
from gpufleet.model import host_slices
from gpufleet.plan import PlanError, make_plan

REPO = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("roles", "playbooks") for p in (REPO / d).rglob("*")
           if p.suffix in (".yml", ".j2")]
READ = {"gpufleet_host": re.compile(r"\bgpufleet_host((?:\.[A-Za-z_]\w*)+)"),
        "gpufleet_plan": re.compile(r"\bgpufleet_plan((?:\.[A-Za-z_]\w*)+)")}
# a path ends where Jinja's own methods and tests begin
NOT_KEYS = {"items", "keys", "values", "get"}


def plans() -> list[dict]:
    out = []
    for name in sorted(catalog.load().targets):
        for ov in ({}, {"api_key": False}, {"metrics_allow": ["10.0.0.5"]}):
            try:
                out.append(make_plan(name, None, ov).to_json())
            except PlanError:
                continue
    out.append(make_plan("h200-pd-1node", inventory.placeholder({"workers": 2}),
                         {"replicas": True}).to_json())
    return out


def key_paths(value, prefix="") -> set[str]:
    """Every dotted path into dicts (lists: into their dict items)."""
    paths = {prefix} if prefix else set()
    if isinstance(value, dict):
        for key, item in value.items():
            paths |= key_paths(item, f"{prefix}.{key}")
    elif isinstance(value, list):
        for item in value:
            paths |= {p for p in key_paths(item, prefix) if p != prefix}
    return paths


@pytest.fixture(scope="module")
def produced() -> dict[str, set[str]]:
    plan_paths, slice_paths = set(), set()
    for plan in plans():
        plan_paths |= key_paths(plan)
        for piece in host_slices(plan).values():
            slice_paths |= key_paths(piece)
    return {"gpufleet_plan": plan_paths, "gpufleet_host": slice_paths}


def reads() -> list[tuple[str, str, str]]:
    out = []
    for path in SOURCES:
        for var, pattern in READ.items():
            for match in pattern.finditer(path.read_text()):
                keys = []
                for key in match.group(1).split(".")[1:]:
                    if key in NOT_KEYS:
                        break
                    keys.append(key)
                out.append((str(path.relative_to(REPO)), var, "." + ".".join(keys)))
    return out


def test_the_roles_read_the_slice_and_the_playbooks_nothing_else():
    found = reads()
    assert any(var == "gpufleet_host" for _, var, _ in found)
    # the controller's whole plan is read on the controller only (plan and smoke plays,
    # serve's plays that retire hosts the plan no longer has and record its hosts, and
    # teardown's that forgets them)
    assert sorted({f for f, var, _ in found if var == "gpufleet_plan"}) == [
        "playbooks/plan.yml", "playbooks/preflight.yml", "playbooks/serve.yml",
        "playbooks/smoke.yml", "playbooks/teardown.yml", "playbooks/verify.yml"]
    assert not any("hostvars['localhost']" in p.read_text() for p in SOURCES)


def test_every_key_read_is_produced_by_the_model(produced):
    unknown = sorted({(f, var + path) for f, var, path in reads()
                      if path not in produced[var]})
    assert unknown == [], f"read but never produced by gpufleet/model.py: {unknown}"


def test_a_key_the_model_does_not_produce_fails(produced, tmp_path):
    assert ".processes" in produced["gpufleet_host"]
    assert ".procesess" not in produced["gpufleet_host"]  # the check can fail


def test_docs_list_every_key_of_the_slice(produced):
    doc = (REPO / "docs" / "plan.md").read_text()
    top = sorted({p.split(".")[1] for p in produced["gpufleet_host"]})
    missing = [k for k in top if f"`{k}`" not in doc]
    assert missing == [], f"docs/plan.md does not list {missing}"


def test_every_plan_is_the_same_after_a_json_round_trip():
    """fab hands Ansible the plan as JSON; ansible-playbook alone computes it in place
    (lookup gpufleet_plan). The roles hash their slice (gpufleet_role_inputs), so anything
    JSON changes (an integer key, a tuple) would make every role converge again on the
    first run by the other path."""
    for plan in plans():
        assert json.loads(json.dumps(plan)) == plan, plan["target"]
