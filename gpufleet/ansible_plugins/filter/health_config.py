"""gpufleet_health_config: the health checker's config (roles/health/README.md) for one
host of the plan, from the plan and the health role's settings."""

from __future__ import annotations

ENGINE_ROLES = ("prefill", "decode", "worker")

# the health role's variables, without their health_ prefix
OPTIONS = (
    "textfile", "state_file",
    "restart_enabled", "restart_after_failures", "restart_cooldown_s", "restart_roles",
    "host_services", "host_service_fix",
    "http_timeout_s", "generate_timeout_s", "startup_grace_s",
    "router_generate_path", "api_key_file", "cache_min_free_gib",
    "gpu_timeout_s", "xid_fatal", "ecc_aggregate_max", "nvlink_error_delta_max",
    "gpu_temperature_max_c",
    "fabric_external", "ib_sysfs", "ib_min_rate_gbps", "ib_error_delta_max",
    "watch_interval_s", "drain", "drain_after_runs", "drain_return_after_runs",
    "drain_cooldown_s",
)


def _bool(name: str, value: object) -> bool:
    """A yes/no setting, as Ansible's bool filter reads it; anything else is refused."""
    text = str(value).lower()
    if text in ("yes", "on", "true", "1"):
        return True
    if text in ("no", "off", "false", "0"):
        return False
    raise ValueError(f"health_{name} must be true or false, not {value!r}")


def health_config(slice_: dict, **options) -> dict:
    """The config for one host from its slice of the plan (gpufleet_host): its units with
    their checks and restart policy, its host services, cache and GPUs. OPTIONS are the
    health role's settings (OPTIONS names)."""
    missing = [n for n in OPTIONS if n not in options]
    unknown = sorted(set(options) - set(OPTIONS))
    if missing or unknown:
        raise ValueError(f"gpufleet_health_config: missing options {missing}, unknown {unknown}; "
                         f"it takes exactly {', '.join(OPTIONS)}")
    opt = options
    restart_enabled = _bool("restart_enabled", opt["restart_enabled"])
    fabric_external = _bool("fabric_external", opt["fabric_external"])
    if not isinstance(slice_, dict) or "processes" not in slice_ or "name" not in slice_:
        raise ValueError("gpufleet_health_config takes a host's slice of the plan "
                         "(gpufleet_host, set by playbooks/plan.yml). Fix: pass gpufleet_host")
    facts, host = slice_, slice_["name"]
    processes = slice_["processes"]

    def units_of(*roles):
        return [p["unit"] for p in processes if p["role"] in roles]

    engine_units, etcd_units, router_units = (
        units_of(*ENGINE_ROLES), units_of("etcd"), units_of("router"))
    # the host services this host's plan needs; the fabric manager only where the host
    # owns its NVSwitches (else the GPUs' fabric state is checked instead)
    host_units = [service for need, service in opt["host_services"].items()
                  if facts.get(need) and not (need == "fabric_manager" and fabric_external)]

    units = []
    for p in processes:
        ready = p.get("readiness") or {}
        generate = ready.get("generate_url")
        if generate is None and p["role"] == "router" and "url" in ready:
            base = ready["url"]
            base = base[: -len("/health")] if base.endswith("/health") else base
            generate = base + opt["router_generate_path"]
        if p["role"] == "router":
            depends_on = engine_units + etcd_units
        elif p["role"] in ENGINE_ROLES:
            depends_on = etcd_units + host_units
        elif p["role"] == "gateway":
            depends_on = router_units or engine_units
        else:
            depends_on = []
        grace = opt["startup_grace_s"]
        units.append({
            "unit": p["unit"],
            "name": p["name"],
            "role": p["role"],
            "health_url": ready.get("url"),
            "generate_url": generate,
            "served_name": (ready.get("served_name", slice_["model"]["served_name"])
                            if generate else None),
            "api_key_file": (opt["api_key_file"] or None) if generate else None,
            "health_timeout_s": int(opt["http_timeout_s"]),
            "generate_timeout_s": int(opt["generate_timeout_s"]),
            "startup_grace_s": int(grace if grace is not None else ready.get("timeout_s", 600)),
            "restart": restart_enabled and p["role"] in opt["restart_roles"],
            "depends_on": list(depends_on),
        })
    for service in host_units:
        units.append({
            "unit": service,
            "name": service.replace(".service", ""),
            "role": "host",
            "restart": False,
            "depends_on": [],
            "fix": opt["host_service_fix"] % service,
        })

    gpu = facts.get("gpu") or {}
    uses_gpus = bool(gpu.get("used"))
    cache = facts.get("cache")
    return {
        "version": 1,
        "host": host,
        "textfile": opt["textfile"],
        "state_file": opt["state_file"],
        "restart": {
            "enabled": restart_enabled,
            "after_failures": int(opt["restart_after_failures"]),
            "cooldown_s": int(opt["restart_cooldown_s"]),
        },
        "units": units,
        "cache": ({"path": cache["path"], "min_free_gib": float(opt["cache_min_free_gib"])}
                  if engine_units and cache else None),
        "gpu": {
            "vendor": gpu.get("vendor") if uses_gpus else None,
            "count": gpu.get("count") if uses_gpus else None,
            "timeout_s": int(opt["gpu_timeout_s"]),
            "xid_fatal": [int(x) for x in opt["xid_fatal"]],
            "ecc_aggregate_max": int(opt["ecc_aggregate_max"]),
            "temperature_max_c": float(opt["gpu_temperature_max_c"]),
            "nvlink_error_delta_max": {k: int(v) for k, v in
                                       opt["nvlink_error_delta_max"].items()},
            "fabric": fabric_external,
        },
        # the HCA ports of a host whose plan moves data over RDMA (the KV path of PD)
        "ib": {
            "sysfs": opt["ib_sysfs"],
            "devices": [],
            "min_rate_gbps": (float(opt["ib_min_rate_gbps"])
                              if opt["ib_min_rate_gbps"] not in (None, "") else None),
            "error_delta_max": {k: int(v) for k, v in opt["ib_error_delta_max"].items()},
        } if facts.get("rdma") else None,
        "watch": {"interval_s": float(opt["watch_interval_s"])},
        "drain": {"enabled": _bool("drain", opt["drain"]),
                  "after_runs": int(opt["drain_after_runs"]),
                  "return_after_runs": int(opt["drain_return_after_runs"]),
                  "cooldown_s": float(opt["drain_cooldown_s"])},
    }


class FilterModule:
    def filters(self):
        return {"gpufleet_health_config": health_config}
