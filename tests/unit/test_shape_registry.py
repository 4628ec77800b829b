"""Plan shapes (gpufleet/shapes.py): the registry the lab's shape test deploys from is the
catalog's, and the planner's promises hold in every shape's plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpufleet import shapes
from gpufleet.plan import PlanError, make_plan

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def found():
    return shapes.all_shapes()


def test_the_registry_lists_every_shape_and_no_other(found):
    listed = yaml.safe_load((REPO / shapes.REGISTRY).read_text())
    have = {e["shape"] for e in listed["shapes"]}
    new, gone = sorted(set(found) - have), sorted(have - set(found))
    assert (new, gone) == ([], []), (
        f"shapes not in {shapes.REGISTRY}: {new}; listed but gone: {gone}. Fix: python -m "
        "gpufleet.shapes --write, and check that tests/integration/test_shapes.py can deploy "
        "the new one on the lab")
    assert listed["total"] == len(found)
    assert listed["shapes"] == shapes.registry(found, {e["shape"]: e["by"]
                                                      for e in listed["shapes"] if "by" in e})


def test_a_shape_another_test_deploys_names_a_test_that_exists():
    for entry in yaml.safe_load((REPO / shapes.REGISTRY).read_text())["shapes"]:
        if "by" not in entry:
            continue
        path, name = entry["by"].split("::")
        assert f"def {name}(" in (REPO / path).read_text(), entry["by"]
        assert not entry["slow"], entry


def test_a_new_shape_is_noticed(found, monkeypatch):
    """The registry check can fail: a catalog whose plans change shape lists a new one."""
    real = shapes.shape
    monkeypatch.setattr(shapes, "shape", lambda plan: real(plan) + " (changed)")
    assert not set(shapes.all_shapes()) & set(found)


def test_no_front_listens_on_every_address_behind_the_gateway(found):
    """The gateway holds the client port on the host's address: the process behind it (a
    router, or a worker clients would talk to) listens on loopback, never 0.0.0.0 (it took
    the gateway's port on every sglang-* layout and gb200-tray)."""
    for cases in found.values():
        plan = shapes.plan_case(cases[0])
        for gateway in plan.by_role("gateway"):
            behind = [p for p in plan.on_host(gateway.host) if p.role != "gateway"
                      and gateway.ports["http"] in p.ports.values()]
            assert behind and all(p.bind == "127.0.0.1" for p in behind), cases[0].name


def test_two_listeners_on_one_port_are_refused():
    """A pool's router moved onto the port its worker or the gateway holds is refused,
    naming the port."""
    for ports in ({"router": {"http": 30000}}, {"worker": {"http": 8000}}):
        with pytest.raises(PlanError, match="port (30000|8000) on workers-1"):
            make_plan("sglang-h200-low-latency", None, {"workers": {"worker": 1},
                                                        "ports": ports})


def test_every_shape_says_who_may_reach_its_ports(found):
    for cases in found.values():
        plan = shapes.plan_case(cases[0])
        exposure = plan.exposure
        assert len(exposure["clients"]) == len(plan.endpoints)
        every = {(p.name, n) for p in plan.processes for n in p.ports}
        said = {(e["process"], e["name"]) for part in exposure.values() for e in part}
        # a loopback port beside the gateway's own is the gateway's on the host's address
        beside = {(p.name, "http") for p in plan.processes if p.bind == "127.0.0.1"
                  and any(g.host == p.host and g.ports["http"] == p.ports.get("http")
                          for g in plan.by_role("gateway"))}
        assert said | beside == every, cases[0].name
