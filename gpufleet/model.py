"""The plan model: the one shape the planner fills, the rules read and Ansible receives.

Every fact that more than one place needs about a process (is it an engine, does it
read the host's UCX file, does it run from the engine venv) is a property here, and
goes into the JSON with the process, so no role derives it from a list of role names.

The JSON the Ansible side reads is `Plan.to_json()` (the whole plan, on the controller)
and `host_slices(plan_json)[name]` (one host's part, given to each host as `gpufleet_host` by
playbooks/plan.yml); docs/plan.md documents both and tests/unit/test_plan_schema.py
fails when a role reads a key these do not produce.
"""

from __future__ import annotations

import copy
import re
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from . import catalog as cat
from . import inputs

ENGINE_ROLES = ("worker", "prefill", "decode")
# every role a process can have, in start order (the one list of them: fab's --role, the
# playbooks' role filters and the health checker's config read it or the plan)
START_ORDER = {"etcd": 0, "worker": 1, "prefill": 1, "decode": 1, "router": 2, "gateway": 3,
               "metrics": 3}
ROLES = tuple(START_ORDER)
# roles whose program comes from a catalog entry of their own, not the target's engine
OWN_PROGRAM = ("etcd", "gateway", "metrics")
DEFAULT_CACHE_DIR = "/var/cache/gpufleet/hf"
# Fit check: weights may take at most this share of the memory an engine may use;
# the rest is KV cache, activations and CUDA graphs.
WEIGHT_SHARE = 0.85
DEFAULT_MEM_FRACTION = {"vllm": 0.9, "dynamo": 0.9, "sglang": 0.8}


@dataclass
class Problem:
    field: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}. Fix: {self.fix}"


class PlanError(Exception):
    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(f"- {p}" for p in problems))


class AlertBounds(BaseModel):
    """The deployment's serving-alert bounds (gpufleet_alert_bounds; monitoring/
    gpufleet-alerts.yml compares with them, `fab monitoring --write` gives them to
    Prometheus as gpufleet_alert_bound{deployment, bound})."""

    model_config = ConfigDict(extra="forbid")

    ttft_p99_seconds: float = Field(10.0, gt=0)  # time to first token, p99 over 5 min
    itl_p99_seconds: float = Field(0.5, gt=0)  # time between two tokens, p99 over 5 min
    requests_waiting: float = Field(32, ge=0)  # one engine's waiting requests, and growing
    kv_cache_usage: float = Field(0.95, gt=0, le=1)  # one engine's KV cache, used share
    gateway_5xx_ratio: float = Field(0.05, gt=0, le=1)  # the gateway's 5xx share
    engine_error_ratio: float = Field(0.05, gt=0, le=1)  # one engine's failed requests


