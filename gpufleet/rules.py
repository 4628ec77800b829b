"""Validation rules over a rendered plan.

Each rule looks at what will really run (the rendered flags and environment of every
process), so a wrong combination is caught whether it came from the catalog, an
option or an operator override. A rule returns Problems naming the field, the value
and the fix. RULES is the list `make_plan` runs; tests remove rules one at a time to
prove each one is what catches its case.
"""

from __future__ import annotations

from collections.abc import Callable

from packaging.version import Version

from . import engine_flags
from .catalog import lockfile
from .model import DEFAULT_MEM_FRACTION, WEIGHT_SHARE, Plan, Problem, Process
from .overrides import engine_limits

# Flags and environment that must be identical on prefill and decode: the KV
# handshake (NIXL compatibility hash, Mooncake) refuses a pair that differs.
SPECULATIVE_FLAGS = (
    "--speculative-config", "--speculative-algorithm", "--speculative-num-steps",
    "--speculative-eagle-topk", "--speculative-num-draft-tokens",
    "--speculative-draft-model-path",
)
LAYOUT_ENV = ("VLLM_SSM_CONV_STATE_LAYOUT", "VLLM_KV_CACHE_LAYOUT")
# FlashInfer's companion packages: where a lock has one, it must be flashinfer-python's version
FLASHINFER_COMPANIONS = ("flashinfer-cubin", "flashinfer-jit-cache")
# Problem.field of the AMD refusal (a matrix cell's own reasons leave it out: see plan.not_offered)
RUNTIME_FIELD = "engine.runtime"
KV_FLAGS = ("--kv-cache-dtype", "--tensor-parallel-size", "--block-size")


def _engines(plan: Plan) -> list[Process]:
    return plan.engines


def _int(p: Process, *flags: str, default: int = 1) -> int:
    for flag in flags:
        if flag in p.args:
            return int(p.args[flag])
    return default


def _pd_pair(plan: Plan) -> tuple[Process, Process] | None:
    prefill, decode = plan.by_role("prefill"), plan.by_role("decode")
    return (prefill[0], decode[0]) if prefill and decode else None


def _spec(p: Process) -> dict:
    out = {}
    for flag in SPECULATIVE_FLAGS:
        if flag in p.args:
            value = p.args[flag]
            out[flag] = value
    return out


def speculative_matches(plan: Plan, catalog) -> list[Problem]:
    pair = _pd_pair(plan)
    if not pair or _spec(pair[0]) == _spec(pair[1]):
        return []
    return [Problem(
        "args.speculative",
        f"prefill and decode use different speculative decoding settings "
        f"(prefill {_spec(pair[0]) or 'none'}, decode {_spec(pair[1]) or 'none'}); "
        "the KV handshake refuses the pair and 000 says num_speculative_tokens must match",
        "set the same speculative settings on both roles (override `engines`, not one role)")]


def layouts_match(plan: Plan, catalog) -> list[Problem]:
    pair = _pd_pair(plan)
    if not pair:
        return []
    problems = []
    for var in LAYOUT_ENV:
        a, b = pair[0].env.get(var), pair[1].env.get(var)
        if a != b:
            problems.append(Problem(
                f"env.{var}", f"prefill has {a!r}, decode has {b!r}; the KV layouts must be "
                "pinned identically on both pools (NIXL compatibility hash)",
                f"set {var} to the same value on prefill and decode"))
    for flag in KV_FLAGS:
        a, b = pair[0].args.get(flag), pair[1].args.get(flag)
        if a != b:
            problems.append(Problem(
                f"args.{flag}", f"prefill has {a!r}, decode has {b!r}; the KV cache layout "
                "must match for the transfer", f"set {flag} the same on prefill and decode"))
    return problems


