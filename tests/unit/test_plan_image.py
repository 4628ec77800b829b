"""The image runtime in the plan: which runtime a host gets, the image it runs, and what
each container is given (GPUs, HCAs, mounts, the overlay), with the venv's argv inside."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.catalog import load
from gpufleet.plan import OVERLAY_DIR, PlanError, make_plan

REPO = Path(__file__).resolve().parents[2]
IMAGE = {"runtime": "image"}


def test_nvidia_hosts_default_to_venv_and_amd_hosts_to_their_rocm_image():
    assert {h.engine.runtime for h in make_plan("h200-pd-1node").hosts.values()} == {"venv"}
    amd = make_plan("sglang-mi355x-balanced").hosts["workers-1"].engine
    assert (amd.runtime, amd.image, amd.lock) == (
        "image", "docker.io/lmsysorg/sglang:v0.5.23-rocm720-mi35x", None)
    mi300 = make_plan("sglang-mi300x-balanced").hosts["workers-1"].engine
    assert mi300.image.endswith("-mi30x")


def test_image_runtime_runs_the_same_command_line_from_the_image():
    venv, image = make_plan("h200-pd-1node"), make_plan("h200-pd-1node", overrides=IMAGE)
    for v, i in zip(venv.processes, image.processes, strict=True):
        if v.role == "gateway":  # nginx from the distribution either way
            assert (i.argv, i.container) == (v.argv, None)
            continue
        assert i.argv[0] == v.argv[0].rsplit("/", 1)[1]  # vllm, vllm-router: on the PATH
        assert i.argv[1:] == v.argv[1:]
        assert i.container["image"] == "docker.io/vllm/vllm-openai:glm53-flash"
        assert i.container["name"] == i.unit.removesuffix(".service")
    host = image.to_json()["hosts"]["lab1" if "lab1" in image.hosts else next(iter(image.hosts))]
    assert host["engine"]["lock"] is None and host["engine"]["runtime"] == "image"


def test_engines_get_the_gpus_the_cache_read_only_and_002s_overlay():
    plan = make_plan("h200-pd-1node", overrides=IMAGE)
    cache = plan.cache["path"]
    for p in plan.engines:
        c = p.container
        assert c["devices"] == ["nvidia.com/gpu=all"]
        assert p.env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, p.gpus))
        assert {"source": cache, "target": cache, "read_only": True} in c["mounts"]
        assert p.env["HF_HUB_OFFLINE"] == "1"
        assert c["sitecustomize"] == "sitecustomize_no_cudnn.py"
        assert c["overlay_dir"] == OVERLAY_DIR == p.env["PYTHONPATH"]
        assert p.env["PYTHONPATH"] == OVERLAY_DIR
        assert (c["network"], c["ipc"], c["memlock"]) == ("host", "host", "unlimited")
    router = plan.by_role("router")[0]
    assert router.container["devices"] == [] and router.container["sitecustomize"] is None
    assert "HF_HUB_OFFLINE" not in router.env and "PYTHONPATH" not in router.env


def test_rdma_targets_expose_the_hcas_and_ipc_lock_to_the_engines_only():
    plan = make_plan("sglang-h200-pd", overrides=IMAGE)
    for p in plan.engines:
        assert "/dev/infiniband" in p.container["devices"] and p.container["rdma"]
        assert p.container["cap_add"] == ["IPC_LOCK"]
        assert p.container["sitecustomize"] is None  # the overlay is the vLLM image's
    router = plan.by_role("router")[0]
    assert router.container["cap_add"] == [] and not router.container["rdma"]
    one_node = make_plan("sglang-h200-balanced", overrides=IMAGE)
    assert all(not p.container["rdma"] for p in one_node.engines)


def test_amd_containers_get_kfd_and_the_render_nodes():
    (p,) = make_plan("sglang-mi355x-balanced").engines
    assert p.container["devices"] == ["/dev/kfd", "/dev/dri"]
    assert p.container["group_add"] == ["video"]
    assert p.container["security_opt"] == ["seccomp=unconfined"]
    assert p.env["HIP_VISIBLE_DEVICES"] == ",".join(map(str, p.gpus))


def test_dynamo_containers_share_the_discovery_directory():
    plan = make_plan("h200-agg", overrides=IMAGE)
    shared = {"source": "/var/lib/gpufleet/dynamo-discovery",
              "target": "/var/lib/gpufleet/dynamo-discovery", "read_only": False}
    assert all(shared in p.container["mounts"] for p in plan.processes if p.container)
    assert plan.by_role("router")[0].argv[:3] == ["python3", "-m", "dynamo.frontend"]


def test_an_operators_image_replaces_the_catalogs_and_a_digest_is_not_warned_about():
    ref = "registry.example:5000/vllm/vllm-openai@sha256:" + "a" * 64
    plan = make_plan("h200-pd-1node", overrides={**IMAGE, "images": {"vllm": ref}})
    assert {p.container["image"] for p in plan.processes if p.container} == {ref}
    assert not any("not a digest" in w for w in plan.warnings)
    tagged = make_plan("h200-pd-1node", overrides=IMAGE)
    (warning,) = [w for w in tagged.warnings if "not a digest" in w]
    assert "gpufleet_images: {vllm: docker.io/vllm/vllm-openai@sha256:...}" in warning


def test_an_image_for_an_engine_that_runs_none_is_refused():
    with pytest.raises(PlanError) as err:
        make_plan("h200-pd-1node", overrides={**IMAGE, "images": {"nginx": "x:1"}})
    (problem,) = err.value.problems
    assert problem.field == "overrides.images" and "nginx" in problem.message
    assert "dynamo, sglang, vllm" in problem.fix or "vllm" in problem.fix


def test_every_catalog_image_names_its_source_and_its_overlay_exists():
    for name, engine in load().engines.items():
        for key, image in engine.images.items():
            assert image.source.strip(), (name, key)
            assert ":" in image.ref.rsplit("/", 1)[-1] or "@" in image.ref, image.ref
            assert image.ref.split("/", 1)[0] in ("docker.io",), image.ref
            if image.sitecustomize:
                assert (REPO / "gpufleet/host" / image.sitecustomize).is_file()


@pytest.mark.parametrize("mirror, location, insecure", [
    ("https://mirror.example:5000/base/", "mirror.example:5000/base", False),
    ("http://10.0.0.5:5000", "10.0.0.5:5000", True),
])
def test_a_registry_mirror_reaches_podman_as_its_location(mirror, location, insecure):
    """The plan parses the mirror's URL once; the podman role writes what it says."""
    engine = make_plan("h200-pd-1node", None, {"runtime": "image", "registry_mirror": mirror}
                       ).hosts["workers-1"].engine
    assert (engine.registry_mirror, engine.registry_mirror_location,
            engine.registry_mirror_insecure) == (mirror, location, insecure)