class Overrides(BaseModel):
    """What an operator may change on top of a target (CLI --with/--set, inventory vars)."""

    model_config = ConfigDict(extra="forbid")

    options: list[str] = Field(default_factory=list)
    # role (or `engines`) -> flag -> value; None drops the flag
    args: dict[str, dict[str, Any]] = Field(default_factory=dict)
    env: dict[str, dict[str, str | None]] = Field(default_factory=dict)
    ports: dict[str, dict[str, int]] = Field(default_factory=dict)
    gpus: dict[str, list[int]] = Field(default_factory=dict)  # role -> GPU indices
    model_revision: str | None = None
    cache_dir: str = DEFAULT_CACHE_DIR
    hf_endpoint: str | None = None
    # the endpoint requires an API key (checked by the gateway in front of the router)
    api_key: bool = True
    api_key_file: str | None = None  # on the controller; default: see plan.api_key_path()
    # the gateway serves HTTPS: with the site's certificate and key (files on the
    # controller; ca_file: what clients verify it with, else the system's trust store), or
    # a self-signed pair gpufleet makes once and keeps (plan.tls_path()); false: plain HTTP
    tls: bool = True
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    # the metrics listener on every host of the deployment (plan._listener, roles/serve):
    # the addresses or networks that may scrape it (empty: no listener) and its port
    metrics_allow: list[str] = Field(default_factory=list)
    metrics_port: int = 9464
    # a site's own dcgm-exporter on every host of the deployment (its port; None: none):
    # the listener serves its metrics too, at /metrics/dcgm-exporter
    dcgm_exporter_port: int | None = None
    alert_bounds: AlertBounds = Field(default_factory=AlertBounds)
    # a single-node target on every host of its group: one independent copy per host
    replicas: bool = False
    # engine role -> how many workers of it run behind the target's one router (default 1
    # each): N prefill and M decode, or N workers, across the hosts of their groups
    workers: dict[str, int] = Field(default_factory=dict)
    # how many workers of a pool a rolling restart takes out at once (plan._roll_batches):
    # a count or "N%" of the pool, for every pool or per role ({decode: 2, prefill: "25%"})
    max_unavailable: int | str | dict[str, int | str] = 1
    # hosts left out of serving (plan._quarantine): a deploy quarantines a host that failed
    # before serving (prepare, cache) where the plan can do without it; an operator may too
    quarantine: list[str] = Field(default_factory=list)
    # the share of the deployment's hosts a deploy may quarantine before it stops instead
    max_fail_percentage: int = Field(10, ge=0, le=100)
    # the engine runtime (None: the hosts' vendor decides, catalog `runtimes`), the image
    # each engine runs from instead of the catalog's (engine -> reference), and a registry
    # that serves every image in place of its own (an air-gapped site's mirror)
    runtime: Literal["venv", "image"] | None = None
    images: dict[str, str] = Field(default_factory=dict)
    # the release each engine runs where not the catalog's own (engine -> version of its
    # catalog `releases`): the venv runtime installs that release's lock beside the others
    engine_versions: dict[str, str] = Field(default_factory=dict)
    registry_mirror: str | None = None
    # the recipe's pins (a target's `pins`) an operator departs from on purpose
    acknowledge: list[str] = Field(default_factory=list)

    # every value that reaches a unit, an environment file, nginx or a path is checked here
    # (gpufleet/inputs.py): a ValueError's text is "what is wrong. Fix: what to do"
    @field_validator("args", mode="before")
    @classmethod
    def _args(cls, value):
        for role, flags in (value or {}).items():
            for flag, v in (flags or {}).items():
                where = f"gpufleet_args.{role}"
                _named(inputs.flag_name, flag, where, "name the flag as the engine does, "
                       "e.g. --max-num-seqs")
                _not_secret(flag, where)
                if v is False:
                    raise ValueError(
                        f"{where}.{flag} is false, which is no flag value (it would pass "
                        "the word False). Fix: leave the flag out with --unset "
                        f"{role}:{flag} (gpufleet_args: null), or use the engine's "
                        "--no-... form where it has one")
                for item in v if isinstance(v, list) else [v]:
                    if v is not None and v is not True:
                        _named(inputs.text, item, f"{where}.{flag}", "give it on one line")
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, value):
        for role, names in (value or {}).items():
            for name, v in (names or {}).items():
                where = f"gpufleet_env.{role}"
                _named(inputs.env_name, name, where, "use a name such as UCX_TLS")
                _not_secret(name, where)
                if v is not None:
                    _named(inputs.text, v, f"{where}.{name}", "give it on one line")
        return value

    @field_validator("ports", mode="before")
    @classmethod
    def _ports(cls, value):
        for role, ports in (value or {}).items():
            for name, v in (ports or {}).items():
                _named(inputs.port, v, f"gpufleet_ports.{role}.{name}",
                       "choose a free port from 1024 to 65535")
        return value

    @field_validator("metrics_allow", mode="before")
    @classmethod
    def _metrics_allow(cls, value):
        if not isinstance(value, list):
            raise ValueError(f"gpufleet_metrics_allow {value!r} is not a list. Fix: list the "
                             "Prometheus servers' addresses or networks, e.g. [10.0.0.5]")
        return [_named(inputs.network, v, "gpufleet_metrics_allow",
                       "list the Prometheus servers' addresses or networks") for v in value]

    @field_validator("metrics_port", mode="before")
    @classmethod
    def _metrics_port(cls, value):
        return _named(inputs.port, value, "gpufleet_metrics_port",
                      "choose a free port from 1024 to 65535")

    @field_validator("dcgm_exporter_port", mode="before")
    @classmethod
    def _dcgm_exporter_port(cls, value):
        return value if value is None else _named(
            inputs.port, value, "gpufleet_dcgm_exporter_port",
            "give the port your dcgm-exporter listens on (its default: 9400), or leave it out")

    @field_validator("max_unavailable", mode="before")
    @classmethod
    def _max_unavailable(cls, value):
        fix = ('give a count of workers (e.g. 2) or a share of the pool (e.g. "25%"), or per '
               'role: {decode: 2, prefill: "25%"}')
        for role, v in (value.items() if isinstance(value, dict) else [(None, value)]):
            where = "gpufleet_max_unavailable" + (f".{role}" if role else "")
            count = isinstance(v, int) and not isinstance(v, bool) and v >= 1
            share = isinstance(v, str) and re.fullmatch(r"([1-9][0-9]?|100)%", v)
            if not (count or share):
                raise ValueError(f"{where} {v!r} is neither a count of at least 1 nor a "
                                 f"share from 1% to 100%. Fix: {fix}")
        return value

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, value):
        for role, gpus in (value or {}).items():
            where = f"gpufleet_gpus.{role}"
            for g in gpus if isinstance(gpus, list) else []:
                _named(inputs.gpu_index, g, where, "list the GPU indices nvidia-smi shows")
            if isinstance(gpus, list) and len(set(map(str, gpus))) != len(gpus):
                raise ValueError(f"{where} {gpus!r} lists a GPU twice. Fix: list each once")
        return value

    @field_validator("model_revision")
    @classmethod
    def _revision(cls, value):
        return value if value is None else _named(
            inputs.revision, value, "gpufleet_model_revision",
            "give a branch or tag (main) or the commit id")

    @field_validator("cache_dir")
    @classmethod
    def _cache_dir(cls, value):
        return _named(inputs.path, value, "gpufleet_cache_dir",
                      "give the shared cache's absolute path")

    @field_validator("hf_endpoint", "registry_mirror")
    @classmethod
    def _url(cls, value, info):
        return value if value is None else _named(
            inputs.url, value, f"gpufleet_{info.field_name}", "give the mirror's URL")

    @field_validator("api_key_file", "tls_cert_file", "tls_key_file", "tls_ca_file")
    @classmethod
    def _key_file(cls, value, info):
        return value if value is None else _named(inputs.text, value,
                                                  f"gpufleet_{info.field_name}",
                                                  "name the file on one line")

    @model_validator(mode="after")
    def _tls_files(self):
        files = [f"gpufleet_{n}" for n in ("tls_cert_file", "tls_key_file", "tls_ca_file")
                 if getattr(self, n)]
        if files and not (self.api_key and self.tls):
            off = "gpufleet_tls is false" if self.api_key else \
                "gpufleet_api_key is false (no gateway)"
            raise ValueError(f"{files[0]} is set, but {off}: no gateway serves TLS. Fix: "
                             f"drop {', '.join(files)}, or turn TLS on")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            given, other = (("gpufleet_tls_cert_file", "gpufleet_tls_key_file")
                            if self.tls_cert_file else
                            ("gpufleet_tls_key_file", "gpufleet_tls_cert_file"))
            raise ValueError(f"{given} is set without {other}. Fix: give the certificate "
                             "and its key, or neither for a self-signed pair gpufleet makes")
        if self.tls_ca_file and not self.tls_cert_file:
            raise ValueError("gpufleet_tls_ca_file is set without gpufleet_tls_cert_file: "
                             "the self-signed certificate is its own CA. Fix: drop "
                             "gpufleet_tls_ca_file, or give the site's certificate and key")
        return self

    @property
    def pooled(self) -> bool:
        """A target with gpufleet_workers, whatever the counts (so 1 -> N changes only the
        routers' worker lists): what its pool settings apply to."""
        return bool(self.workers)


