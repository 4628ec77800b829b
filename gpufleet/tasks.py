"""gpufleet operator tasks: `fab --list` shows them, `fab --help TASK` explains one.

The planner decides, Ansible does host work; these tasks connect the two with
useful output and exit codes: 0 ok, 1 a deployment step failed or something is
unhealthy, 2 bad input (caught before any host was touched).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import getpass
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from invoke import Collection, Exit, task

from gpufleet import acceptance as acceptance_report
from gpufleet import cli
from gpufleet import inventory as inventory_mod
from gpufleet.inputs import SECRET_WORDS
from gpufleet.inventory import InventoryError
from gpufleet.model import ROLES
from gpufleet.plan import PlanError

# Where the playbooks, roles and ansible.cfg are: the checkout this package runs from (an
# editable install, the lab's controller), else the collection gpufleet.fleet installed
# beside the wheel (ansible-galaxy collection install), found when a playbook first runs.
CHECKOUT = Path(__file__).resolve().parents[1]
IN_CHECKOUT = (CHECKOUT / "galaxy.yml").is_file() and (CHECKOUT / "playbooks").is_dir()
# The lab (lab/, apart from the installed package) adds `fab lab.*` where it is present.
LAB = CHECKOUT / "lab"
# the lab's inventory in the checkout; an installed gpufleet needs -i
DEFAULT_INVENTORY = "inventories/lab" if IN_CHECKOUT else ""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpufleet")
    except PackageNotFoundError:
        return "unknown"


@functools.cache
def _project() -> tuple[Path, dict[str, str]]:
    """The directory the playbooks run from, and the environment ansible-playbook needs
    there: the checkout with its ansible.cfg; else the installed collection gpufleet.fleet
    (its own ansible.cfg, the collections path it was found on first, the fact cache
    under the user's cache directory), at this package's version. Exit 2 where it is
    missing or another version."""
    if IN_CHECKOUT:
        return CHECKOUT, {"ANSIBLE_CONFIG": str(CHECKOUT / "ansible.cfg")}
    from ansible import constants

    searched = [Path(p).expanduser() for p in
                [*constants.COLLECTIONS_PATHS, *(p for p in sys.path if p)]]
    for base in searched:
        found = base / "ansible_collections" / "gpufleet" / "fleet"
        if (found / "MANIFEST.json").is_file():
            break
    else:
        raise Exit("gpufleet: the Ansible collection gpufleet.fleet is not installed (searched "
                   f"{', '.join(map(str, dict.fromkeys(searched)))}). Fix: ansible-galaxy "
                   f"collection install gpufleet-fleet-{_version()}.tar.gz", code=2)
    have = json.loads((found / "MANIFEST.json").read_text())["collection_info"]["version"]
    if have != _version():
        raise Exit(f"gpufleet: the collection gpufleet.fleet at {found} is version {have}, "
                   f"this gpufleet is {_version()}: the roles and the planner must match. Fix: "
                   f"ansible-galaxy collection install --force gpufleet-fleet-{_version()}"
                   f".tar.gz (or pip install gpufleet=={have})", code=2)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpufleet"
    return found, {
        "ANSIBLE_CONFIG": str(found / "ansible.cfg"),
        "ANSIBLE_COLLECTIONS_PATH": os.pathsep.join(
            dict.fromkeys([str(base), *map(str, constants.COLLECTIONS_PATHS)])),
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(cache / "ansible-facts"),
    }


def _format(value: str, *choices: str) -> str:
    """--format's value, one of choices (text first), or exit 2 naming them."""
    if value not in choices:
        raise Exit(f"gpufleet: --format {value!r} is not one of {', '.join(choices)}", code=2)
    return value


def _number(flag: str, value, kind=int, low=None, high=None):
    """A numeric option's value, or exit 2 naming the flag and what it takes."""
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if number is None or (low is not None and number < low) or (
            high is not None and number > high):
        what = "an integer" if kind is int else "a number"
        bounds = (f" from {low}" if low is not None else "") + (
            f" to {high}" if high is not None else "")
        dashes = "-" if len(flag) == 1 else "--"
        raise Exit(f"gpufleet: {dashes}{flag} {value!r}: give {what}{bounds}", code=2)
    return number

PLAN_HELP = {
    "target": "target name (fab targets); default: gpufleet_target from the inventory",
    "inventory": (f"Ansible inventory (default {DEFAULT_INVENTORY})" if DEFAULT_INVENTORY
                  else "Ansible inventory (a file or directory; required)"),
    "with_": "options to layer on, comma separated (hicache,cp,layer-split,dflash2,fp8-kv)",
    "set_": "override ROLE:--flag=value or ROLE:ENV=value (ROLE: engines, worker, prefill, "
            "decode, router, etcd); repeatable",
    "unset": "drop ROLE:--flag or ROLE:ENV; repeatable",
    "runtime": "venv or image (default: gpufleet_runtime from the inventory, else venv on "
               "NVIDIA hosts and image on AMD hosts)",
}


# Ansible's own options, passed through to ansible-playbook. Every task that runs a playbook
# takes them all (playbook_task); the tasks that only read the inventory take the vault
# password (inventory_task), since the inventory may hold vaulted values.
ANSIBLE_OPTIONS = {
    "limit": (None, "only these hosts: an Ansible host pattern, as ansible-playbook --limit"),
    "verbose": (0, "Ansible's verbosity: -v, -vv, -vvv, as ansible-playbook"),
    "extra_vars": (None, "a role's variable for this run: KEY=VALUE, YAML or @FILE, as "
                         "ansible-playbook -e (the plan's inputs are refused here: set those "
                         "in the inventory); repeatable"),
    "ask_vault_pass": (False, "ask for the vault password once, for the inventory and the "
                              "run"),
    "ask_become_pass": (False, "ask for the become (sudo) password, as ansible-playbook -K"),
}
# what the running task passes to ansible-playbook (fab runs one task at a time), and its
# --limit pattern
PASS_THROUGH: list[str] = []
LIMIT: list[str] = []


class _NamesLoader(yaml.SafeLoader):
    """YAML as a vars file holds it, values with Ansible's tags (!vault) read as nothing:
    only the names matter here."""


_NamesLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _extra_var_names(value: str) -> set[str]:
    """The names an -e value sets, read as ansible-playbook reads it: @FILE, a YAML or
    JSON mapping, or KEY=VALUE pairs; exit 2 for a value it would refuse."""
    from ansible.parsing.splitter import parse_kv

    if value.startswith("@"):
        path = Path(value[1:]).expanduser()
        try:
            text = path.read_text()
        except OSError as exc:
            raise Exit(f"gpufleet: -e {value}: cannot read {path} ({exc.strerror})",
                       code=2) from None
        if text.startswith("$ANSIBLE_VAULT"):
            return set()  # encrypted: Ansible decrypts it with the vault password
        try:
            data = yaml.load(text, Loader=_NamesLoader)  # noqa: S506 (safe, tags ignored)
        except yaml.YAMLError:
            data = None
    elif value.lstrip().startswith("{"):
        try:
            data = yaml.safe_load(value)
        except yaml.YAMLError:
            data = None
    else:
        data = parse_kv(value)
        if "_raw_params" in data:
            data = None
    if not isinstance(data, dict):
        raise Exit(f"gpufleet: -e {value!r}: give KEY=VALUE, a YAML or JSON mapping, or "
                   "@FILE (as ansible-playbook -e)", code=2)
    return set(data)


@contextlib.contextmanager
def _ansible_options(limit=None, verbose=0, extra_vars=None, ask_vault_pass=False,
                     ask_become_pass=False):
    """Check the pass-through options and hold them (and the vault password) for the
    task's run; exit 2 before anything runs where one is wrong."""
    args: list[str] = []
    if limit is not None and not str(limit).strip():
        raise Exit("gpufleet: --limit '': give a host pattern (a host, a group, "
                   "host1,host2)", code=2)
    if verbose:
        args.append("-" + "v" * min(int(verbose), 6))
    for value in extra_vars or []:
        names = _extra_var_names(value)
        secret = sorted(n for n in names if SECRET_WORDS.search(n))
        if secret and not value.startswith("@"):
            raise Exit(f"gpufleet: -e {', '.join(secret)}: a secret on the command line shows "
                       "in ps and in shell history. Fix: put it in the inventory with "
                       "ansible-vault, or in a vars file passed as -e @FILE", code=2)
        planned = sorted(names & (cli.PLAN_VARIABLES | {"gpufleet_plan_json"}))
        if planned:
            raise Exit(f"gpufleet: -e {', '.join(planned)}: the plan reads this from the "
                       "inventory, and an extra variable would reach the roles but not the "
                       "plan. Fix: set it in the inventory (or use --target, --with, --set, "
                       "--runtime)", code=2)
        args += ["-e", value]
    if ask_become_pass:
        args.append("--ask-become-pass")
    with contextlib.ExitStack() as stack:
        if ask_vault_pass:
            password = getpass.getpass("Vault password: ")
            if not password:
                raise Exit("gpufleet: --ask-vault-pass: no password given", code=2)
            # a private file for ansible-inventory and ansible-playbook (0600, removed
            # after the run), never an argument or an environment value
            fh = stack.enter_context(tempfile.NamedTemporaryFile("w", prefix="gpufleet-vault-"))
            fh.write(password + "\n")
            fh.flush()
            stack.enter_context(_environ("ANSIBLE_VAULT_PASSWORD_FILE", fh.name))
        PASS_THROUGH[:] = args
        LIMIT[:] = [str(limit)] if limit is not None else []
        try:
            yield
        finally:
            PASS_THROUGH.clear()
            LIMIT.clear()


@contextlib.contextmanager
def _environ(name: str, value: str):
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _with_options(names: tuple[str, ...], **task_kw):
    """A task with Ansible's options NAMES added to its own (help, defaults, -e
    repeatable, -v counted), held by _ansible_options while it runs."""
    def wrap(body):
        @functools.wraps(body)
        def run(c, *args, **kwargs):
            opts = {n: kwargs.pop(n, ANSIBLE_OPTIONS[n][0]) for n in names}
            param = sig.parameters.get("inventory")
            inventory = kwargs.get("inventory", param.default if param else None)
            if inventory == "":
                raise Exit("gpufleet: which inventory? Fix: pass -i PATH (start from a "
                           "copy of the collection's inventories/sample)", code=2)
            if inventory:
                kwargs["inventory"] = _inventory_path(inventory)
            with _ansible_options(**opts):
                return body(c, *args, **kwargs)

        sig = inspect.signature(body)
        run.__signature__ = sig.replace(parameters=[
            *sig.parameters.values(),
            *(inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                default=ANSIBLE_OPTIONS[n][0]) for n in names)])
        return task(help={**task_kw.pop("help", {}),
                          **{n: ANSIBLE_OPTIONS[n][1] for n in names}},
                    iterable=[*task_kw.pop("iterable", []),
                              *(["extra_vars"] if "extra_vars" in names else [])],
                    incrementable=["verbose"] if "verbose" in names else [],
                    **task_kw)(run)
    return wrap


