"""Overrides checked as the engines check them.

Two checks, both driven by `managed` and `limits` in catalog/engines.yml:

- `managed`: flags and variables whose values the plan computes (ports, addresses,
  GPUs, node ranks, the model, the prefill/decode pairing). An override (--set,
  --unset, gpufleet_args, gpufleet_env) would change one command line while the port
  table, the router and the peer pool keep the plan's value, so it is refused with
  the setting that changes the value everywhere.
- `limits`: what the engines validate at start-up (ranges, the model's context,
  rules between flags), checked on every engine's rendered flags, so a value that
  would stop the engine on every host is refused before any host is touched.
"""

from __future__ import annotations

import re
from typing import Any

from .model import ENGINE_ROLES, OWN_PROGRAM, Overrides, Plan, Problem, Process

MODEL_CONTEXT = "model.context"
TRUE_ENV = ("1", "true", "True", "TRUE", "yes")


# --------------------------------------------------------------------------- managed

def _managed_table(catalog, engine: str, role: str):
    """The `managed` entry of the program a role runs (None when there is none)."""
    if role in OWN_PROGRAM:
        return catalog.engines[role].managed.get(role)
    program = "router" if role == "router" else "engine"
    return catalog.engines[engine].managed.get(program)


def managed(catalog, target, topology, ov: Overrides) -> list[Problem]:
    """Overrides of flags or variables that only the plan sets."""
    engine_roles = sorted({p.role for p in topology.processes if p.role in ENGINE_ROLES})
    known = {p.role for p in topology.processes} | {"engines"}
    problems = []
    for what in ("args", "env"):
        for role, values in getattr(ov, what).items():
            if role not in known:
                continue  # reported by the role check
            table = _managed_table(catalog, target.engine, role)
            names = getattr(table, what) if table else {}
            for key, value in values.items():
                if key not in names:
                    continue
                kind, _, port = names[key].partition(":")
                text = catalog.managed_kinds[kind]
                who = "/".join(engine_roles) if role == "engines" else role
                fill = {"ROLE": who, "NAME": port or "http"}
                action = "dropping it" if value is None else f"setting it to {value!r}"
                whose = "the engines'" if role == "engines" else f"{role}'s"
                where = "command line" if what == "args" else "environment"
                problems.append(Problem(
                    f"{what}.{role}.{key}",
                    f"{key} on {role} is set by the plan for {target.name}; {action} would "
                    f"change only {whose} {where}, but {_fill(text.why, fill)}",
                    _fill(text.fix, fill)))
    return problems


def pinned(target, ov: Overrides) -> list[Problem]:
    """Overrides of what the recipe requires (the target's `pins`), unless the inventory
    acknowledges the recipe's reason (gpufleet_acknowledge); an acknowledgement of what the
    target does not pin is a typo, refused too."""
    unknown = [Problem(
        "acknowledge", f"{key} is none of {target.name}'s pins ("
        + (", ".join(sorted(target.pins)) or "it has none") + ")",
        "name a pin the refusal named, or drop it from gpufleet_acknowledge")
        for key in ov.acknowledge if key not in target.pins]
    return unknown + [Problem(
        f"{what}.{role}.{key}",
        f"{key} is what {target.name}'s recipe requires ({target.pins[key]}); "
        + ("dropping it" if value is None else f"setting it to {value!r}")
        + " departs from the recipe",
        f"keep the recipe's value, or, having read the reason, acknowledge it in the "
        f"inventory: gpufleet_acknowledge: [{key}]")
        for what in ("args", "env") for role, values in getattr(ov, what).items()
        for key, value in values.items()
        if key in target.pins and key not in ov.acknowledge]


def _fill(text: str, values: dict[str, str]) -> str:
    for token, value in values.items():
        text = text.replace(token, value)
    return text


# --------------------------------------------------------------------------- limits

_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse(value: Any, kind: str) -> float | int:
    """A flag value as the engine's argparse reads it; ValueError when it cannot.
    `size` is vLLM's human-readable integer: 32k = 32000, 32K = 32768."""
    if isinstance(value, (bool, dict, list)):
        raise ValueError(value)
    text = str(value).strip()
    if kind == "float":
        return float(text)
    if kind == "size":
        m = _SIZE.fullmatch(text)
        if m:
            number, suffix = m.groups()
            if suffix in _DECIMAL:
                return int(float(number) * _DECIMAL[suffix])
            return int(number) * _BINARY[suffix]
    return int(text)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _bound(bound, plan: Plan) -> tuple[float, str]:
    """(value, where it comes from) for a bound in the limits table."""
    if bound == MODEL_CONTEXT:
        m = plan.model
        return m.context, (f"{m.context:,} tokens, the context of {m.repo} "
                           "(gpufleet/catalog/models.yml)")
    return float(bound), _num(float(bound))


