"""Operator-facing glue: overrides from the command line and the inventory, plan output.

`tasks.py` (fab) and the Ansible plugin both come through here, so a target, an
inventory and overrides turn into a plan the same way wherever they come from.
"""

from __future__ import annotations

import json
import sys
import time

import yaml

from . import catalog as cat
from . import inventory as inv_mod
from .plan import Plan, PlanError, Problem, make_plan

# inventory variable -> Overrides field
INVENTORY_OVERRIDES = {
    "gpufleet_with": "options",
    "gpufleet_args": "args",
    "gpufleet_env": "env",
    "gpufleet_ports": "ports",
    "gpufleet_gpus": "gpus",
    "gpufleet_model_revision": "model_revision",
    "gpufleet_cache_dir": "cache_dir",
    "gpufleet_hf_endpoint": "hf_endpoint",
    "gpufleet_api_key": "api_key",
    "gpufleet_api_key_file": "api_key_file",
    "gpufleet_tls": "tls",
    "gpufleet_tls_cert_file": "tls_cert_file",
    "gpufleet_tls_key_file": "tls_key_file",
    "gpufleet_tls_ca_file": "tls_ca_file",
    "gpufleet_metrics_allow": "metrics_allow",
    "gpufleet_metrics_port": "metrics_port",
    "gpufleet_alert_bounds": "alert_bounds",
    "gpufleet_dcgm_exporter_port": "dcgm_exporter_port",
    "gpufleet_replicas": "replicas",
    "gpufleet_workers": "workers",
    "gpufleet_max_unavailable": "max_unavailable",
    "gpufleet_quarantine": "quarantine",
    "gpufleet_max_fail_percentage": "max_fail_percentage",
    "gpufleet_runtime": "runtime",
    "gpufleet_images": "images",
    "gpufleet_engine_versions": "engine_versions",
    "gpufleet_registry_mirror": "registry_mirror",
    "gpufleet_acknowledge": "acknowledge",
}
# every inventory variable the planner reads, the overrides above and those it reads by
# name (tests/unit/test_plugin_docs.py derives the same set from the code). fab refuses
# them as Ansible extra variables (-e), which would reach the roles but not the plan.
PLAN_VARIABLES = frozenset(INVENTORY_OVERRIDES) | {
    "gpufleet_target", "gpufleet_deployment", "gpufleet_hardware", "gpufleet_host_python",
    "gpufleet_internal_address", "gpufleet_lab"}


def split_csv(value: str | list | None, what: str = "gpufleet_with") -> list[str]:
    if not value:
        return []
    if not isinstance(value, (str, list)) or not all(isinstance(i, str) for i in (
            value if isinstance(value, list) else [value])):
        raise PlanError([Problem(what, f"{value!r} is not a list of option names",
                                 "write e.g. gpufleet_with: [hicache] or --with hicache,cp")])
    items = value if isinstance(value, list) else value.split(",")
    return [i.strip() for i in items if i.strip()]


def parse_set(items: list[str], unset: list[str]) -> dict:
    """`ROLE:--flag=value` / `ROLE:ENV_VAR=value` / unset `ROLE:--flag` -> overrides."""
    out: dict = {"args": {}, "env": {}}
    for raw, is_unset in [(i, False) for i in items] + [(i, True) for i in unset]:
        role, sep, rest = raw.partition(":")
        key, eq, value = rest.partition("=")
        if not sep or not key or (not is_unset and not eq):
            form = "ROLE:KEY" if is_unset else "ROLE:KEY=VALUE"
            raise PlanError([Problem(
                "set", f"{raw!r} is not {form}",
                "write e.g. --set decode:--max-num-seqs=256, --set engines:UCX_TLS=tcp "
                "or --unset decode:--enforce-eager")])
        kind = "args" if key.startswith("-") else "env"
        if not is_unset and value.strip() == "":
            raise PlanError([Problem(
                "set", f"{raw!r} gives {key} an empty value",
                f"give a value, {role}:{key}=true for a flag without one, or --unset "
                f"{role}:{key} to remove it")])
        try:
            parsed: object = (None if is_unset else yaml.safe_load(value) if kind == "args"
                              else value)
        except yaml.YAMLError as exc:
            raise PlanError([Problem(
                "set", f"{raw!r}: the value is not YAML ({str(exc).splitlines()[0]})",
                "quote it: --set 'ROLE:--flag=\"text\"'")]) from None
        if parsed is None and not is_unset:
            raise PlanError([Problem(
                "set", f"{raw!r} sets {key} to null, which would remove it",
                f"remove it with --unset {role}:{key}")])
        out[kind].setdefault(role, {})[key] = parsed
    return out


def overrides_from(inventory: inv_mod.Inventory | None, options: list[str],
                   sets: dict) -> dict:
    """Inventory variables first, then the command line on top."""
    data: dict = {}
    if inventory is not None:
        for var, key in INVENTORY_OVERRIDES.items():
            if var in inventory.vars:
                data[key] = inventory.vars[var]
    if "options" in data:
        data["options"] = split_csv(data["options"])
    data["options"] = data.get("options", []) + [o for o in options
                                                 if o not in data.get("options", [])]
    for kind in ("args", "env"):
        for role, values in sets.get(kind, {}).items():
            data.setdefault(kind, {}).setdefault(role, {}).update(values)
    return data