def _named(check, value, what: str, fix: str):
    """check(value, what), its ValueError carrying the fix."""
    try:
        return check(value, what)
    except ValueError as exc:
        text = str(exc)
        raise ValueError(text if " Fix: " in text else f"{text}. Fix: {fix}") from None


def _not_secret(name: str, where: str) -> None:
    if inputs.secret_like(name):
        raise ValueError(
            f"{where}.{name} names a credential: a flag lands in `ps`, the unit file, `fab "
            "plan` and the engine's log, a variable in an environment file the deploy "
            "prints. Fix: give the Hugging Face token as gpufleet_hf_token (ansible-vault) "
            "and let the gateway hold the API key (gpufleet_api_key_file)")


def _compact(value):
    """A dataclass's JSON (asdict) with the fields it does not have (None) left out."""
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_compact(v) for v in value]
    return value


@dataclass
class RouterCall:
    """A call to a pool's router (on `host`, at loopback) about one worker. In `url`,
    {id} is the worker's id in the router's GET /workers and {url} its URL (quoted), as
    the router names it; `body` is JSON."""

    host: str
    method: str
    url: str
    body: dict = field(default_factory=dict)


@dataclass
class PoolRouter:
    """One router of a worker's pool: where its unit runs, how to wait for it, and where
    it lists its workers."""

    host: str
    unit: str
    readiness: Readiness
    workers_url: str


