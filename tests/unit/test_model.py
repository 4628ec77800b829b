"""The plan model is the one place the planner, the rules and the overrides share: the
rules and the overrides read the model and never the planner (no import cycle), and what
the model derives about processes agrees with the roles' needs."""

from __future__ import annotations

import ast
from pathlib import Path

from gpufleet.plan import make_plan

PKG = Path(__file__).resolve().parents[2] / "gpufleet"


def imports(module: str) -> set[str]:
    """The package's own modules MODULE imports (from . import x, from .x import y)."""
    out = set()
    for node in ast.walk(ast.parse((PKG / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
    return out


def reachable(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for dep in imports(todo.pop()) - seen:
            if (PKG / f"{dep}.py").is_file():
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_rules_and_overrides_read_the_model_not_the_planner():
    assert {"rules", "overrides", "model"} <= imports("plan")
    for module in ("rules", "overrides", "model"):
        assert "plan" not in reachable(module), (module, reachable(module))


def test_process_properties_are_decided_once_and_travel_in_the_json():
    plan = make_plan("h200-disagg")
    by_role = {p["role"]: p for p in plan.to_json()["processes"]}
    assert {r for r, p in by_role.items() if p["is_engine"]} == {"prefill", "decode"}
    assert {r for r, p in by_role.items() if p["reads_ucx"]} == {"prefill", "decode"}
    # the gateway (nginx) and etcd do not run from the engine venv: a venv change leaves them
    assert {r for r, p in by_role.items() if not p["engine_venv"]} == \
        {r for r in by_role if r in ("etcd", "gateway")}
