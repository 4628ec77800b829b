"""gpufleet operator tasks: `fab --list` shows them, `fab --help TASK` explains one.

The planner decides, Ansible does host work; these tasks connect the two with
useful output and exit codes: 0 ok, 1 a deployment step failed, 2 bad input
(caught before any host was touched).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from invoke import Collection, Exit, task

from gpufleet import cli
from gpufleet.inventory import InventoryError
from gpufleet.lab.tasks import lab
from gpufleet.plan import PlanError

ROOT = Path(__file__).resolve().parent
DEFAULT_INVENTORY = "inventories/lab"
# The deploy's plays in order (site.yml imports the ones that exist).
PLAYS = ["preflight.yml", "prepare.yml", "cache.yml", "serve.yml", "smoke.yml", "health.yml"]


def _plan(target, inventory, with_="", set_=None, unset=None):
    try:
        return cli.build(target, inventory, with_, set_, unset)
    except (PlanError, InventoryError) as exc:
        raise Exit(f"gpufleet: refusing, nothing was changed:\n{exc}", code=2) from None


@task(help={"format": "text (default) or json"})
def targets(c, format="text"):
    """List the deployment targets."""
    rows = cli.targets_table()
    if format == "json":
        print(json.dumps(rows, indent=2))
        return
    cli.print_table([["target", "engine", "hardware", "seed", "summary"]]
                    + [[r["name"], r["engine"], r["hardware"], r["seed"], r["summary"]]
                       for r in rows])


@task(
    iterable=["set_", "unset"],
    help={
        "target": "target name (fab targets); default: gpufleet_target from the inventory",
        "inventory": "Ansible inventory; without it, the target's reference topology "
                     "with placeholder hosts",
        "with_": "options to layer on, comma separated (hicache,cp,layer-split,dflash2,fp8-kv)",
        "set_": "override ROLE:--flag=value or ROLE:ENV=value (ROLE: engines, worker, "
                "prefill, decode, router, etcd); repeatable",
        "unset": "drop ROLE:--flag or ROLE:ENV; repeatable",
        "format": "text (default) or json",
    },
)
def plan(c, target=None, inventory=None, with_="", set_=None, unset=None, format="text"):
    """Show every process a target runs: host, argv, environment, GPUs, ports, units."""
    p = _plan(target, inventory, with_, set_, unset)
    if format == "json":
        print(cli.plan_json(p))
    else:
        cli.plan_text(p)


def _playbook(c, playbook, plan_obj, inventory, extra=None):
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
    extra_vars = {"gpufleet_plan_json": plan_obj.to_json(), **(extra or {})}
    cmd = [str(Path(sys.executable).with_name("ansible-playbook")), "-i", inventory,
           str(ROOT / playbook), "-e", json.dumps(extra_vars)]
    result = subprocess.run(cmd, env=env, cwd=ROOT, check=False)
    if result.returncode != 0:
        raise Exit(f"gpufleet: {playbook} failed (exit {result.returncode}); "
                   "the output above names the host and the step", code=1)


@task(
    iterable=["set_", "unset"],
    help={
        "target": "target name (fab targets)",
        "inventory": f"Ansible inventory (default {DEFAULT_INVENTORY})",
        "with_": "options to layer on, comma separated",
        "set_": "override ROLE:--flag=value or ROLE:ENV=value; repeatable",
        "unset": "drop ROLE:--flag or ROLE:ENV; repeatable",
    },
)
def deploy(c, target=None, inventory=DEFAULT_INVENTORY, with_="", set_=None, unset=None):
    """Deploy a target: validate the plan, then run site.yml against the inventory."""
    if inventory == DEFAULT_INVENTORY and not (ROOT / inventory / "hosts.yml").exists():
        raise Exit("gpufleet: the lab inventory does not exist yet. Fix: bring the lab up "
                   "first (fab lab.up) or pass -i with your inventory", code=2)
    p = _plan(target, inventory, with_, set_, unset)
    print(f"gpufleet: deploying {p.target.name} to {inventory} "
          f"({len(p.processes)} processes on {len(p.hosts)} host(s))")
    _playbook(c, "site.yml", p, inventory)
    missing = [name for name in PLAYS if not (ROOT / "playbooks" / name).exists()]
    if missing:
        raise Exit(f"gpufleet: preflight passed for {p.target.name}; the steps "
                   f"{', '.join(missing)} are not part of this release yet, so nothing "
                   "was installed or started", code=1)


ns = Collection(targets, plan, deploy)
ns.add_collection(lab)