@dataclass
class PoolMove:
    """How a rolling restart moves a worker out of its routers' pools and back (the
    gpufleet_pool module): each router's `leave` call, then, once the worker serves
    again, each router's `rejoin` call where the router takes a worker back through its
    API, else every router restarted in turn. `url` and `type` are the worker as its
    routers name it."""

    url: str
    type: str
    leave: list[RouterCall]
    routers: list[PoolRouter]
    rejoin: list[RouterCall] | None = None


@dataclass
class PoolDrop:
    """A router's workers that the plan no longer gives it leave its pool before they stop
    (the gpufleet_pool module): `keep` names the workers the plan gives it, as the router
    names them; `leave` is the call for each other worker it lists."""

    workers_url: str
    keep: list[str]
    leave: RouterCall


@dataclass
class Readiness:
    """How to wait for a process and how a deploy or fab restart moves it. `url` answers
    200 once it serves (absent: a rank > 0 of a multi-node engine, whose `process` is the
    rank 0 that answers for it); `generate_url` takes one real generation; `rolling`: a
    deploy that changes it restarts it in turn with the others of its kind; `pool` (a
    worker of a pool its routers move), `rejoin_s` (one its router's health check takes
    back by itself, after that many seconds) and `drop` (a router) as above; `batch`: its
    step in a rolling restart; `version`: the engine release it must report at
    `version_url`."""

    url: str | None = None
    timeout_s: int = 300
    generate_url: str | None = None
    models_url: str | None = None
    served_name: str | None = None
    # an https url: the CA file on the host it is verified with (None: the system's)
    ca_file: str | None = None
    process: str | None = None
    rolling: bool = False
    # its step in a rolling restart (plan._roll_batches): the processes of one batch restart
    # together, each batch waited for before the next; the first is the canary
    batch: int | None = None
    rejoin_s: int | None = None
    pool: PoolMove | None = None
    drop: PoolDrop | None = None
    # an engine of the venv runtime: the release it must report at version_url
    # ({"version": ...}) once it answers, or it runs another environment than planned
    version: str | None = None
    version_url: str | None = None

    def to_json(self) -> dict:
        return _compact(asdict(self))


@dataclass
class HealthCheck:
    """What the scheduled health checker checks of a process (roles/health adds only its
    thresholds): `url` answers 200 while it serves, `generate_url` takes one real
    generation of `served_name`, `grace_s` is its start-up window, `depends_on` the units
    of its host it needs serving (their failure is not counted against it), and
    `host_services`: it also needs the host services the plan requires (the fabric
    manager, IMEX). `drain`: it runs an engine on the GPUs, so the checker stops it while
    the host is sick and starts it again once the host is well."""

    url: str | None
    generate_url: str | None
    served_name: str | None
    grace_s: int
    depends_on: list[str]
    host_services: bool = False
    drain: bool = False
    ca_file: str | None = None  # an https url's CA file on the host (None: the system's)


