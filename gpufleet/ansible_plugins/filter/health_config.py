"""gpufleet_health_config: the health checker's config (roles/health/README.md) for one
host of the plan, from the plan and the health role's settings."""

from __future__ import annotations

# The syslog tag the API gateway's nginx logs each request under (its access_log in
# roles/serve/templates/gateway-nginx.conf.j2): the checker counts its responses by status
# code from the journal entries with this SYSLOG_IDENTIFIER
GATEWAY_LOG_TAG = "gpufleet_gateway"


def _bool(name: str, value: object) -> bool:
    """A yes/no setting, as Ansible's bool filter reads it; anything else is refused."""
    text = str(value).lower()
    if text in ("yes", "on", "true", "1"):
        return True
    if text in ("no", "off", "false", "0"):
        return False
    raise ValueError(f"health_{name} must be true or false, not {value!r}")


def health_config(slice_: dict, options: dict, fabric_external: bool = False) -> dict:
    """The config for one host from its slice of the plan (gpufleet_host), whose processes
    carry their checks (`health`: URLs, start-up window, dependencies), and the health
    role's settings (`options`: its health_* variables without the prefix, as the lookup
    gpufleet_role_options reads them from its argument spec). `fabric_external`: the host's
    NVLink fabric is managed elsewhere (the fabric manager is not this host's service)."""
    if not isinstance(slice_, dict) or "processes" not in slice_ or "name" not in slice_:
        raise ValueError("gpufleet_health_config takes a host's slice of the plan "
                         "(gpufleet_host, set by playbooks/plan.yml). Fix: pass gpufleet_host")

    class Options(dict):
        def __missing__(self, name):
            raise ValueError(f"gpufleet_health_config: no health_{name} among the settings; "
                             "pass lookup('gpufleet.fleet.gpufleet_role_options', "
                             "prefix='health_')")

    opt = Options(options or {})
    restart_enabled = _bool("restart_enabled", opt["restart_enabled"])
    fabric_external = _bool("fabric_external", fabric_external)
    facts, host = slice_, slice_["name"]
    processes = slice_["processes"]
    # the host services this host's plan needs; the fabric manager only where the host
    # owns its NVSwitches (else the GPUs' fabric state is checked instead)
    host_units = [service for need, service in opt["host_services"].items()
                  if facts.get(need) and not (need == "fabric_manager" and fabric_external)]

    units = []
    for p in processes:
        check, grace = p["health"], opt["startup_grace_s"]
        units.append({
            "unit": p["unit"],
            "name": p["name"],
            "role": p["role"],
            "health_url": check["url"],
            "generate_url": check["generate_url"],
            "served_name": check["served_name"],
            "ca_file": check.get("ca_file"),
            "api_key_file": (opt["api_key_file"] or None) if check["generate_url"] else None,
            "health_timeout_s": int(opt["http_timeout_s"]),
            "generate_timeout_s": int(opt["generate_timeout_s"]),
            "startup_grace_s": int(grace if grace is not None else check["grace_s"]),
            "restart": restart_enabled and (opt["restart_roles"] is None
                                            or p["role"] in opt["restart_roles"]),
            "depends_on": check["depends_on"] + (host_units if check["host_services"] else []),
            "drain": check["drain"],
        })
    for service in host_units:
        units.append({
            "unit": service,
            "name": service.replace(".service", ""),
            "role": "host",
            "restart": False,
            "depends_on": [],
            "drain": False,
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
                  if cache and any(p["is_engine"] for p in processes) else None),
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
        # the API gateway's access log, on the hosts that run the gateway
        "gateway": ({"log_tag": GATEWAY_LOG_TAG}
                    if any(p["role"] == "gateway" for p in processes) else None),
        "watch": {"interval_s": float(opt["watch_interval_s"])},
        "drain": {"enabled": _bool("drain", opt["drain"]),
                  "after_runs": int(opt["drain_after_runs"]),
                  "return_after_runs": int(opt["drain_return_after_runs"]),
                  "cooldown_s": float(opt["drain_cooldown_s"])},
    }


class FilterModule:
    def filters(self):
        return {"gpufleet_health_config": health_config}
