"""Filters for the image runtime: a process's `podman run` command line, the pinned
reference of an image, and the deploy-wide check that the hosts of one engine run one digest.

The plan says what each container gets (docs/plan.md, processes[*].container); these turn it
into podman's flags in one place, so the unit, the checks before start and the tests agree.
"""

from __future__ import annotations

import base64
import json

from gpufleet.model import image_repository

PODMAN = "/usr/bin/podman"


def pinned(ref: str, digest: str) -> str:
    """REPOSITORY@DIGEST: what a unit runs once the host pulled REF and got DIGEST."""
    if not digest.startswith("sha256:"):
        raise ValueError(f"not an image digest: {digest!r}")
    return f"{image_repository(ref)}@{digest}"


def podman_run_flags(container: dict, env_names=(), cgroups: str = "enabled",
                     ucx: bool = False, unit: bool = True, devices: bool = True) -> list[str]:
    """The flags every container of the plan gets, without image and command. `unit`:
    also what only a unit's container needs (its name, readiness through conmon, logs to
    the journal); off for the one-off containers that check the image before any unit
    changes. `devices`: the plan's devices and the capabilities that go with them (off for
    a check that needs neither, the dry parse).

    - host network and IPC (the engines' ports, NCCL's and NIXL's shared memory);
    - `--ulimit=host`: the unit's limits (LimitMEMLOCK=infinity where the plan moves data
      over RDMA or pins GPU memory) reach the container as they are;
    - `--env=NAME` only: podman takes the value from the unit's environment file, so no
      value (a token) is ever on a command line;
    - `--env=UCX_*` where the process reads the host's UCX settings (the ucx role's file,
      whose names the plan does not list);
    - `--cgroups=disabled` where the host's cgroups cannot be delegated (podman.json);
    - the plan's mounts; a check container (not `unit`) gets only the read-only ones: the
      writable ones are the units' state, which serve makes after the checks passed.
    """
    flags = ["--rm"]
    if unit:
        flags += ["--replace", f"--name={container['name']}", "--sdnotify=conmon"]
    flags += ["--init", "--pull=never"]
    if unit:
        flags.append("--log-driver=passthrough")
    flags += [f"--network={container['network']}", f"--ipc={container['ipc']}", "--ulimit=host"]
    if cgroups == "disabled":
        flags.append("--cgroups=disabled")
    if devices:
        flags += [f"--device={d}" for d in container.get("devices", [])]
        flags += [f"--cap-add={c}" for c in container.get("cap_add", [])]
    flags += [f"--group-add={g}" for g in container.get("group_add", [])]
    flags += [f"--security-opt={s}" for s in container.get("security_opt", [])]
    for m in container.get("mounts", []):
        if not unit and not m["read_only"]:
            continue  # a unit's own state (serve makes it); a check writes nothing there
        flags.append(f"--volume={m['source']}:{m['target']}:{'ro' if m['read_only'] else 'rw'}")
    flags += [f"--env={name}" for name in sorted(env_names)]
    if ucx:
        flags.append("--env=UCX_*")
    return flags


def podman_argv(proc: dict, image: str, cgroups: str = "enabled",
                ucx: bool = False) -> list[str]:
    """The unit's ExecStart for PROC (a plan process with a container): podman runs IMAGE
    (REPOSITORY@DIGEST) with the plan's argv, its first word as the entry point."""
    container = proc.get("container")
    if not container:
        raise ValueError(f"process {proc.get('name')} has no container in the plan")
    argv = list(proc["argv"])
    if not argv:
        raise ValueError(f"process {proc.get('name')} has an empty argv")
    return ([PODMAN, "run"] + podman_run_flags(container, proc.get("env", {}), cgroups, ucx)
            + [f"--entrypoint={argv[0]}", image] + argv[1:])


def image_digests(records: list[dict]) -> list[str]:
    """RECORDS: one per host, {host, engine, ref, digest}. The problems, one per engine whose
    hosts run different digests of its image, naming both sides and the fix."""
    by_engine: dict[str, dict[str, list[str]]] = {}
    refs: dict[str, str] = {}
    for r in records:
        by_engine.setdefault(r["engine"], {}).setdefault(r["digest"], []).append(r["host"])
        refs[r["engine"]] = r["ref"]
    problems = []
    for engine, digests in sorted(by_engine.items()):
        if len(digests) < 2:
            continue
        sides = "; ".join(f"{', '.join(sorted(hosts))} run {digest}"
                          for digest, hosts in sorted(digests.items()))
        problems.append(
            f"the hosts of {engine} pulled different images for {refs[engine]}: {sides} "
            f"(the tag moved between pulls, or the registries differ). Prefill, decode and every "
            f"worker of one engine must run one image. Fix: pin one digest "
            f"(gpufleet_images: {{{engine}: {image_repository(refs[engine])}@sha256:...}}) "
            f"and deploy again")
    return problems


def image_digests_of(hosts: list) -> list[str]:
    """HOSTS: the play's hostvars; each image host's record (engine_runtime's slurp of its
    image.json, __engine_runtime_pinned), compared as image_digests does."""
    records = []
    for hv in hosts:
        content = (hv.get("__engine_runtime_pinned") or {}).get("content")
        if not content:
            continue
        record = json.loads(base64.b64decode(content))
        records.append({"host": hv["inventory_hostname"], "ref": record["ref"],
                        "digest": record["digest"],
                        "engine": hv["gpufleet_host"]["engine"]["name"]})
    return image_digests(records)


class FilterModule:
    def filters(self):
        return {
            "gpufleet_podman_argv": podman_argv,
            "gpufleet_podman_run_flags": podman_run_flags,
            "gpufleet_image_pinned": pinned,
            "gpufleet_image_digests_of": image_digests_of,
        }