@dataclass
class Process:
    name: str
    role: str
    host: str
    address: str
    argv: list[str]
    env: dict[str, str]
    unit: str
    ports: dict[str, int]
    gpus: list[int]
    order: int
    readiness: Readiness = field(default_factory=Readiness)
    node_rank: int = 0
    bind: str = "0.0.0.0"  # address the process listens on (plan._bind)
    args: dict[str, Any] = field(default_factory=dict, repr=False)
    # image runtime: what the container gets (plan._container); None: runs from the venv
    container: dict | None = None
    front: bool = False  # clients talk to it: the endpoint's process (plan._front, the gateway)
    health: HealthCheck | None = None  # plan._health
    # where its own host reads its Prometheus metrics (plan._metrics); None: it has none
    metrics: str | None = None

    @property
    def is_engine(self) -> bool:
        """An inference engine (worker, prefill or decode): GPUs, KV, the checkpoint."""
        return self.role in ENGINE_ROLES

    @property
    def reads_ucx(self) -> bool:
        """Reads the host's UCX file (the KV transfer runs in the engines only)."""
        return self.is_engine

    @property
    def engine_venv(self) -> bool:
        """Runs the engine's programs (engines and the engine's router), from the engine
        venv or the engine image: a change of either restarts exactly these."""
        return self.role not in OWN_PROGRAM

    @property
    def rolled(self) -> bool:
        """fab restart restarts it unless asked for its role: every process but the
        gateway (nginx holds the clients' connections; a routers' restart needs none of it)
        and the metrics listener (it proxies; nothing of it changes with an engine)."""
        return self.role not in ("gateway", "metrics")

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def to_json(self) -> dict:
        out = asdict(self)
        for private in ("args", "address", "bind"):
            out.pop(private)
        out["readiness"] = self.readiness.to_json()
        out.update(is_engine=self.is_engine, reads_ucx=self.reads_ucx,
                   engine_venv=self.engine_venv, rolled=self.rolled)
        return out


@dataclass
class EngineReq:
    name: str
    venv: str
    runtime: str = "venv"  # venv | image
    python: str | None = None
    lock: str | None = None  # repository-relative path of the lock (scripts/lock)
    glibc_floor: str | None = None
    image: str | None = None  # image runtime: the reference the host pulls and runs
    registry_mirror: str | None = None
    # where podman finds the mirror (host[:port][/path]) and whether it speaks plain http
    registry_mirror_location: str | None = None
    registry_mirror_insecure: bool = False


@dataclass
class GpuReq:
    vendor: str
    product: str
    arch: str
    count: int
    used: list[int]
    memory_mib: int
    compute_capability: str | None
    gfx: str | None


@dataclass
class HostPlan:
    """What one host must have and run. The GPU fields are None on a host without GPUs
    (a router or gateway host) and are then left out of the JSON."""

    address: str
    roles: list[str]
    units: list[str]
    ports: list[int]
    cpu_arch: str
    engine: EngineReq
    flashinfer_floor: str | None
    cache: dict
    ucx_env: dict[str, str]
    system_packages: list[str]
    disable_services: list[str]
    gpu: GpuReq | None = None
    driver_floor: str | None = None
    rocm_floor: str | None = None
    fabric_manager: bool | None = None
    nvlsm: bool | None = None
    imex: dict | None = None
    rdma: bool | None = None
    peermem: bool | None = None
    # what fab acceptance expects of this node type (catalog hardware `acceptance`)
    acceptance: dict | None = None

    GPU_ONLY = ("gpu", "driver_floor", "rocm_floor", "fabric_manager", "nvlsm", "imex",
                "rdma", "peermem", "acceptance")

    def to_json(self) -> dict:
        out = asdict(self)
        if self.gpu is None:
            for key in self.GPU_ONLY:
                out.pop(key)
        return out