def target_from(inventory: inv_mod.Inventory | None, target: str | None) -> str:
    if target:
        return target
    if inventory is not None and inventory.vars.get("gpufleet_target"):
        return str(inventory.vars["gpufleet_target"])
    raise PlanError([Problem(
        "target", "no target given",
        "pass --target NAME or set gpufleet_target in the inventory (fab targets lists them)")])


def build(target: str | None, inventory_path: str | None, with_: str = "",
          set_: list[str] | None = None, unset: list[str] | None = None,
          runtime: str | None = None, quarantine: list[str] | None = None) -> Plan:
    """The plan for command-line arguments (QUARANTINE: hosts a deploy went on without).
    Raises PlanError / InventoryError."""
    inventory = inv_mod.load(inventory_path) if inventory_path else None
    name = target_from(inventory, target)
    overrides = overrides_from(inventory, split_csv(with_), parse_set(set_ or [], unset or []))
    if runtime:
        overrides["runtime"] = runtime
    if quarantine:
        quarantined(overrides, quarantine)
    return make_plan(name, inventory, overrides or None)


def quarantined(overrides: dict, hosts: list[str]) -> dict:
    """OVERRIDES with HOSTS added to the hosts left out of serving (gpufleet_quarantine):
    what a deploy quarantined, on top of what the inventory leaves out."""
    overrides["quarantine"] = sorted(set(overrides.get("quarantine", [])) | set(hosts))
    return overrides


def targets_table() -> list[dict]:
    catalog = cat.load()
    return [
        {"name": name, "summary": t.summary, "engine": t.engine, "hardware": t.hardware,
         "model": catalog.models[t.model].repo, "seed": t.seed}
        for name, t in sorted(catalog.targets.items())
    ]


def print_table(rows: list[list[str]], out=sys.stdout) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(),
              file=out)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=out)


def health_text(results: dict, unreachable: list[str], out=sys.stdout) -> None:
    """`fab health`: one row per check (detail shortened), then every failing check's
    whole detail (the component and the action are at its end) and each sick host."""
    rows = [["host", "check", "unit", "status", "detail"]]
    failing = []
    for host, r in sorted(results.items()):
        for ch in r.get("checks", []):
            detail = str(ch.get("detail", ""))
            rows.append([host, ch["check"], ch.get("unit") or "-", ch["status"],
                         detail if len(detail) <= 70 else detail[:67] + "..."])
            if ch["status"] in ("fail", "error") and len(detail) > 70:
                failing.append(f"{host} {ch['check']} {ch.get('unit') or '-'}: {detail}")
        if r.get("error"):
            rows.append([host, "checker", "-", "FAIL", r["error"][:70]])
    print_table(rows, out)
    for line in failing:
        print(line, file=out)
    for host, r in sorted(results.items()):
        if r.get("host_fault"):
            print(f"{host}: SICK ({', '.join(r['host_fault'])}): {held_text(r)}; fix what "
                  "the check says", file=out)
    for host in unreachable:
        print(f"{host}: unreachable", file=out)


def held_text(fault: dict) -> str:
    """What the health checker does on a sick host: its engines stopped (drained), or,
    with health_drain off or no engine running, their restarts held."""
    if fault.get("drained"):
        return (f"engines stopped, out of their routers' pools ({', '.join(fault['drained'])}) "
                "until its checks pass")
    return "its engines' restarts are held"


def sick_text(host: str, fault: dict) -> str:
    """`fab status`'s line for a host whose health checker holds its restarts."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(fault.get("since") or 0))
    return (f"{host}: SICK since {since} ({', '.join(fault.get('checks') or [])}): "
            f"{held_text(fault)}; fix what `fab health` names")


def plan_text(plan: Plan, out=sys.stdout) -> None:
    t = plan.target
    print(f"target    {t.name}: {t.summary}", file=out)
    print(f"model     {plan.model.repo} @ {plan.cache['models'][0]['revision']} "
          f"(served as {plan.model.served_name}, {plan.model.weight_gib:.0f} GiB)", file=out)
    print(f"engine    {plan.engine.label}", file=out)
    print(f"hardware  {plan.hardware.gpus_per_node}x {plan.hardware.product} per node "
          f"({plan.hardware.cpu_arch})", file=out)
    if plan.options:
        print(f"options   {', '.join(plan.options)}", file=out)
    print(f"endpoint  {plan.endpoint}", file=out)
    print(f"cache     {plan.cache['path']} (needs {plan.cache['min_free_gib']} GiB free)",
          file=out)
    print("", file=out)
    rows = [["order", "process", "host", "unit", "gpus", "ports"]]
    for p in sorted(plan.processes, key=lambda p: (p.order, p.name)):
        rows.append([str(p.order), p.name, p.host, p.unit,
                     ",".join(map(str, p.gpus)) or "-",
                     " ".join(f"{k}={v}" for k, v in p.ports.items())])
    print_table(rows, out)
    for p in plan.processes:
        print(f"\n# {p.name} on {p.host}", file=out)
        for k, v in p.env.items():
            print(f"{k}={v} \\", file=out)
        print(p.command, file=out)
    for w in plan.warnings:
        print(f"\nwarning: {w}", file=out)


def plan_json(plan: Plan) -> str:
    return json.dumps(plan.to_json(), indent=2)