def fp8_kv_on_hopper(plan: Plan, catalog) -> list[Problem]:
    if plan.model.family != "glm-5.3-flash" or plan.hardware.arch != "hopper":
        return []
    bad = [p for p in _engines(plan) if str(p.args.get("--kv-cache-dtype", "")).startswith("fp8")]
    if not bad:
        return []
    return [Problem(
        "args.--kv-cache-dtype",
        f"{bad[0].args['--kv-cache-dtype']} on {plan.hardware.product} ({bad[0].role}): Hopper "
        "does not support FP8 KV cache for GLM-5.3-Flash and must run BF16 KV (000)",
        "drop --kv-cache-dtype (BF16 KV) or use Blackwell GPUs, e.g. target b200-pd-1node")]


def weights_fit(plan: Plan, catalog) -> list[Problem]:
    weight = plan.cache["weight_gib"]
    gib_per_gpu = plan.hardware.memory_mib / 1024
    problems = []
    seen = set()
    for p in _engines(plan):
        if p.role in seen:
            continue
        seen.add(p.role)
        # the nodes of one engine (its ranks): a pool's workers and replicas are each one
        # engine of their own, and must each hold the weights
        nodes = len({q.node_rank for q in plan.processes if q.role == p.role})
        gpus = len(p.gpus) * nodes
        try:
            fraction = float(p.args.get("--gpu-memory-utilization")
                             or p.args.get("--mem-fraction-static")
                             or DEFAULT_MEM_FRACTION[plan.speaks])
        except (TypeError, ValueError):
            continue  # not a number: engine_limits says so
        usable = gpus * gib_per_gpu * fraction
        if weight <= usable * WEIGHT_SHARE:
            continue
        problems.append(Problem(
            f"{p.role}.memory",
            f"{plan.model.repo} needs {weight:.0f} GiB of weights but the {p.role} engine has "
            f"{gpus} x {gib_per_gpu:.1f} GiB x {fraction:.2f} = {usable:.0f} GiB on {nodes} "
            f"{plan.hardware.product} node{'s' if nodes > 1 else ''}, of which at most "
            f"{WEIGHT_SHARE:.0%} ({usable * WEIGHT_SHARE:.0f} GiB) may hold weights "
            "(the rest is KV cache and activations)",
            "use the FP8 checkpoint, a multi-node layout (more nodes), or GPUs with more "
            "memory (b300, mi325x, mi355x)"))
    return problems


def nvfp4_needs_blackwell(plan: Plan, catalog) -> list[Problem]:
    if plan.model.precision != "nvfp4" or plan.hardware.arch == "blackwell":
        return []
    return [Problem(
        "model", f"{plan.model.repo} is NVFP4, which runs only on Blackwell, not on "
        f"{plan.hardware.product}", "use the FP8 checkpoint or B200/B300/GB300 nodes")]


def parallel_matches_gpus(plan: Plan, catalog) -> list[Problem]:
    problems = []
    for p in _engines(plan):
        try:
            nodes = _int(p, "--nnodes")
            tp = _int(p, "--tensor-parallel-size", "-tp", "--tp-size")
            pp = _int(p, "--pipeline-parallel-size", "-pp", "--pp-size")
            dp = _int(p, "--data-parallel-size", "-dp", "--dp-size")
        except (TypeError, ValueError):
            continue  # not an integer: engine_limits says so
        if plan.target.engine == "sglang" and "--enable-dp-attention" in p.args:
            dp = 1  # DP attention splits the TP group; it adds no GPUs
        need = tp * pp * dp
        have = len(p.gpus) * nodes
        if need != have:
            problems.append(Problem(
                f"{p.name}.parallelism",
                f"TP {tp} x PP {pp} x DP {dp} = {need} GPUs but {p.name} on {p.host} is given "
                f"{have} ({len(p.gpus)} GPU(s) x {nodes} node(s))",
                "make tensor x pipeline x data parallel sizes equal the GPUs of the role"))
    return problems