@dataclass
class Plan:
    target: cat.Target
    model: cat.Model
    engine: cat.Engine
    hardware: cat.Hardware
    processes: list[Process]
    hosts: dict[str, HostPlan]
    cache: dict
    endpoint: str
    warnings: list[str]
    options: list[str]
    inventory: str
    api: dict = field(default_factory=dict)
    endpoints: list[str] = field(default_factory=list)  # one per replica
    hosts_record: str = ""  # on the controller: the hosts the last deploy served
    lock_file: str = ""  # on the controller: held while a deploy changes the hosts
    pooled: bool = False  # gpufleet_workers: the topology's pooled form (Overrides.pooled)
    # who may reach each port: clients, nobody off the host (loopback), the deployment's
    # hosts (peers); plan._exposure
    exposure: dict = field(default_factory=dict)
    # the metrics listener and the scrape targets (plan._monitoring)
    monitoring: dict = field(default_factory=dict)
    # hosts left out of serving (Overrides.quarantine; plan._quarantine): no process, no
    # router lists them; the deploy names them and ends non-zero, the retire play leaves
    # them alone
    quarantined: list[str] = field(default_factory=list)
    # what it was made from, the command line's overrides included: {target, overrides}
    # (a deploy plans again from them with a quarantine; lookup gpufleet_plan)
    inputs: dict = field(default_factory=dict)
    max_fail_percentage: int = 10  # Overrides.max_fail_percentage

    @property
    def speaks(self) -> str:
        """The engine whose API, parsers and defaults the target's engine has (catalog
        engines.*.speaks: vllm-cpu speaks vllm)."""
        return self.engine.speaks or self.target.engine

    def by_role(self, role: str) -> list[Process]:
        return [p for p in self.processes if p.role == role]

    def on_host(self, host: str) -> list[Process]:
        return [p for p in self.processes if p.host == host]

    @property
    def engines(self) -> list[Process]:
        return [p for p in self.processes if p.is_engine]

    def _model_json(self) -> dict:
        return {
            "repo": self.model.repo,
            "revision": self.cache["models"][0]["revision"],
            "served_name": self.model.served_name,
            "modalities": self.model.modalities,
            "random_weights": self.model.random_weights,
        }

    def to_json(self) -> dict:
        """The whole plan (`fab plan --format json`, the controller's gpufleet_plan)."""
        return {
            "target": self.target.name,
            "summary": self.target.summary,
            "engine": self.target.engine,
            "speaks": self.speaks,
            "hardware": self.target.hardware,
            "options": self.options,
            "model": self._model_json(),
            "endpoint": self.endpoint,
            "endpoints": self.endpoints,
            "api": self.api,
            "processes": [p.to_json() for p in self.processes],
            "hosts": {name: req.to_json() for name, req in self.hosts.items()},
            "cache": self.cache,
            "warnings": self.warnings,
            "inventory": self.inventory,
            "hosts_record": self.hosts_record,
            "exposure": self.exposure,
            "monitoring": self.monitoring,
            "quarantined": self.quarantined,
            "max_fail_percentage": self.max_fail_percentage,
            "inputs": self.inputs,
        }


def image_repository(ref: str) -> str:
    """An image reference without its tag or digest (a registry's :port stays)."""
    name = ref.split("@", 1)[0]
    head, sep, tag = name.rpartition(":")
    return head if sep and "/" not in tag else name


def pin_revisions(host: dict, commits: dict[str, str]) -> dict:
    """A host's slice of the plan (`gpufleet_host`) with each checkpoint's revision (a
    branch or tag) replaced by the commit the cache holds for it (`commits`: repo ->
    40-hex commit), in every engine's command line (after the checkpoint's revision flag)
    and in its checkpoint's models (`commit`): a node restarted later loads the weights
    its peers serve, whatever the branch names by then."""
    bad = {repo: c for repo, c in commits.items() if not inputs.COMMIT.fullmatch(str(c))}
    if bad:
        raise ValueError(f"not 40-hex commits: {bad}")
    host = copy.deepcopy(host)
    pins = {}
    for m in host["checkpoint"]["models"]:
        commit = m["revision"] if inputs.COMMIT.fullmatch(m["revision"]) else commits.get(m["repo"])
        if commit:
            m["commit"] = commit
            if m.get("flag"):
                pins[m["flag"]] = commit
    for p in host["processes"]:
        if not p.get("is_engine"):
            continue
        argv = p["argv"]
        for i in range(len(argv) - 1):
            if argv[i] in pins:
                argv[i + 1] = pins[argv[i]]
    return host


def host_slices(plan_json: dict) -> dict[str, dict]:
    """Each host's part of a plan's JSON, given to it as `gpufleet_host` by
    playbooks/plan.yml: its requirements (`hosts[name]`), its own processes, and the
    deployment-wide facts its roles read (`checkpoint` is the plan's `cache`)."""
    out = {}
    plan_hosts = list(plan_json["hosts"])
    deployment = {
        "plan_hosts": plan_hosts,  # every host of the plan, in the plan's order
        "peers": sorted({req["address"] for req in plan_json["hosts"].values()}),
        # every start level of the deployment: hosts start level by level together
        "start_orders": sorted({p["order"] for p in plan_json["processes"]}),
    }
    monitoring = plan_json["monitoring"]
    for name, req in plan_json["hosts"].items():
        out[name] = {
            "name": name, **req,
            "processes": [p for p in plan_json["processes"] if p["host"] == name],
            "target": plan_json["target"], "engine_name": plan_json["engine"],
            "model": plan_json["model"], "api": plan_json["api"],
            "checkpoint": plan_json["cache"], **deployment,
            # this host's metrics listener and what it serves (roles/serve, metrics.yml)
            "monitoring": {**monitoring, "targets": [
                t for t in monitoring["targets"] if t["host"] == name]},
        }
    return out