def _inventory_path(path: str) -> str:
    """An inventory path as the operator meant it, for every command fab runs (the playbooks
    run in the checkout): relative to the directory fab was started in, else to the checkout
    (inventories/h200 from anywhere, fab -r), else as given (ansible-inventory then says
    what is wrong)."""
    for base in (Path.cwd(), *([CHECKOUT] if IN_CHECKOUT else [])):
        if (base / path).exists():
            return str((base / path).resolve())
    return path


def playbook_task(**task_kw):
    """A task that runs a playbook: Ansible's options pass through."""
    return _with_options(tuple(ANSIBLE_OPTIONS), **task_kw)


def inventory_task(**task_kw):
    """A task that reads the inventory but runs no playbook: the vault password only."""
    return _with_options(("ask_vault_pass",), **task_kw)


def _plan(target, inventory, with_="", set_=None, unset=None, runtime=None, quarantine=None):
    if IN_CHECKOUT and Path(inventory).resolve() == (CHECKOUT / DEFAULT_INVENTORY).resolve() \
            and not (CHECKOUT / DEFAULT_INVENTORY / "hosts.yml").exists():
        fix = "bring the lab up first (fab lab.up) or pass" if LAB.is_dir() else "pass"
        raise Exit(f"gpufleet: the lab inventory does not exist yet. Fix: {fix} -i with your "
                   "inventory", code=2)
    try:
        return cli.build(target, inventory, with_, set_, unset, runtime, quarantine)
    except (PlanError, InventoryError) as exc:
        raise Exit(f"gpufleet: refusing, nothing was changed:\n{exc}", code=2) from None


