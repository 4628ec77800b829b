"""The image runtime on the lab: the engines run from the catalog's images (stand-in images
under the seeds' names, in the controller's registry, the hosts' mirror) by podman under
systemd, GPUs by CDI.

First one deployment of h200-pd-1node (vLLM, lab1) shared by its tests: the smoke test
passes, a re-run changes nothing and restarts nothing, each fault is refused with its fix
before any unit changes, a new digest restarts exactly the units that run it, rolling
restart, a killed engine and health work as for venv units, and teardown removes the
containers and keeps the image. Then SGLang prefill/decode over RDMA on lab1 and lab2
(HCAs and IPC_LOCK in the containers; hosts with different digests refused), Dynamo's
h200-disagg (refused on a host that cannot lock memory, then served; teardown purging the
image), and an MI355X host running SGLang's ROCm image by default.
"""

from __future__ import annotations

import json
import time

import labutil
import pytest
from labutil import changed_tasks, fab, playbook, recap, ssh

from gpufleet_lab import hosts as lab_hosts
from gpufleet_lab import images as lab_images

# last of the lab modules (conftest's ORDER): it ends on an MI355X lab
pytestmark = pytest.mark.lab

TARGET = "h200-pd-1node"
REF = "docker.io/vllm/vllm-openai:glm53-flash"
HOSTS = ("lab1",)  # the target's one node
ENGINES = ("gpufleet-prefill.service", "gpufleet-decode.service", "gpufleet-router.service")


RECORD = "/var/lib/gpufleet/state/image.json"  # engine_runtime's record of the pull


def deploy(target: str, *extra: str):
    return playbook("-i", "inventories/lab", "site.yml", "-e", f"gpufleet_target={target}",
                    "-e", "gpufleet_runtime=image", *extra)


def site(*extra: str):
    return deploy(TARGET, *extra)


def said(proc) -> str:
    return " ".join(proc.stdout.split())


def unit_files(host: str) -> str:
    return ssh(host, "sha256sum /etc/systemd/system/gpufleet-*.service", check=True)


def main_pids(host: str = "lab1") -> dict[str, str]:
    return labutil.main_pids(host, " ".join((*ENGINES, "gpufleet-gateway.service")))


@pytest.fixture(scope="module")
def deployed(lab):
    lab_images.ensure(engines=["vllm"])
    proc = site()
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "smoke" in proc.stdout.lower()
    return proc


def test_engines_run_in_containers_of_the_pinned_digest(deployed):
    record = json.loads(ssh("lab1", f"cat {RECORD}", check=True))
    assert record["ref"] == REF and record["digest"].startswith("sha256:")
    assert record["run"] == f"docker.io/vllm/vllm-openai@{record['digest']}"
    for unit in ENGINES:
        start = ssh("lab1", f"systemctl show -p ExecStart --value {unit}", check=True)
        assert "/usr/bin/podman" in start and record["run"] in start, start
        # values come from the unit's environment file, never the command line
        assert all("=" not in flag.split("--env=", 1)[1]
                   for flag in start.split() if flag.startswith("--env=")), start
        assert ssh("lab1", f"systemctl is-active {unit}").strip() == "active"
    names = ssh("lab1", "podman ps --format '{{.Names}} {{.ImageID}}'", check=True)
    assert {"gpufleet-prefill", "gpufleet-decode", "gpufleet-router"} <= {
        line.split()[0] for line in names.splitlines()}
    # the GPUs by CDI: the container sees the host's simulated GPUs, and only the cache
    # read-only
    gpus = ssh("lab1", "podman exec gpufleet-prefill nvidia-smi -L", check=True)
    assert len(gpus.splitlines()) == 8, gpus
    ro = ssh("lab1", "podman exec gpufleet-prefill sh -c 'touch /var/cache/gpufleet/hf/x' 2>&1")
    assert "Read-only file system" in ro, ro
    # the gateway is nginx from the distribution either way
    gateway = ssh("lab1", "systemctl show -p ExecStart --value gpufleet-gateway.service")
    assert "podman" not in gateway


