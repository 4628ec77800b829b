"""Filters gpufleet's plays use: argv and environment in systemd's own syntax, the host
own files' paths, each host's slice of the plan and the commits that pin its checkpoint."""

from __future__ import annotations

import base64
import re
from pathlib import Path

from gpufleet import inputs
from gpufleet.acceptance import host_spec
from gpufleet.model import host_slices, pin_revisions

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


def command_report(result: dict) -> dict:
    """What fab reads of a command's registered result, published per host (set_stats
    `gpufleet_report`, tasks.py _reports): its exit code, output and Ansible's message."""
    return {key: (result or {}).get(key) for key in ("rc", "stdout", "stderr", "msg")}


def unsteady(now: list, before: list) -> list:
    """The units of a gpufleet_units report that are not active and running, or whose
    restart count moved since an earlier report (each with `before`, that count)."""
    earlier = {u["unit"]: u["restarts"] for u in before or []}
    return [dict(u, before=earlier.get(u["unit"], u["restarts"])) for u in now or []
            if u["active"] != "active" or u["sub"] != "running"
            or u["restarts"] != earlier.get(u["unit"], u["restarts"])]


def ref_path(hub: str, model: dict) -> str:
    """Where the Hugging Face cache names the commit of a checkpoint's branch or tag."""
    return f"{hub.rstrip('/')}/models--{model['repo'].replace('/', '--')}/refs/{model['revision']}"


def checkpoint_commits(hostvars, hosts: list, check_mode: bool = False) -> dict:
    """The commit each checkpoint's revision names on the hosts' cache, from each host's
    slurp of its refs (`__serve_refs`, playbooks/serve.yml): {commits: repo -> commit,
    problems: what stops the pin (a missing ref; hosts that disagree, naming each), notes:
    a ref a check-mode run has not fetched yet (the plan keeps the revision)}."""
    seen: dict[str, dict[str, str]] = {}
    problems, notes = [], []
    for host in hosts:
        for r in (hostvars[host].get("__serve_refs") or {}).get("results") or []:
            item = r.get("item") or {}
            if not item:
                continue  # skipped: no engine on the host
            repo, rev = item["repo"], item["revision"]
            if r.get("failed") or "content" not in r:
                hub = hostvars[host]["gpufleet_host"]["checkpoint"]["hub"]
                what = f"{host}: {repo}@{rev} has no ref on the cache ({ref_path(hub, item)})"
                if check_mode:
                    notes.append(what + "; the plan keeps the revision until the cache has it")
                else:
                    problems.append(what + ". Fix: run the cache play first (fab deploy, or "
                                    "playbooks/cache.yml before playbooks/serve.yml)")
                continue
            commit = base64.b64decode(r["content"]).decode(errors="replace").strip()
            if not inputs.COMMIT.fullmatch(commit):
                problems.append(f"{host}: {repo}@{rev}'s ref holds {commit[:60]!r}, not a "
                                "commit. Fix: run the cache play again (it rewrites the ref)")
                continue
            seen.setdefault(repo, {})[host] = commit
    commits = {}
    for repo, by_host in seen.items():
        if len(set(by_host.values())) > 1:
            problems.append(f"the hosts' caches name different commits for {repo}: " + ", ".join(
                f"{h} {c}" for h, c in sorted(by_host.items())) + ". Fix: give every engine host "
                "the one shared cache (gpufleet_cache_dir), then run the cache play")
        else:
            commits[repo] = next(iter(by_host.values()))
    return {"commits": commits, "problems": problems, "notes": notes}


def roll_steps(hostvars, hosts: list) -> list[dict]:
    """A rolling restart's steps (roles/serve roll.yml), from each host's units to restart
    (`__roll_units`) and their plan batches (plan._roll_batches): one per batch that has
    any, in order, each {batch, canary (the first), units (every host's), leader (the
    host that restarts the routers), routers: the routers restarted in turn once the
    batch serves, for its workers whose routers take them back only so}."""
    steps: dict[int, dict] = {}
    for host in hosts:
        want = set(hostvars[host].get("__roll_units") or [])
        for p in hostvars[host]["gpufleet_host"]["processes"]:
            if p["unit"] not in want:
                continue
            step = steps.setdefault(p["readiness"]["batch"], {"units": [], "routers": {}})
            step.setdefault("leader", host)
            step["units"].append(f"{host}:{p['unit']}")
            pool = p["readiness"].get("pool") or {}
            if pool and "rejoin" not in pool:
                for router in pool["routers"]:
                    step["routers"].setdefault(router["unit"], router)
    return [{"batch": batch, "canary": n == 0, "leader": step["leader"],
             "units": step["units"], "routers": list(step["routers"].values())}
            for n, (batch, step) in enumerate(sorted(steps.items()))]


class FilterModule:
    def filters(self):
        return {
            "gpufleet_systemd_argv": systemd_argv,
            "gpufleet_env_line": env_file_line,
            "gpufleet_file": own_file,
            "gpufleet_host_slices": host_slices,
            "gpufleet_pin_revisions": pin_revisions,
            "gpufleet_checkpoint_commits": checkpoint_commits,
            "gpufleet_roll_steps": roll_steps,
            "gpufleet_ref_path": ref_path,
            "gpufleet_acceptance_spec": host_spec,
            "gpufleet_unsteady": unsteady,
            "gpufleet_command_report": command_report,
        }