def context_parallel_fits(plan: Plan, catalog) -> list[Problem]:
    """SGLang's attention context parallelism splits each TP group into --attn-cp-size
    ranks: the size must divide the TP size (004's 8 is for 8-GPU TP groups)."""
    problems = []
    for p in _engines(plan):
        try:
            cp = _int(p, "--attn-cp-size")
            tp = _int(p, "--tensor-parallel-size", "-tp", "--tp-size")
        except (TypeError, ValueError):
            continue  # not an integer: engine_limits says so
        if cp > 1 and (cp > tp or tp % cp):
            fits = [d for d in range(2, tp + 1) if tp % d == 0]
            problems.append(Problem(
                f"{p.name}.--attn-cp-size",
                f"--attn-cp-size {cp} does not divide --tp-size {tp} on {p.name} "
                f"({plan.hardware.product}: context parallelism splits the TP group)",
                f"add --set {p.role}:--attn-cp-size={fits[-1] if fits else 1} (a divisor of "
                f"{tp}), or drop the option"))
    return problems


def gpus_disjoint(plan: Plan, catalog) -> list[Problem]:
    problems = []
    limit = plan.hardware.gpus_per_node
    by_host: dict[str, dict[int, str]] = {}
    for p in plan.processes:
        owners = by_host.setdefault(p.host, {})
        for g in p.gpus:
            if g >= limit:
                problems.append(Problem(
                    f"{p.name}.gpus", f"GPU {g} does not exist on a {plan.hardware.product} "
                    f"node ({limit} GPUs)", f"use GPU indices 0-{limit - 1}"))
            elif g in owners:
                problems.append(Problem(
                    f"{p.name}.gpus", f"GPU {g} on {p.host} is already used by {owners[g]}",
                    "give prefill and decode separate GPUs (e.g. 0-3 and 4-7)"))
            else:
                owners[g] = p.name
    return problems


def _shares_socket(a: Process, b: Process, name: str) -> bool:
    """Whether the gateway a and b's port NAME would take one socket: b's HTTP port
    listens at b's bind (the plan's --host), which may sit beside the gateway on another
    address of the host; any other port may listen anywhere."""
    return name != "http" or b.bind in ("0.0.0.0", a.bind)


def ports_unique(plan: Plan, catalog) -> list[Problem]:
    """No two listeners on one port of a host: the engines', routers' and etcd's ports
    apart, and the gateway's client port on an address the process behind it leaves
    free (that one on loopback, or on another address)."""
    problems = []
    by_host: dict[str, dict[int, tuple[Process, str]]] = {}
    for p in (p for p in plan.processes if p.role not in ("gateway", "metrics")):
        used = by_host.setdefault(p.host, {})
        for name, port in p.ports.items():
            if port in used:
                problems.append(Problem(
                    f"{p.name}.ports.{name}", f"port {port} on {p.host} is also used by "
                    f"{used[port][0].name} ({used[port][1]})",
                    f"set ports.{p.role}.{name} to a free port"))
            else:
                used[port] = (p, name)
    for g in plan.by_role("gateway"):
        port = g.ports["http"]
        other, name = by_host.get(g.host, {}).get(port, (None, ""))
        if other is not None and _shares_socket(g, other, name):
            problems.append(Problem(
                f"{other.name}.ports.{name}",
                f"the API gateway holds port {port} on {g.bind} ({g.host}) and "
                f"{other.name} would listen on {other.bind}:{port} too",
                f"set ports.{other.role}.{name} to another port; the gateway keeps "
                f"{port} for clients"))
    return problems


def metrics_port_free(plan: Plan, catalog) -> list[Problem]:
    """The metrics listener's port is no other process's on its host (it listens on the
    host's address and on loopback)."""
    return [Problem("gpufleet_metrics_port",
                    f"{m.ports['http']} is the {p.name}'s port on {m.host}",
                    "choose another port for the metrics listener (gpufleet_metrics_port)")
            for m in plan.by_role("metrics") for p in plan.on_host(m.host)
            if p is not m and m.ports["http"] in p.ports.values()]


LOOPBACK = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::")


def gateway_has_an_address(plan: Plan, catalog) -> list[Problem]:
    """The gateway listens on the front host's address and the router behind it on
    127.0.0.1 at the same port: the host needs an address that is not loopback."""
    return [Problem(
        f"inventory.{g.host}.ansible_host",
        f"the API gateway would listen on {g.bind}:{g.ports['http']}, where the process "
        "behind it listens too",
        f"give {g.host} its internal address (gpufleet_internal_address or ansible_host), "
        "or turn the key off with gpufleet_api_key: false")
        for g in plan.by_role("gateway") if g.bind in LOOPBACK]


