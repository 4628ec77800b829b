"""The image runtime's podman command line (filter gpufleet_podman_argv) for real plans, and
the check that every host of one engine runs one image digest."""

from __future__ import annotations

import pytest

from gpufleet.ansible_plugins.filter.container import (
    image_digests,
    pinned,
    podman_argv,
    podman_run_flags,
)
from gpufleet.model import image_repository
from gpufleet.plan import make_plan

DIGEST = "sha256:" + "ab" * 32


def _procs(target, **overrides):
    plan = make_plan(target, overrides={"runtime": "image", **overrides}).to_json()
    return [p for p in plan["processes"] if p["container"]]


@pytest.mark.parametrize("ref, repo", [
    ("docker.io/vllm/vllm-openai:glm53-flash", "docker.io/vllm/vllm-openai"),
    ("localhost:5000/sglang:v1@sha256:" + "0" * 64, "localhost:5000/sglang"),
    ("localhost:5000/sglang", "localhost:5000/sglang"),
    ("lmsysorg/sglang", "lmsysorg/sglang"),
])
def test_repository_drops_tag_and_digest_but_keeps_a_port(ref, repo):
    assert image_repository(ref) == repo


def test_pinned_refuses_what_is_not_a_digest():
    assert pinned("docker.io/x/y:tag", DIGEST) == f"docker.io/x/y@{DIGEST}"
    with pytest.raises(ValueError, match="not an image digest"):
        pinned("docker.io/x/y:tag", "latest")


def test_the_plans_argv_runs_inside_the_pinned_image_with_no_value_on_the_command_line():
    for proc in _procs("h200-pd-1node"):
        image = pinned(proc["container"]["image"], DIGEST)
        argv = podman_argv(proc, image)
        at = argv.index(image)
        assert argv[:2] == ["/usr/bin/podman", "run"]
        assert argv[at - 1] == f"--entrypoint={proc['argv'][0]}"
        assert argv[at + 1:] == proc["argv"][1:]
        flags = argv[2:at - 1]
        assert f"--name={proc['unit'].removesuffix('.service')}" in flags
        for flag in ("--network=host", "--ipc=host", "--sdnotify=conmon", "--pull=never",
                     "--ulimit=host", "--rm", "--replace"):
            assert flag in flags, flag
        assert "--cgroups=disabled" not in flags
        envs = [f for f in flags if f.startswith("--env")]
        assert envs == [f"--env={k}" for k in sorted(proc["env"])]  # names only
        for value in proc["env"].values():
            assert not any(str(value) in f for f in envs if value)
        cache = [f for f in flags if f.startswith("--volume=/var/cache") or ":ro" in f]
        assert cache, flags
        if proc["gpus"]:
            assert "--device=nvidia.com/gpu=all" in flags


def test_rdma_engines_get_the_hcas_and_ipc_lock_others_do_not():
    procs = _procs("sglang-h200-pd")
    engines = [p for p in procs if p["container"]["rdma"]]
    assert engines, "SGLang PD moves KV over RDMA (Mooncake)"
    for proc in procs:
        flags = podman_argv(proc, pinned(proc["container"]["image"], DIGEST), cgroups="disabled")
        assert "--cgroups=disabled" in flags
        has = {"--device=/dev/infiniband", "--cap-add=IPC_LOCK"} <= set(flags)
        assert has == proc["container"]["rdma"], proc["name"]


def test_amd_containers_get_kfd_and_render_nodes_not_cdi():
    for proc in _procs("sglang-mi355x-balanced"):
        flags = podman_argv(proc, pinned(proc["container"]["image"], DIGEST))
        if proc["gpus"]:
            assert {"--device=/dev/kfd", "--device=/dev/dri", "--group-add=video"} <= set(flags)
            assert not any("nvidia.com/gpu" in f for f in flags)


def test_a_process_without_container_or_argv_is_an_error():
    with pytest.raises(ValueError, match="no container"):
        podman_argv({"name": "gateway", "argv": ["nginx"], "container": None}, "x@" + DIGEST)
    proc = _procs("h200-pd-1node")[0] | {"argv": []}
    with pytest.raises(ValueError, match="empty argv"):
        podman_argv(proc, "x@" + DIGEST)


def test_hosts_of_one_engine_must_run_one_digest():
    ref = "docker.io/vllm/vllm-openai:glm53-flash"
    other = "sha256:" + "cd" * 32
    same = [{"host": h, "engine": "vllm", "ref": ref, "digest": DIGEST} for h in ("a", "b")]
    assert image_digests(same) == []
    problems = image_digests(same + [{"host": "c", "engine": "vllm", "ref": ref, "digest": other}])
    assert len(problems) == 1
    assert f"a, b run {DIGEST}" in problems[0] and f"c run {other}" in problems[0]
    assert "docker.io/vllm/vllm-openai@sha256:..." in problems[0]
    # two engines, each on one digest of its own image, is fine
    assert image_digests([same[0], {"host": "d", "engine": "sglang", "ref": "x:y",
                                    "digest": other}]) == []


def test_digests_are_read_from_each_hosts_record():
    import base64
    import json

    from gpufleet.ansible_plugins.filter.container import image_digests_of

    def host(name, digest, record=True):
        content = base64.b64encode(json.dumps(
            {"ref": "r:t", "digest": digest, "run": "r@" + digest}).encode()).decode()
        return {"inventory_hostname": name, "gpufleet_host": {"engine": {"name": "sglang"}},
                "__engine_runtime_pinned": {"content": content} if record else {"skipped": True}}
    other = "sha256:" + "cd" * 32
    assert image_digests_of([host("a", DIGEST), host("b", DIGEST), host("c", other, False)]) == []
    problems = image_digests_of([host("prefill-host", DIGEST), host("decode-host", other)])
    assert "prefill-host run " + DIGEST in problems[0] and "decode-host run " + other in problems[0]


def test_check_containers_get_what_the_engines_get_but_no_unit_flags():
    for proc in _procs("sglang-h200-pd"):
        unit = podman_run_flags(proc["container"], proc["env"], "disabled")
        check = podman_run_flags(proc["container"], (), "disabled", unit=False)
        only_unit = {"--replace", f"--name={proc['container']['name']}", "--sdnotify=conmon",
                     "--log-driver=passthrough"}
        assert only_unit <= set(unit) and not only_unit & set(check)
        # the units' writable state (the shared compile cache) is not the checks'
        writable = [f for f in unit if f.endswith(":rw")]
        engine = proc["role"] in ("prefill", "decode", "worker")
        assert len(writable) == engine and all("/compile/sglang-" in f for f in writable)
        assert [f for f in unit if f not in only_unit and not f.startswith("--env")
                and f not in writable] == check
        parse = podman_run_flags(proc["container"], (), "disabled", unit=False, devices=False)
        assert [f for f in check if not f.startswith(("--device", "--cap-add"))] == parse


def test_check_containers_leave_out_the_units_writable_state():
    """Dynamo's file discovery is a writable mount serve makes; the checks before it (in
    engine_runtime) run without it, and with every read-only mount (the cache)."""
    for proc in _procs("h200-disagg"):
        if not proc["container"]:
            continue
        mounts = proc["container"]["mounts"]
        assert any(not m["read_only"] for m in mounts), mounts
        unit = podman_run_flags(proc["container"], proc["env"], "enabled")
        check = podman_run_flags(proc["container"], (), "enabled", unit=False)
        for m in mounts:
            flag = f"--volume={m['source']}:{m['target']}:{'ro' if m['read_only'] else 'rw'}"
            assert flag in unit
            assert (flag in check) == m["read_only"], (flag, check)