def test_the_pull_kept_its_progress_and_podmans_lines_without_the_bars(deployed):
    # podman ran on a terminal under fetch_progress.py: its layers' bars became the status
    status = json.loads(ssh("lab1", "cat /run/gpufleet/image-pull.json", check=True))
    assert status["state"] == "done" and status["unit"] == "layers", status
    assert status["files"] > 0 and status["files_done"] == status["files"], status
    if "bytes_total" in status:  # layers fetched now (none where the host had them all)
        assert status["bytes_done"] == status["bytes_total"] > 0, status
    log = ssh("lab1", "cat /var/log/gpufleet-image-pull.log", check=True)
    assert "Copying blob" in log and "Writing manifest" in log, log
    assert "\x1b" not in log and "[=" not in log and "/ " not in log, log  # no bar, no escape


def test_acceptance_runs_in_the_engine_image_with_the_gpus_cdi_gives_it(deployed):
    """fab acceptance with the image runtime: the program and its measuring processes run
    in a container of the pinned image (its PyTorch), the GPUs by CDI as the units get
    them."""
    proc = fab("acceptance", "--target", TARGET, "--runtime", "image", "--while-serving",
               "--gpus", "0,1,4,5", "--format", "json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    checks = json.loads(proc.stdout)["hosts"]["lab1"]["checks"]
    assert [(c["name"], c["gpus"]) for c in checks if c["kind"] == "nccl"][::4] == [
        ("prefill", [0, 1]), ("decode", [4, 5])]
    assert {c["name"] for c in checks if c["kind"] == "gpu"} == {f"GPU {g}" for g in (0, 1, 4, 5)}
    assert all(c["verdict"] == "pass" for c in checks)


def test_a_rerun_changes_nothing_and_restarts_nothing(deployed):
    before = {h: main_pids(h) for h in HOSTS}
    proc = site()
    assert proc.returncode == 0, proc.stdout[-4000:]
    for host in HOSTS:
        assert recap(proc.stdout)[host]["changed"] == 0, changed_tasks(proc.stdout, host)
    assert {h: main_pids(h) for h in HOSTS} == before


# slow (about 3 minutes): the venv's FlashInfer refusal (test_faults_deploy.py) and the
# digest refusal below run every time
@pytest.mark.slow
@pytest.mark.parametrize("case", ["image-absent", "flashinfer-old"])
def test_a_bad_image_is_refused_before_any_unit_changes(deployed, case):
    before = {h: main_pids(h) for h in HOSTS}
    if case == "image-absent":
        extra = ["-e", json.dumps({"gpufleet_images": {"vllm": REF + "-absent"}})]
        expect = ["could not pull docker.io/vllm/vllm-openai:glm53-flash-absent",
                  "Fix: push or mirror that image"]
    else:  # the variant's own venv layer: built here, where it is needed, not for every run
        lab_images.ensure(engines=["vllm"], variants=("flashinfer-old",))
        extra = ["-e", json.dumps({"gpufleet_images": {"vllm": REF + "-flashinfer-old"}})]
        expect = ["has flashinfer-python 0.6.16", "needs 0.6.18 or newer",
                  "Fix: an image with FlashInfer >= 0.6.18"]
    units_before = {h: unit_files(h) for h in HOSTS}
    proc = site(*extra)
    assert proc.returncode != 0, proc.stdout[-4000:]
    for text in expect:
        assert text in said(proc), (text, said(proc)[-4000:])
    assert {h: main_pids(h) for h in HOSTS} == before
    # prepare stopped before serve: no unit file changed
    assert {h: unit_files(h) for h in HOSTS} == units_before
    assert "TASK [gpufleet.fleet.serve" not in proc.stdout
    # the next good run puts every host back on one digest and serves
    again = site()
    assert again.returncode == 0, again.stdout[-4000:]


@pytest.mark.slow  # about 90 s: a rebuilt image pulled and rolled
def test_a_new_digest_restarts_exactly_the_units_that_run_it(deployed):
    before = main_pids("lab1")
    repo, tag = lab_images.registry_path(REF)
    root = lab_images.hosts.ensure_root()
    layers = [lab_images.base_layer(root), lab_images.venv_layer(root, ["vllm", "dynamo"], None)]
    new = lab_images.push(repo, tag, layers, label="new build")
    try:
        # the tag moved: a deploy keeps the digest each host pinned at its first pull ...
        proc = site()
        assert proc.returncode == 0, proc.stdout[-4000:]
        assert main_pids("lab1") == before
        # ... until the operator pins the new one
        pinned = f"docker.io/vllm/vllm-openai@{new}"
        proc = site("-e", json.dumps({"gpufleet_images": {"vllm": pinned}}))
        assert proc.returncode == 0, proc.stdout[-4000:]
        record = json.loads(ssh("lab1", f"cat {RECORD}", check=True))
        assert (record["digest"], record["run"]) == (new, pinned)
        after = main_pids("lab1")
        for unit in ENGINES:
            assert after[unit] != before[unit], unit
        assert after["gpufleet-gateway.service"] == before["gpufleet-gateway.service"]
    finally:
        lab_images.ensure(engines=["vllm"])  # the tag back on the stand-in build


def test_rolling_restart_a_killed_engine_and_health_work_as_for_venv_units(deployed):
    before = main_pids("lab1")
    proc = fab("restart", "--role", "decode", "--target", TARGET)
    assert proc.returncode == 0, proc.stdout[-3000:]
    after = main_pids("lab1")
    assert {u for u in after if after[u] != before[u]} == {"gpufleet-decode.service"}
    # kill -9 of the engine inside its container (the child of the container's init):
    # the container ends, so does the unit, and systemd starts it again
    init = ssh("lab1", "podman inspect --format '{{.State.Pid}}' gpufleet-prefill", check=True)
    ssh("lab1", f"pkill -KILL -P {init.strip()}", check=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = main_pids("lab1").get("gpufleet-prefill.service", "0")
        state = ssh("lab1", "systemctl is-active gpufleet-prefill.service").strip()
        # active is the container started; ready is the engine inside answering (as the
        # venv test waits for), which fab health asks next
        ready = ssh("lab1", "curl -fsS -m 2 -o /dev/null -w '%{http_code}' "
                    "http://127.0.0.1:8001/health").strip()
        if now not in ("0", after["gpufleet-prefill.service"]) and state == "active" \
                and ready == "200":
            break
        time.sleep(2)
    else:
        raise AssertionError(ssh("lab1", "systemctl status gpufleet-prefill.service"))
    restarts = ssh("lab1", "systemctl show -p NRestarts --value gpufleet-prefill.service")
    assert int(restarts) >= 1, restarts
    proc = fab("health", "--target", TARGET)
    assert proc.returncode == 0, proc.stdout[-3000:]
    path = "/var/lib/prometheus/node-exporter/gpufleet.prom"
    metrics = ssh("lab1", f"cat {path}", check=True)
    assert 'gpufleet_health_check_ok{check="generate",unit="gpufleet-router.service"} 1' \
        in metrics, metrics


def test_teardown_removes_containers_and_units_and_keeps_the_image(deployed):
    proc = playbook("-i", "inventories/lab", "playbooks/teardown.yml",
                    "-e", f"gpufleet_target={TARGET}", "-e", "gpufleet_runtime=image")
    assert proc.returncode == 0, proc.stdout[-4000:]
    for host in HOSTS:
        assert ssh(host, "podman ps -a --format '{{.Names}}'").split() == []
        ours = ssh(host, "grep -l '^# gpufleet: installed by the' /etc/systemd/system/*.service")
        assert ours.strip() == "", ours
        kept = ssh(host, "podman images --format '{{.Repository}}:{{.Tag}}'")
        assert REF.split("/", 1)[1] in kept, kept
        # of the state, only the kept images' record stays (a later --purge-images reads it)
        left = sorted(ssh(host, "find /var/lib/gpufleet -mindepth 1", check=True).split())
        assert left == ["/var/lib/gpufleet/state", RECORD], left


# SGLang prefill/decode over Mooncake across lab1 and lab2 (004: on H200 the containers need
# the HCAs and IPC_LOCK, or Mooncake silently falls back to TCP), then Dynamo's h200-disagg
# (NIXL over RDMA) on the same hosts.
SGLANG = "sglang-h200-pd"
SGLANG_REF = "docker.io/lmsysorg/sglang:latest"
PD_HOSTS = {"lab1": "gpufleet-prefill", "lab2": "gpufleet-decode"}


@pytest.fixture(scope="module")
def sglang_deployed(lab):
    lab_images.ensure(engines=["sglang"])
    proc = deploy(SGLANG)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc


@pytest.mark.slow  # with its fixture about 6 minutes: SGLang's image built, two hosts deployed
def test_sglang_pd_containers_get_the_hcas_and_ipc_lock(sglang_deployed):
    assert "smoke" in sglang_deployed.stdout.lower()
    for host, name in PD_HOSTS.items():
        unit = name + ".service"
        start = ssh(host, f"systemctl show -p ExecStart --value {unit}", check=True)
        assert "--device=/dev/infiniband" in start and "--cap-add=IPC_LOCK" in start, start
        assert ssh(host, f"systemctl is-active {unit}").strip() == "active"
        verbs = ssh(host, f"podman exec {name} ls /dev/infiniband", check=True).split()
        assert any(v.startswith("uverbs") for v in verbs), verbs
        cap = ssh(host, f"podman exec {name} grep CapEff /proc/1/status", check=True)
        assert int(cap.split()[1], 16) >> 14 & 1, cap  # CAP_IPC_LOCK
    # the router moves no KV: no HCAs for it
    router = ssh("lab1", "systemctl show -p ExecStart --value gpufleet-router.service", check=True)
    assert "/dev/infiniband" not in router and "IPC_LOCK" not in router, router


@pytest.mark.slow
def test_hosts_that_pulled_different_digests_are_refused_naming_both(sglang_deployed):
    """lab2's registries send the tag to a rebuild (another digest), as a tag moved between
    two hosts' pulls would; lab2 pulls again (its record gone): the deploy stops before any
    unit changes and names both digests."""
    repo, _ = lab_images.registry_path(SGLANG_REF)
    dropin = "/etc/containers/registries.conf.d/60-test-rebuilt.conf"
    ssh("lab2", f"printf '[[registry]]\\nprefix = \"docker.io/{repo}\"\\n"
                f"location = \"10.213.77.1:5000/{repo}-rebuilt\"\\ninsecure = true\\n' > {dropin}"
                f" && rm {RECORD}", check=True)
    try:
        before = {h: main_pids(h) for h in PD_HOSTS}
        units_before = {h: unit_files(h) for h in PD_HOSTS}
        proc = deploy(SGLANG)
        assert proc.returncode != 0, proc.stdout[-4000:]
        digests = {h: json.loads(ssh(h, f"cat {RECORD}", check=True))["digest"] for h in PD_HOSTS}
        assert digests["lab1"] != digests["lab2"], digests
        text = said(proc)
        assert f"the hosts of sglang pulled different images for {SGLANG_REF}" in text, text[-3000:]
        assert f"lab1 run {digests['lab1']}" in text and f"lab2 run {digests['lab2']}" in text
        assert "Fix: pin one digest" in text
        assert "TASK [gpufleet.fleet.serve" not in proc.stdout
        assert {h: main_pids(h) for h in PD_HOSTS} == before
        assert {h: unit_files(h) for h in PD_HOSTS} == units_before
    finally:
        ssh("lab2", f"rm -f {dropin} {RECORD}", check=True)
    again = deploy(SGLANG)
    assert again.returncode == 0, again.stdout[-4000:]


@pytest.mark.slow  # about 3 minutes: two Dynamo deploys and a reboot
def test_dynamo_over_rdma_is_refused_where_containers_cannot_lock_memory_then_serves(
        sglang_deployed):
    lab_images.ensure(engines=["dynamo"])
    lab_hosts.reboot("lab2", boot_faults=["no-ipc-lock"])
    try:
        proc = deploy("h200-disagg")
        assert proc.returncode != 0, proc.stdout[-4000:]
        text = said(proc)
        assert "lab2: a container given /dev/infiniband and IPC_LOCK sees" in text, text[-3000:]
        assert "lacks CAP_IPC_LOCK" in text and "silently fall back to TCP" in text
        assert "TASK [gpufleet.fleet.serve" not in proc.stdout
    finally:
        lab_hosts.reboot("lab2", boot_faults=[])
    proc = deploy("h200-disagg")
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "smoke" in proc.stdout.lower()
    for host, name in PD_HOSTS.items():
        start = ssh(host, f"systemctl show -p ExecStart --value {name}.service", check=True)
        assert "docker.io/vllm/vllm-openai@sha256:" in start and "--cap-add=IPC_LOCK" in start
    # the SGLang units the plan no longer has are gone, their containers with them
    assert "sglang" not in ssh("lab1", "podman ps --format '{{.Image}}'", check=True)
    # the inventory says no runtime (this module chose it per run): teardown goes by what
    # each host ran, and --purge-images removes the image each host pulled
    records = {host: ssh(host, f"cat {RECORD}", check=True) for host in PD_HOSTS}
    proc = fab("teardown", "--target", "h200-disagg", "--purge-images")
    assert proc.returncode == 0, proc.stdout[-4000:]
    for host in PD_HOSTS:
        assert ssh(host, "podman ps -a --format '{{.Names}}'", check=True).split() == []
        kept = ssh(host, "podman images --digests --format '{{.Repository}} {{.Digest}}'",
                   check=True)
        # every image of the repositories it ran: lab1 also ran h200-pd-1node's two digests
        # and pulled the refused flashinfer-old one
        assert "docker.io/vllm/vllm-openai" not in kept, (host, records[host], kept)


@pytest.mark.slow
def test_amd_runs_sglang_from_the_rocm_image_by_default(lab):
    """An MI355X host: no runtime named, the plan runs SGLang's ROCm image (PyPI serves no
    ROCm build), the container gets /dev/kfd and /dev/dri, and the smoke test passes."""
    lab_images.ensure(engines=["sglang"])
    lab_hosts.up(hosts=1, profiles=["mi355x8"])
    try:
        proc = playbook("-i", "inventories/lab", "site.yml",
                        "-e", "gpufleet_target=sglang-mi355x-balanced")
        assert proc.returncode == 0, proc.stdout[-6000:]
        assert "smoke" in proc.stdout.lower()
        record = json.loads(ssh("lab1", f"cat {RECORD}", check=True))
        assert record["ref"] == "docker.io/lmsysorg/sglang:v0.5.23-rocm720-mi35x", record
        start = ssh("lab1", "systemctl show -p ExecStart --value gpufleet-worker.service",
                    check=True)
        assert "--device=/dev/kfd" in start and "--device=/dev/dri" in start, start
        assert "nvidia.com/gpu" not in start
        seen = ssh("lab1", "podman exec gpufleet-worker ls /dev/kfd /dev/dri", check=True)
        assert "/dev/kfd" in seen and "renderD128" in seen, seen
    finally:
        lab_hosts.up(hosts=2)