def no_speculative_on_amd(plan: Plan, catalog) -> list[Problem]:
    if plan.hardware.vendor != "amd":
        return []
    for p in _engines(plan):
        flags = [f for f in SPECULATIVE_FLAGS if f in p.args]
        if flags:
            return [Problem(
                f"{p.role}.{flags[0]}", f"speculative decoding on {plan.hardware.product}: the "
                "gfx950 draft kernel is not validated (004)",
                "remove the --speculative-* flags; serve without MTP on AMD")]
    return []


def dflash2_constraints(plan: Plan, catalog) -> list[Problem]:
    problems = []
    for p in _engines(plan):
        if p.args.get("--speculative-algorithm") != "DFLASH":
            continue
        if plan.hardware.vendor != "nvidia":
            problems.append(Problem(
                "with.dflash2", f"DFlash2 runs on CUDA only, not on {plan.hardware.product}",
                "drop --with dflash2 on AMD"))
        if "--enable-dp-attention" in p.args:
            problems.append(Problem(
                "with.dflash2", f"DFlash2 rejects DP attention, which {plan.target.name} "
                "enables", "use a low-latency target with --with dflash2"))
        break
    return problems


def no_zigzag(plan: Plan, catalog) -> list[Problem]:
    for p in _engines(plan):
        if p.args.get("--cp-strategy") == "zigzag":
            return [Problem(
                f"{p.role}.--cp-strategy", "zigzag prefill context parallelism is temporarily "
                "unavailable for GLM-5.3 (004)", "use --cp-strategy interleave (--with cp)")]
    return []


def layer_split_needs_pd_mooncake(plan: Plan, catalog) -> list[Problem]:
    prefill = plan.by_role("prefill")
    backend = prefill[0].args.get("--disaggregation-transfer-backend") if prefill else None
    misplaced = [p.name for p in _engines(plan)
                 if "--enable-dsa-cache-layer-split" in p.args and p.role != "prefill"]
    wanted = "layer-split" in plan.options or misplaced or any(
        "--enable-dsa-cache-layer-split" in p.args for p in prefill)
    if not wanted or (prefill and backend == "mooncake" and not misplaced):
        return []
    where = (f"{plan.target.name} has no prefill role" if not prefill
             else f"its transfer backend is {backend}" if backend != "mooncake"
             else f"it is set on {', '.join(misplaced)}")
    return [Problem(
        "with.layer-split", f"LayerSplit needs a PD prefill worker on Mooncake (004); {where}",
        "use an sglang-<hw>-pd target with --disaggregation-transfer-backend mooncake")]


def fp8_kv_option_on_hopper_only(plan: Plan, catalog) -> list[Problem]:
    if "fp8-kv" in plan.options and plan.hardware.arch != "hopper":
        return [Problem(
            "with.fp8-kv", f"{plan.hardware.product} already runs FP8 KV for DSA models (004: "
            "auto-selected on Blackwell); the fp8-kv kernels are the Hopper path",
            "drop --with fp8-kv")]
    return []


def venv_runtime_needs_nvidia(plan: Plan, catalog) -> list[Problem]:
    """The engine is installed into a virtual environment from the package index, whose
    vLLM and SGLang wheels are CUDA builds: on an AMD host they would not run."""
    if plan.hardware.vendor in catalog.locks.vendors or all(
            req.engine.runtime == "image" for req in plan.hosts.values()):
        return []
    engine = plan.engine
    what = engine.requirements[0].req.replace("==", " ") if engine.requirements else engine.label
    hosts = sorted(h for h, req in plan.hosts.items() if req.gpu is not None)
    return [Problem(
        RUNTIME_FIELD,
        f"no ROCm build of {what} is on the package index ({catalog.locks.index}); the venv "
        f"runtime would install CUDA wheels on an AMD host ({plan.hardware.product}: "
        f"{', '.join(hosts)})",
        "run it from the recipe's ROCm container image, the image runtime (gpufleet_runtime: "
        "image, the default on AMD hosts, or --runtime image)")]