def _deployed(target, inventory, serving=True):
    """The plan of what was last deployed to the inventory, for the tasks that act on a
    deployment (status, logs, health, smoke, endpoint, monitoring, restart, bench,
    teardown): with --target, that target; else the target and options the inventory's
    last deploy served (the controller's record of it), saying so, and the inventory's
    gpufleet_target where none is recorded. With SERVING, the hosts that deploy
    quarantined stay out (they serve nothing); teardown takes them too."""
    if target:
        return _plan(target, inventory)
    from gpufleet import inventory as inv_mod
    from gpufleet.plan import PlanError, hosts_record_path

    try:
        record = json.loads(Path(hosts_record_path(inv_mod.load(inventory))).read_text())
    except (OSError, ValueError, PlanError, inv_mod.InventoryError):
        record = {}
    if not record.get("target"):
        return _plan(None, inventory)
    print(f"gpufleet: {record['target']}, as last deployed to {inventory} (--target for "
          "another)", file=sys.stderr)
    quarantined = record.get("quarantined") if serving else None
    if quarantined:
        print(f"gpufleet: without {', '.join(quarantined)}, which that deploy quarantined",
              file=sys.stderr)
    return _plan(record["target"], inventory, ",".join(record.get("options") or []),
                 runtime=record.get("runtime"), quarantine=quarantined)


