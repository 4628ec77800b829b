"""Filters gpufleet's plays use: argv and environment in systemd's own syntax, the host
own files' paths, and each host's slice of the plan."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import quote

from gpufleet.acceptance import host_spec
from gpufleet.model import host_slices

# gpufleet's own files (host programs, locks): paths relative to the repository root
ROOT = Path(__file__).resolve().parents[3]

_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def systemd_word(word: str) -> str:
    """One argument for ExecStart=: specifiers (%) and variables ($) escaped, quoted when
    needed, with C-style escapes inside double quotes (systemd.syntax)."""
    word = str(word).replace("%", "%%").replace("$", "$$")
    if word and _SAFE.match(word):
        return word
    escaped = word.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def systemd_argv(argv: list) -> str:
    """The argv list as an ExecStart= command line that systemd splits back into argv."""
    return " ".join(systemd_word(w) for w in argv)


def env_file_line(key: str, value: object) -> str:
    """KEY="value" for an EnvironmentFile= (double-quoted, backslash escapes)."""
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", str(key)):
        raise ValueError(f"not an environment variable name: {key!r}")
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'{key}="{text}"'


def own_file(relative: str) -> str:
    """The controller's path of one of gpufleet's own files (a host program, a lock), from
    its path in the repository: roles name them so, never by climbing out of role_path."""
    path = ROOT / relative
    if not path.is_file():
        raise ValueError(f"gpufleet has no file {relative} (looked in {ROOT})")
    return str(path)


def pool_others(workers: list, pool: dict) -> int:
    """How many healthy workers of a pool worker's kind a router's GET /workers lists
    besides that worker (plan readiness.pool: its `type` and `url`)."""
    return sum(1 for w in workers or [] if w.get("worker_type") == pool["type"]
               and w.get("url") != pool["url"] and w.get("is_healthy"))


def pool_worker_id(workers: list, url: str) -> str:
    """The id a router's GET /workers gives the worker at url ('' where it lists none)."""
    return next((str(w.get("id", "")) for w in workers or [] if w.get("url") == url), "")


def pool_drops(listed: list) -> list:
    """The calls that take out of each router's pool the workers it lists that the plan
    no longer gives it: `listed` is a uri loop's results over routers (item: the router's
    process with readiness.drop; json: its GET /workers). A router none of whose listed
    workers the plan keeps is left alone: that is a router naming its workers otherwise,
    not a pool to empty."""
    calls = []
    for result in listed or []:
        drop = result["item"]["readiness"]["drop"]
        workers = (result.get("json") or {}).get("workers") or []
        gone = [w for w in workers if w.get("url") not in drop["keep"]]
        if len(gone) == len(workers):
            continue
        calls += [{"method": drop["leave"]["method"], "worker": w["url"],
                   "url": drop["leave"]["url"].replace("{url}", quote(w["url"], safe=""))
                   .replace("{id}", str(w.get("id", "")))} for w in gone]
    return calls


def unsteady(now: list, before: list) -> list:
    """The units of a gpufleet_units report that are not active and running, or whose
    restart count moved since an earlier report (each with `before`, that count)."""
    earlier = {u["unit"]: u["restarts"] for u in before or []}
    return [dict(u, before=earlier.get(u["unit"], u["restarts"])) for u in now or []
            if u["active"] != "active" or u["sub"] != "running"
            or u["restarts"] != earlier.get(u["unit"], u["restarts"])]


class FilterModule:
    def filters(self):
        return {
            "gpufleet_systemd_argv": systemd_argv,
            "gpufleet_env_line": env_file_line,
            "gpufleet_file": own_file,
            "gpufleet_host_slices": host_slices,
            "gpufleet_acceptance_spec": host_spec,
            "gpufleet_pool_others": pool_others,
            "gpufleet_pool_worker_id": pool_worker_id,
            "gpufleet_pool_drops": pool_drops,
            "gpufleet_unsteady": unsteady,
        }