def flashinfer_at_floor(plan: Plan, catalog) -> list[Problem]:
    """FlashInfer as each host's lock installs it: flashinfer-python at or above the
    engine's floor, and the companions the lock has at exactly its version."""
    floor = plan.engine.flashinfer_floor
    problems: list[Problem] = []
    seen = set()
    for name, req in sorted(plan.hosts.items()):
        path = req.engine.lock
        if not floor or not path or path in seen:
            continue
        seen.add(path)
        pins = lockfile.read(lockfile.REPO / path).pins
        where = f"engines.{plan.target.engine}.requirements in gpufleet/catalog/engines.yml"
        have = pins.get("flashinfer-python", (None,))[0]
        if have is None or Version(have) < Version(floor):
            problems.append(Problem(
                f"hosts.{name}.engine.lock",
                f"{path} installs flashinfer-python {have or '(none)'}, below the floor {floor} "
                f"(engines.{plan.target.engine}.flashinfer_floor: {plan.model.repo}'s NoPE sparse "
                "MLA needs it)",
                f"require an engine release that brings flashinfer-python >= {floor} (or add "
                f"flashinfer-python>={floor}) in {where}, then run scripts/lock"))
            continue
        for companion in FLASHINFER_COMPANIONS:
            version = pins.get(companion, (have,))[0]
            if version != have:
                problems.append(Problem(
                    f"hosts.{name}.engine.lock",
                    f"{path} installs {companion} {version} next to flashinfer-python {have}; "
                    "they must be the same version (mixed, serving crashed with an illegal "
                    "memory access)",
                    f"require {companion}=={have} in {where}, or drop it, then run scripts/lock"))
    return problems


def flags_accepted(plan: Plan, catalog) -> list[Problem]:
    problems = []
    for p in plan.processes:
        # the engine's release for its programs (engine_flags.RELEASES); other programs
        # have one release
        for issue in engine_flags.check(p.argv, plan.engine.version):
            problems.append(Problem(
                f"{p.name}.argv", issue,
                "remove or correct the flag (tables: gpufleet/catalog/engine-cli/)"))
    return problems


RULES: list[Callable[[Plan, object], list[Problem]]] = [
    speculative_matches,
    layouts_match,
    fp8_kv_on_hopper,
    weights_fit,
    nvfp4_needs_blackwell,
    parallel_matches_gpus,
    context_parallel_fits,
    gpus_disjoint,
    ports_unique,
    gateway_has_an_address,
    metrics_port_free,
    no_speculative_on_amd,
    dflash2_constraints,
    no_zigzag,
    layer_split_needs_pd_mooncake,
    fp8_kv_option_on_hopper_only,
    flags_accepted,
    engine_limits,
    venv_runtime_needs_nvidia,
    flashinfer_at_floor,
]


def check(plan: Plan, catalog) -> list[Problem]:
    return [problem for rule in RULES for problem in rule(plan, catalog)]


def warnings(plan: Plan) -> list[str]:
    out = []
    if _pd_pair(plan):
        out.append("n > 1 (several choices per request) is not supported by disaggregated "
                   "targets (002); clients must send n=1")
    if plan.target.engine == "sglang" and plan.by_role("router"):
        out.append("sglang-router 0.3.2 does not route Anthropic /v1/messages (004's Claude "
                   "Code setup): use an aggregated sglang-* target without gpufleet_workers "
                   "for that, or call an engine")
    if plan.model.experimental:
        out.append(f"{plan.model.repo} is experimental (004): accuracy and throughput data "
                   "are still pending")
    if plan.api.get("key_required") and not plan.api.get("tls"):
        out.append("the gateway serves plain HTTP (gpufleet_tls: false): the API key and "
                   "every prompt cross the network in clear text")
    return out