@contextlib.contextmanager
def _one_at_a_time(p, what: str):
    """Hold the deployment's controller lock (plan.deploy_lock_path) while WHAT changes its
    hosts: a second deploy, restart or teardown of it says who holds it and changes
    nothing. The lock dies with the process that holds it."""
    path = Path(p.lock_file)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            try:
                holder = json.loads(fh.read() or "{}")
            except ValueError:
                holder = {}
            raise Exit(
                f"gpufleet: refusing, nothing was changed: another run changes this "
                f"deployment: {holder.get('what', '?')} by {holder.get('user', '?')}, pid "
                f"{holder.get('pid', '?')}, since {holder.get('since', '?')} ({path}). Fix: "
                "wait for it to end, or stop it", code=2) from None
        fh.truncate(0)
        json.dump({"what": what, "pid": os.getpid(), "user": getpass.getuser(),
                   "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, fh)
        fh.flush()
        yield


# a captured run's output: Ansible's JSON result, with what each host's play published
# for fab (_reports)
JSON_RESULT = {"ANSIBLE_STDOUT_CALLBACK": "json", "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1",
               "ANSIBLE_SHOW_CUSTOM_STATS": "1"}


def _limited(plan_obj, inventory) -> list[str] | None:
    """The plan's hosts that --limit's pattern matches, as Ansible reads the pattern (its
    own inventory parser); None without --limit. Exit 2 where it matches none."""
    if not LIMIT:
        return None
    try:
        matched = inventory_mod.load(inventory, limit=LIMIT[0]).hosts
    except InventoryError:
        matched = {}
    hosts = sorted(set(matched) & set(plan_obj.hosts))
    if not hosts:
        raise Exit(f"gpufleet: --limit {LIMIT[0]!r} matches none of the deployment's hosts "
                   f"({', '.join(sorted(plan_obj.hosts))}). Fix: give a host or group of "
                   "them", code=2)
    return hosts


def _ansible(playbook, plan_obj, inventory, extra=None, capture=False, check=False):
    """Run a playbook (or a list, in one run, sharing the plan) with the plan; with
    capture, return Ansible's JSON result."""
    books = [playbook] if isinstance(playbook, str) else list(playbook)
    root, project_env = _project()
    env = {**os.environ, **project_env}
    if capture:
        env.update(JSON_RESULT)
    extra_vars = {"gpufleet_plan_json": plan_obj.to_json(), **(extra or {})}
    # the plan travels in a private file, not on the command line (`ps` shows argv)
    with tempfile.NamedTemporaryFile("w", prefix="gpufleet-plan-", suffix=".json") as fh:
        json.dump(extra_vars, fh)
        fh.flush()
        # the operator's -e first: the plan's file, last, wins. --limit as the hosts it
        # matched, with localhost: the plays that plan and record run there
        limited = _limited(plan_obj, inventory)
        limit = ["--limit", ",".join([*limited, "localhost"])] if limited else []
        cmd = [str(Path(sys.executable).with_name("ansible-playbook")), "-i", inventory,
               *[str(root / b) for b in books], *limit, *PASS_THROUGH, "-e", f"@{fh.name}"]
        if check:
            cmd += ["--check", "--diff"]
        result = subprocess.run(cmd, env=env, cwd=root, check=False,
                                capture_output=capture, text=True)
    if capture:
        try:
            return result.returncode, json.loads(result.stdout)
        except ValueError:
            raise Exit(f"gpufleet: {' '.join(books)} failed: {result.stderr.strip()[-800:]}",
                       code=1) from None
    if result.returncode == 4:  # ansible-playbook: a host could not be reached
        raise Exit(f"gpufleet: {' '.join(books)} stopped: a host is UNREACHABLE (named "
                   "above). Fix: check that the host is up and answers SSH "
                   f"(ansible -i {inventory} -m ping HOST)", code=1)
    if result.returncode != 0:
        raise Exit(f"gpufleet: {' '.join(books)} failed (exit {result.returncode}); "
                   "the output above names the host and the step", code=1)
    return result.returncode, None


def _reports(report: dict) -> dict[str, dict]:
    """host -> what its play published for fab (set_stats `gpufleet_report`, per host), read
    from Ansible's JSON result: a structured result, never looked up by a task's name."""
    return {host: stats["gpufleet_report"]
            for host, stats in (report.get("custom_stats") or {}).items()
            if "gpufleet_report" in stats}


def _host_json(report: dict, ok_key: str) -> dict[str, dict]:
    """host -> the JSON its published command printed (`stdout`); a host whose command
    printed none gets ``{ok_key: False, "checks": [], "error": <its last line of stderr, or
    Ansible's msg>}``."""
    out: dict[str, dict] = {}
    for host, r in _reports(report).items():
        try:
            out[host] = json.loads(r.get("stdout") or "")
        except ValueError:
            said = (r.get("stderr") or r.get("msg") or "").strip().splitlines()
            out[host] = {ok_key: False, "checks": [], "error": said[-1] if said else "no output"}
    return out


def _unreachable(report: dict) -> list[str]:
    stats = report.get("stats", {})
    return [h for h, s in stats.items() if s.get("unreachable") or s.get("failures")]


@task(help={"format": "text (default) or json"})
def targets(c, format="text"):
    """List the deployment targets."""
    _format(format, "text", "json")
    rows = cli.targets_table()
    if format == "json":
        print(json.dumps(rows, indent=2))
        return
    cli.print_table([["target", "engine", "hardware", "seed", "summary"]]
                    + [[r["name"], r["engine"], r["hardware"], r["seed"], r["summary"]]
                       for r in rows])


@inventory_task(iterable=["set_", "unset"], help={**PLAN_HELP, "format": "text (default) or json",
                                         "inventory": "Ansible inventory; without it, the "
                                         "target's reference topology with placeholder hosts"})
def plan(c, target=None, inventory=None, with_="", set_=None, unset=None, runtime=None,
         format="text"):
    """Show every process a target runs: host, argv, environment, GPUs, ports, units."""
    _format(format, "text", "json")
    try:
        p = cli.build(target, inventory, with_, set_, unset, runtime)
    except (PlanError, InventoryError) as exc:
        raise Exit(f"gpufleet: refusing, nothing was changed:\n{exc}", code=2) from None
    if format == "json":
        print(cli.plan_json(p))
    else:
        cli.plan_text(p)


@playbook_task(iterable=["set_", "unset"],
      help={**PLAN_HELP, "check": "dry run: ansible --check --diff, changes nothing"})
def deploy(c, target=None, inventory=DEFAULT_INVENTORY, with_="", set_=None, unset=None,
           runtime=None, check=False):
    """Deploy the target: preflight, prepare, cache, serve, verify, smoke, health.

    Ends with a summary of the processes and the endpoint."""
    p = _plan(target, inventory, with_, set_, unset, runtime)
    with contextlib.nullcontext() if check else _one_at_a_time(p, f"fab deploy {p.target.name}"):
        print(f"gpufleet: deploying {p.target.name} to {inventory} "
              f"({len(p.processes)} processes on {len(p.hosts)} host(s))")
        _ansible("site.yml", p, inventory, check=check)
    if check:
        print("gpufleet: check mode: nothing was changed")
        return
    print(f"\ngpufleet: {p.target.name} is serving {p.model.served_name}\n")
    cli.print_table([["process", "host", "unit", "gpus", "ports"]]
                    + [[x.name, x.host, x.unit, ",".join(map(str, x.gpus)) or "-",
                        " ".join(f"{k}={v}" for k, v in x.ports.items())]
                       for x in sorted(p.processes, key=lambda x: (x.order, x.name))])
    auth = ""
    if p.api.get("key_required"):
        print(f"\napi key:  required; `fab endpoint` prints it (kept 0600 in {p.api['key_file']})")
        auth = f"-H \"Authorization: Bearer $(cat {p.api['key_file']})\" "
    ca = _ca_file(p)
    if ca:
        print(f"tls:      HTTPS; clients verify it with the CA {ca}")
        auth = f"--cacert {ca} {auth}"
    elif p.api.get("tls"):
        print("tls:      HTTPS with the site's certificate (clients' own trust store)")
    elif p.api.get("key_required"):
        print("tls:      off (gpufleet_tls: false): the key crosses the network in clear text")
    for other in p.endpoints[1:]:
        print(f"replica:  {other}")
    print(f"endpoint: {p.endpoint}\ntry it:   curl {p.endpoint}/chat/completions {auth}"
          "-H 'Content-Type: application/json' -d '{\"model\": \"" + p.model.served_name
          + "\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'")
    for w in p.warnings:
        print(f"warning:  {w}")


def _ca_file(p) -> str | None:
    """The CA file clients verify the endpoint with: the self-signed certificate or the
    site's gpufleet_tls_ca_file; None: plain HTTP, or the clients' own trust store."""
    return (p.api.get("tls") or {}).get("ca_file")


def _api_key(p, inventory) -> str | None:
    if not p.api.get("key_required"):
        return None
    try:
        with open(p.api["key_file"]) as fh:
            return fh.read().strip()
    except FileNotFoundError:
        raise Exit(f"gpufleet: no API key yet for {inventory} ({p.api['key_file']}). "
                   "Fix: run `fab deploy` first; it makes the key", code=1) from None


@inventory_task(help={"target": PLAN_HELP["target"], "inventory": PLAN_HELP["inventory"],
            "format": "text (default), json, or env (OPENAI_BASE_URL/OPENAI_API_KEY lines)"})
def endpoint(c, target=None, inventory=DEFAULT_INVENTORY, format="text"):
    """The deployment's endpoint, API key and CA (made on first deploy, kept 0600 here)."""
    _format(format, "text", "json", "env")
    p = _deployed(target, inventory)
    key = _api_key(p, inventory)
    if format == "json":
        print(json.dumps({"endpoint": p.endpoint, "endpoints": p.endpoints,
                          "model": p.model.served_name,
                          "api_key": key, "api_key_file": p.api.get("key_file"),
                          "ca_file": _ca_file(p)}, indent=2))
    elif format == "env":
        # SSL_CERT_FILE: the CA for OpenAI's client (httpx), curl and Python's ssl module
        ca = f"\nSSL_CERT_FILE={_ca_file(p)}" if _ca_file(p) else ""
        print(f"OPENAI_BASE_URL={p.endpoint}\nOPENAI_API_KEY={key or 'EMPTY'}{ca}")
    else:
        for other in p.endpoints[1:]:
            print(f"replica:  {other}")
        print(f"endpoint: {p.endpoint}\nmodel:    {p.model.served_name}\n"
              f"api key:  {key or 'none (the deployment was planned with api_key: false)'}")
        if _ca_file(p):
            print(f"ca:       {_ca_file(p)} (the certificate clients verify the endpoint "
                  "with)")


@inventory_task(help={"target": PLAN_HELP["target"], "inventory": PLAN_HELP["inventory"],
            "format": "text (default: the job and the targets) or json (the targets only)",
            "write": "write the targets to DIR/DEPLOYMENT.json, the alert bounds to "
                     "DIR/DEPLOYMENT.rules.yml and the alert rules to "
                     "DIR/gpufleet-alerts.yml (a folder Prometheus reads)"})
def monitoring(c, target=None, inventory=DEFAULT_INVENTORY, format="text", write=None):
    """Prometheus's scrape targets for the deployment: its processes' metrics, labelled."""
    from gpufleet import monitoring as mon

    _format(format, "text", "json")
    p = _deployed(target, inventory)
    m = p.monitoring
    if not m["listener"]:
        raise Exit("gpufleet: no host of this deployment serves metrics: "
                   "gpufleet_metrics_allow is empty. Fix: list your Prometheus servers' "
                   "addresses in the inventory (gpufleet_metrics_allow: [10.0.0.5]) and "
                   "deploy again", code=2)
    if write:
        try:
            paths = mon.write(m, os.path.expanduser(write),
                              str(_project()[0] / "monitoring" / mon.ALERTS))
        except OSError as exc:
            raise Exit(f"gpufleet: cannot write the targets into {write}: {exc.strerror}. "
                       "Fix: name a folder you may write (Prometheus's file_sd folder)",
                       code=1) from None
        print(f"gpufleet: {len(m['targets'])} targets of {m['deployment']} in {paths[0]}, "
              f"its alert bounds in {paths[1]}, the alert rules in {paths[2]}",
              file=sys.stderr)
    if format == "json":
        print(json.dumps(mon.file_sd(m), indent=2))
        return
    folder = os.path.dirname(paths[0]) if write else "/etc/prometheus/gpufleet"
    print(f"# {m['deployment']} ({m['target']}): {len(m['targets'])} targets, each host's "
          f"metrics listener at port {m['listener']['port']}, open to "
          f"{', '.join(m['listener']['allow'])}")
    if not write:
        print(f"# write the targets, the alert bounds and the alert rules: fab monitoring "
              f"-i {inventory} --write {folder}")
    print(f"# then, once, in prometheus.yml under scrape_configs:\n{mon.scrape_config(folder)}"
          f"# and at its top (reload Prometheus when a deployment's bounds file is new or "
          f"the rules changed):\n{mon.rule_files(folder)}")


@inventory_task(help={"target": PLAN_HELP["target"], "inventory": PLAN_HELP["inventory"],
            "concurrency": "requests in flight (the vLLM recipe's: 16)",
            "prompts": "requests in all (the vLLM recipe's: 64)",
            "input_len": "prompt tokens (the vLLM recipe's: 8192)",
            "output_len": "generated tokens (the vLLM recipe's: 1024)",
            "out": "where the JSON goes (default bench/results/serving-TARGET.json)"})
def bench(c, target=None, inventory=DEFAULT_INVENTORY, concurrency="16", prompts="64",
          input_len="8192", output_len="1024", out=None):
    # numbers as text, read by _number: invoke's own int() of a bad value is a traceback
    """Load-test the deployed endpoint with AIPerf, in the vLLM recipe's shape.

    The shape is seed 000's (the vLLM recipe for GLM-5.3-Flash); it prints TTFT, ITL and
    tokens per second."""
    from gpufleet import bench as bench_mod

    sizes = {name: _number(name.replace("_", "-"), value, low=1) for name, value in (
        ("concurrency", concurrency), ("prompts", prompts), ("input_len", input_len),
        ("output_len", output_len))}
    p = _deployed(target, inventory)
    key = _api_key(p, inventory)
    try:
        result = bench_mod.run(p, key, **sizes,
                               lab=bench_mod.is_lab(inventory), out=out)
    except bench_mod.BenchError as exc:
        raise Exit(f"gpufleet: bench: {exc}", code=1) from None
    print(bench_mod.render(result))


@playbook_task(help={"target": PLAN_HELP["target"], "inventory": PLAN_HELP["inventory"],
            "check": "dry run: ansible --check --diff, changes nothing"})
def prepare(c, target=None, inventory=DEFAULT_INVENTORY, check=False):
    """Preflight every host, then prepare the hosts for the engines.

    That is the driver, the fabric manager, IMEX, RDMA, UCX, ROCm and the engine runtime
    (playbooks/prepare.yml)."""
    p = _plan(target, inventory)
    _ansible(["playbooks/preflight.yml", "playbooks/prepare.yml"], p, inventory, check=check)


@playbook_task(help={"target": PLAN_HELP["target"], "inventory": PLAN_HELP["inventory"],
            "check": "dry run: report what would be downloaded"})
def cache(c, target=None, inventory=DEFAULT_INVENTORY, check=False):
    """Put the target's checkpoint on the shared cache once, verified (playbooks/cache.yml)."""
    p = _plan(target, inventory)
    _ansible(["playbooks/preflight.yml", "playbooks/cache.yml"], p, inventory, check=check)


@playbook_task(help={"target": PLAN_HELP["target"], "inventory": PLAN_HELP["inventory"]})
def smoke(c, target=None, inventory=DEFAULT_INVENTORY):
    """Run the smoke test against the deployment's endpoint (the official openai client)."""
    p = _deployed(target, inventory)
    _ansible(["playbooks/preflight.yml", "playbooks/smoke.yml"], p, inventory)


def _status(p, inventory, roles=None, journal=0):
    extra = {"status_journal_lines": journal}
    if roles:
        extra["status_roles"] = roles
    _rc, report = _ansible("playbooks/status.yml", p, inventory, extra, capture=True)
    per_host = _reports(report)
    # a planned host that reported nothing (unreachable, failed, or its play published no
    # result) is named, never read as a host with no units; with --limit, of the hosts the
    # run was given (those in its stats, which _ansible resolved the pattern to)
    expected = set(p.hosts) & set(report.get("stats", {})) if LIMIT else set(p.hosts)
    return per_host, sorted(set(_unreachable(report)) | (expected - set(per_host)))


def _uptime(seconds: int) -> str:
    if not seconds:
        return "-"
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


@playbook_task(help={"target": PLAN_HELP["target"], "inventory": PLAN_HELP["inventory"],
            "format": "text (default) or json"})
def status(c, target=None, inventory=DEFAULT_INVENTORY, format="text"):
    """Show every unit of the deployment on every host, and each sick host.

    For each unit: its state, uptime, restarts and readiness. A host the health checker
    found sick (its restarts held) is named with its fault."""
    _format(format, "text", "json")
    p = _deployed(target, inventory)
    per_host, bad = _status(p, inventory)
    rows = [{"host": h, **u} for h, r in sorted(per_host.items()) for u in r.get("units", [])]
    sick = {h: r["host_fault"] for h, r in sorted(per_host.items()) if r.get("host_fault")}
    if format == "json":
        print(json.dumps({"units": rows, "sick": sick, "unreachable": bad}, indent=2))
    else:
        cli.print_table([["host", "unit", "role", "state", "uptime", "restarts", "ready"]]
                        + [[r["host"], r["unit"], r["role"], f"{r['active']}/{r['sub']}",
                            _uptime(r["uptime_s"]), str(r["restarts"]),
                            {True: "yes", False: "NO", None: "-"}[r["ready"]]] for r in rows])
        for h, fault in sick.items():
            print(cli.sick_text(h, fault))
        for h in bad:
            print(f"{h}: unreachable, failed or reported nothing (see the ansible output with -v)")
    if bad or sick or any(r["active"] != "active" or r["ready"] is False for r in rows):
        raise Exit(code=1)


@playbook_task(help={"role": "only this role's units (worker, prefill, decode, router, etcd)",
                     "n": "journal lines per unit (default 100)",
                     "follow": "go on printing new lines as they are written, from every "
                               "host at once (Ctrl-C ends)",
                     "target": PLAN_HELP["target"], "inventory": PLAN_HELP["inventory"]})
def logs(c, role=None, n="100", target=None, inventory=DEFAULT_INVENTORY, follow=False):
    """The last journal lines of the deployment's units, host by host."""
    if role and role not in ROLES:
        raise Exit(f"gpufleet: unknown role {role!r}; choose from {', '.join(ROLES)}", code=2)
    lines = _number("n", n, low=1)
    p = _deployed(target, inventory)
    if follow:
        _follow(p, inventory, role, lines)
        return
    per_host, bad = _status(p, inventory, [role] if role else None, lines)
    for host, result in sorted(per_host.items()):
        for u in result.get("units", []):
            print(f"==> {host} {u['unit']} ({u['active']}) <==")
            print(u.get("journal", "").rstrip())
    if bad:
        raise Exit(f"gpufleet: could not read logs from {', '.join(bad)}", code=1)


def _follow(p, inventory, role, lines):
    """fab logs -f: each host's units' journal over SSH as Ansible connects (follow.py)."""
    from gpufleet import follow as follow_mod

    hosts = _limited(p, inventory) or sorted(p.hosts)
    units = {h: [x.unit for x in p.processes if x.host == h and role in (None, x.role)]
             for h in hosts}
    hostvars = inventory_mod.load(inventory).hosts
    base = follow_mod.ssh_args(Path(os.environ.get("ANSIBLE_CONFIG")
                                    or _project()[1]["ANSIBLE_CONFIG"]))
    commands = {h: follow_mod.command(h, hostvars[h].vars, u, lines, base)
                for h, u in units.items() if u}
    if not commands:
        raise Exit(f"gpufleet: no {role} units on {', '.join(hosts)}", code=2)
    print(f"gpufleet: following {sum(map(len, units.values()))} units on "
          f"{', '.join(commands)} (Ctrl-C ends)", file=sys.stderr)
    failed = follow_mod.follow(commands)
    if failed:
        raise Exit("gpufleet: could not follow the journal: " + "; ".join(failed) + ". Fix: "
                   "check that the host answers SSH as Ansible connects, and that its user "
                   "may run journalctl (root, or sudo without a password)", code=1)


@playbook_task(help={"role": "only this role's units", "target": PLAN_HELP["target"],
            "inventory": PLAN_HELP["inventory"]})
def restart(c, role=None, target=None, inventory=DEFAULT_INVENTORY):
    """Rolling restart: one host at a time, each unit waited for until it serves again."""
    if role and role not in ROLES:
        raise Exit(f"gpufleet: unknown role {role!r}; choose from {', '.join(ROLES)}", code=2)
    p = _deployed(target, inventory)
    with _one_at_a_time(p, "fab restart"):
        _ansible("playbooks/restart.yml", p, inventory,
                 {"restart_roles": [role]} if role else None)


@playbook_task(help={"target": PLAN_HELP["target"], "inventory": PLAN_HELP["inventory"],
                     "purge_cache": "also delete the checkpoint from the shared cache (kept by "
                                    "default; asks first)",
                     "purge_images": "also delete the engine image (image runtime; kept by "
                                     "default)",
                     "yes": "do not ask before --purge-cache deletes the checkpoint",
                     "check": "dry run: ansible --check --diff, changes nothing"})
def teardown(c, target=None, inventory=DEFAULT_INVENTORY, purge_cache=False,
             purge_images=False, yes=False, check=False):
    """Stop and remove everything gpufleet installed on the hosts.

    The checkpoint cache and the engine image stay unless --purge-cache or
    --purge-images."""
    p = _deployed(target, inventory, serving=False)
    if purge_cache and not (yes or check):
        models = ", ".join(f"{m['repo']} ({m['weight_gib']:g} GiB)" for m in p.cache["models"])
        _confirm(f"--purge-cache deletes {models} from {p.cache['path']} on "
                 f"{', '.join(sorted(p.hosts))}; the next deploy downloads it again")
    with contextlib.nullcontext() if check else _one_at_a_time(p, "fab teardown"):
        _ansible("playbooks/teardown.yml", p, inventory,
                 {"teardown_cache": bool(purge_cache), "teardown_images": bool(purge_images)},
                 check=check)
    if check:
        print("gpufleet: check mode: nothing was changed")


def _confirm(what: str) -> None:
    """Ask before WHAT happens; exit 2 (nothing changed) unless the answer is yes. Without
    a terminal to ask on, --yes is the answer."""
    if not sys.stdin.isatty():
        raise Exit(f"gpufleet: refusing, nothing was changed: {what}. Fix: add --yes to "
                   "confirm", code=2)
    print(f"gpufleet: {what}.", file=sys.stderr)
    if input("Go on? [y/N] ").strip().lower() not in ("y", "yes"):
        raise Exit("gpufleet: nothing was changed", code=2)


@playbook_task(help={"target": PLAN_HELP["target"], "inventory": PLAN_HELP["inventory"],
            "format": "text (default) or json"})
def health(c, target=None, inventory=DEFAULT_INVENTORY, format="text"):
    """Run the health checker on every host now, in parallel; non-zero if anything is sick."""
    _format(format, "text", "json")
    p = _deployed(target, inventory)
    _rc, report = _ansible("playbooks/health_report.yml", p, inventory, capture=True)
    results = _host_json(report, "healthy")
    bad = [h for h in _unreachable(report) if h not in results]
    if format == "json":
        print(json.dumps({"hosts": results, "unreachable": bad}, indent=2))
    else:
        cli.health_text(results, bad)
    if bad or not results or not all(r.get("healthy") for r in results.values()):
        raise Exit(code=1)


@playbook_task(help={"target": PLAN_HELP["target"], "inventory": PLAN_HELP["inventory"],
            "threshold": "fail below this share of the expected figures (default 0.8)",
            "timeout": "seconds one collective or GPU pass may take before it counts as hung",
            "while_serving": "measure even where the engines serve (lower figures)",
            "gpus": "only these GPU indices, comma separated (default: every GPU the plan "
                    "uses)",
            "runtime": PLAN_HELP["runtime"], "format": "text (default) or json"})
def acceptance(c, target=None, inventory=DEFAULT_INVENTORY, threshold="0.8", timeout="300",
               while_serving=False, gpus="", runtime=None, format="text"):
    """Prove that the GPUs and their links deliver, before serving.

    Per host: an all_reduce across each engine's GPUs, a memory and matmul pass per GPU,
    and dcgmi diag where present, each against the hardware profile's figures. Non-zero if
    any host falls short."""
    _format(format, "text", "json")
    threshold = _number("threshold", threshold, float)
    timeout = _number("timeout", timeout, low=1)
    if not 0 < threshold <= 1:
        raise Exit(f"gpufleet: --threshold {threshold}: give a share in (0, 1]", code=2)
    if gpus and not all(g.strip().isdigit() for g in gpus.split(",")):
        raise Exit(f"gpufleet: --gpus {gpus!r}: GPU indices, comma separated (0,1)", code=2)
    p = _plan(target, inventory, runtime=runtime)
    _rc, report = _ansible("playbooks/acceptance.yml", p, inventory,
                           {"gpufleet_acceptance_threshold": threshold,
                            "gpufleet_acceptance_timeout_s": timeout,
                            "acceptance_while_serving": bool(while_serving),
                            "acceptance_gpus": [int(g) for g in gpus.split(",") if g.strip()]},
                           capture=True)
    reports = _host_json(report, "passed")
    for host in _unreachable(report):
        if host not in reports:
            reports[host] = {"passed": False, "checks": [], "error": _failure(report, host)}
    if format == "json":
        print(json.dumps({"hosts": reports}, indent=2))
    else:
        cli.print_table(acceptance_report.rows(reports))
        for line in acceptance_report.failures(reports):
            print(f"FAIL {line}")
    if not reports or not all(r.get("passed") for r in reports.values()):
        raise Exit(code=1)


def _failure(report: dict, host: str) -> str:
    """The message of the task that stopped HOST (unreachable or failed)."""
    for play in report.get("plays", []):
        for t in play.get("tasks", []):
            r = t["hosts"].get(host, {})
            if r.get("unreachable") or r.get("failed"):
                return str(r.get("msg") or "failed").strip()
    return "failed"


ns = Collection(targets, plan, deploy, endpoint, monitoring, bench, prepare, cache, smoke,
                status, logs, restart, teardown, health, acceptance)
if IN_CHECKOUT and (LAB / "gpufleet_lab").is_dir():
    sys.path.insert(0, str(LAB))
    from gpufleet_lab.tasks import lab

    ns.add_collection(lab)


def main() -> None:
    """The `fab` and `gpufleet` programs (and `python -m gpufleet`): these tasks, from any
    directory."""
    from invoke import Program

    # `fab targets | head -1`: a closed pipe ends the output quietly, as for any
    # command-line tool (a process that imports this module keeps Python's own handling)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    binary = Path(sys.argv[0]).name
    Program(namespace=ns, version=_version(), name="gpufleet",
            binary="python -m gpufleet" if binary == "__main__.py" else binary).run()