def _range(limit, plan: Plan) -> str:
    def short(bound):
        return _num(_bound(bound, plan)[0])

    low = f"above {short(limit.gt)}" if limit.gt is not None else (
        f"at least {short(limit.ge)}" if limit.ge is not None else "")
    high = f"below {short(limit.lt)}" if limit.lt is not None else (
        f"at most {short(limit.le)}" if limit.le is not None else "")
    return " and ".join(x for x in (low, high) if x)


def _values(p: Process, limits) -> dict[str, Any]:
    return {limits.aliases.get(flag, flag): value for flag, value in p.args.items()}


def _check_flag(p: Process, plan: Plan, flag: str, limit, raw) -> Problem | None:
    name = "an integer" if limit.type in ("int", "size") else "a number"
    fix = f"set {flag} on {p.role} to {name} {_range(limit, plan)}".rstrip()
    if raw is True or str(raw) in limit.auto:
        return None  # a missing value is the flag table's to report
    try:
        value = parse(raw, limit.type)
    except ValueError:
        return Problem(f"{p.role}.{flag}", f"{p.role}: {flag} {raw!r} is not {name}, which "
                       f"the engine's argument parser refuses ({limit.source})", fix)
    suffixed = limit.type == "size" and _SIZE.fullmatch(str(raw).strip())
    shown = f"{raw} ({_num(value)})" if suffixed else _num(value)
    lifted = p.env.get(limit.unless_env or "") in TRUE_ENV
    checks = [
        ("gt", lambda b: value > b, "is not above"),
        ("ge", lambda b: value >= b, "is below"),
        ("lt", lambda b: lifted or value < b, "is not below"),
        ("le", lambda b: lifted or value <= b, "is above"),
    ]
    for key, ok, says in checks:
        bound = getattr(limit, key)
        if bound is None:
            continue
        number, where = _bound(bound, plan)
        if ok(number):
            continue
        return Problem(
            f"{p.role}.{flag}",
            f"{p.role}: {flag} {shown} {says} {where}, and the engine refuses to start "
            f"with it ({limit.source})",
            fix)
    return None


def _check_relation(p: Process, plan: Plan, rel, limits, values) -> Problem | None:
    if rel.when and not any(flag in p.args for flag in rel.when):
        return None
    if any(str(values.get(flag)) == value for flag, value in rel.unless.items()):
        return None
    other = rel.ge or rel.multiple_of

    def read(flag):
        kind = limits.flags[flag].type if flag in limits.flags else "int"
        if flag in values:
            raw, note = values[flag], ""
        elif flag in limits.defaults:
            raw = limits.defaults[flag]
            if raw == MODEL_CONTEXT:
                raw, note = plan.model.context, f" (the engine's default: {_bound(raw, plan)[1]})"
            else:
                note = " (the engine's default)"
        else:
            return None, ""
        try:
            return parse(raw, kind), note
        except ValueError:
            return None, ""  # reported by the flag's own limit

    (a, _), (b, b_note) = read(rel.flag), read(other)
    if a is None or b is None or (rel.above is not None and a <= rel.above):
        return None
    if rel.ge and a < b:
        return Problem(
            f"{p.role}.{rel.flag}",
            f"{p.role}: {rel.flag} {_num(a)} is below {other} {_num(b)}{b_note}, and the "
            f"engine refuses to start with it ({rel.source})",
            f"raise {rel.flag} to at least {_num(b)} on {p.role}, or lower {other}")
    if rel.multiple_of and (b == 0 or a % b):
        return Problem(
            f"{p.role}.{rel.flag}",
            f"{p.role}: {rel.flag} {_num(a)} is not a multiple of {other} {_num(b)}{b_note}, "
            f"and the engine refuses to start with it ({rel.source})",
            f"make {rel.flag} a multiple of {other} on {p.role}")
    return None


def engine_limits(plan: Plan, catalog) -> list[Problem]:
    """Values each engine validates at start-up, on the flags it will really get."""
    limits = plan.engine.limits.get("engine")
    if limits is None:
        return []
    problems: list[Problem] = []
    seen = set()
    for p in plan.processes:
        if p.role not in ENGINE_ROLES or p.role in seen:
            continue
        seen.add(p.role)  # every node of a multi-node engine has the same values
        values = _values(p, limits)
        for flag, limit in limits.flags.items():
            if flag in values:
                problems += filter(None, [_check_flag(p, plan, flag, limit, values[flag])])
        for rel in limits.relations:
            problems += filter(None, [_check_relation(p, plan, rel, limits, values)])
    return problems
