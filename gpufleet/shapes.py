"""Plan shapes: what a deployment looks like to the hosts, apart from its flags.

Two plans have one shape when they run the same roles, placed alike across their hosts,
each listening alike (all addresses, loopback, or the host's own address), with or
without the API gateway, a pool, replicas, from a venv or an image, of one engine
family. A lab deploy of one plan of a shape proves what a deploy promises (the right
process on each port, the key enforced, internal ports closed) for every plan of it,
so the suite deploys one of each (tests/integration/test_shapes.py); tests/shapes.yml
lists them, and a unit test fails when the catalog grows one it does not list.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass

import yaml

from . import catalog as cat
from . import inventory as inv_mod
from .model import ENGINE_ROLES, Plan, PlanError

# the documented options that change a plan's shape (and how a plan asks for each)
VARIANTS = ("pool", "replicas", "image", "no-key")
# a shape's representative runs on the first of these its cases' hardware has (the lab's
# default profile is an 8x H200 node; GB200 trays have a lab profile of their own)
LAB_HARDWARE = ("h200", "gb200")
# deployed by --slow only (CI's time): the image runtime crossed with every layout (vLLM's
# image is built and served in every run by tests/integration/test_image_runtime.py),
# replicas (one copy of a single-node layout per host, each layout deployed in every run
# alone), and every layout without the gateway (gpufleet_api_key: false: no key to prove;
# what the verify play proves of it, steady units and closed loopback ports, is proven for
# the same layout with the gateway in every run)
SLOW_VARIANTS = ("image", "replicas", "no-key")
# ... but one shape of each of them in every run: the gateway per copy on each host
EVERY_RUN = ("h200-pd-1node+replicas",)
REGISTRY = "tests/shapes.yml"


@dataclass(frozen=True)
class Case:
    """A target and the options a representative of a shape is planned with."""

    target: str
    variants: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return "+".join((self.target, *self.variants))


def _bind_kind(bind: str) -> str:
    return {"0.0.0.0": "any", "127.0.0.1": "loopback"}.get(bind, "address")


def shape(plan: Plan) -> str:
    """A plan's shape as one line: family, runtime, gateway, pool, replicas, then each
    process of the first copy as role@host-index:bind (hosts numbered in plan order)."""
    first_copy = plan.processes
    if len(plan.endpoints) > 1:  # replicas: every copy alike, on a host of its own
        first = plan.processes[0].host
        first_copy = [p for p in plan.processes if p.host == first]
    hosts = list(dict.fromkeys(p.host for p in first_copy))
    procs = sorted(f"{p.role}@{hosts.index(p.host)}:{_bind_kind(p.bind)}"
                   + ("*" if p.front else "") for p in first_copy)
    runtime = "image" if any(p.container for p in plan.processes) else "venv"
    flags = [plan.target.engine, runtime,
             "gateway" if plan.api.get("key_required") else "open",
             "pool" if plan.pooled else "single",
             "replicas" if len(plan.endpoints) > 1 else "one"]
    return " ".join(flags) + " | " + " ".join(procs)


def overrides(case: Case, catalog=None) -> dict:
    """The overrides a case's variants stand for (pool: one worker of each engine role,
    the pooled form a count change keeps)."""
    catalog = catalog or cat.load()
    target = catalog.targets[case.target]
    topology = catalog.topologies[target.topology]
    ov: dict = {}
    if "pool" in case.variants:
        ov["workers"] = {s.role: 1 for s in topology.processes if s.role in ENGINE_ROLES}
    if "replicas" in case.variants:
        ov["replicas"] = True
    if "image" in case.variants:
        ov["runtime"] = "image"
    if "no-key" in case.variants:
        ov["api_key"] = False
    return ov


def inventory_for(case: Case, catalog=None) -> inv_mod.Inventory | None:
    """Placeholder hosts, with two in the group for replicas (one copy each)."""
    if "replicas" not in case.variants:
        return None
    catalog = catalog or cat.load()
    groups = catalog.topologies[catalog.targets[case.target].topology].groups
    return inv_mod.placeholder({g: 2 for g in groups})


def plan_case(case: Case, catalog=None):
    from .plan import make_plan

    return make_plan(case.target, inventory_for(case, catalog), overrides(case, catalog))


def all_shapes() -> dict[str, list[Case]]:
    """Every shape over every offered target and every combination of the variants that
    plans (a combination the planner refuses, such as a pool with replicas, is no shape),
    each with the cases that have it, in catalog order. A lab-only target (lab-cpu) is no
    shape a user can ask for: its own lab tests deploy it (test_lab_cpu*.py)."""
    catalog = cat.load()
    out: dict[str, list[Case]] = {}
    for name in (n for n, t in catalog.targets.items() if not t.lab):
        for k in range(len(VARIANTS) + 1):
            for variants in itertools.combinations(VARIANTS, k):
                case = Case(name, variants)
                try:
                    plan = plan_case(case, catalog)
                except PlanError:
                    continue
                out.setdefault(shape(plan), []).append(case)
    return out


def registry(shapes: dict[str, list[Case]] | None = None, deployed_by: dict | None = None
             ) -> list[dict]:
    """tests/shapes.yml's entries: each shape, how many cases have it, its representative
    (on lab hardware where a case has it), whether only --slow deploys it, and the test
    that deploys it where another than tests/integration/test_shapes.py does."""
    catalog = cat.load()
    shapes = shapes or all_shapes()
    deployed_by = deployed_by or {}
    out = []
    for line, cases in shapes.items():
        rank = {hw: i for i, hw in enumerate(LAB_HARDWARE)}
        case = min(cases, key=lambda c: rank.get(catalog.targets[c.target].hardware,
                                                  len(rank)))
        entry = {"shape": line, "cases": len(cases), "case": case.name,
                 # where another test deploys it, that test's own mark decides
                 "slow": line not in deployed_by and case.name not in EVERY_RUN
                 and any(v in SLOW_VARIANTS for v in case.variants)}
        if line in deployed_by:
            entry["by"] = deployed_by[line]
        out.append(entry)
    return out


def case_of(name: str) -> Case:
    target, *variants = name.split("+")
    return Case(target, tuple(variants))


class _Dumper(yaml.SafeDumper):
    """Lists indented under their key, as yamllint's default style wants."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)


def main(argv: list[str]) -> int:
    """python -m gpufleet.shapes [--write]: print the registry (or write tests/shapes.yml,
    keeping the `by` of each shape that still exists)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / REGISTRY
    old = yaml.safe_load(path.read_text()) if path.exists() else {"shapes": []}
    by = {e["shape"]: e["by"] for e in old["shapes"] if e.get("by")}
    entries = registry(deployed_by=by)
    text = (
        "# Every plan shape (gpufleet/shapes.py) over every target and documented option,\n"
        "# made by `python -m gpufleet.shapes --write`; tests/unit/test_shape_registry.py\n"
        "# fails when the catalog's shapes differ. tests/integration/test_shapes.py deploys\n"
        "# each shape on the lab (its `case`) unless `by` names the test that does;\n"
        "# `slow`: --slow only.\n"
        + "---\n" + yaml.dump({"total": len(entries), "shapes": entries}, Dumper=_Dumper,
                              sort_keys=False, width=100))
    if "--write" in argv:
        path.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
