"""The image runtime on the lab: the engines run from the catalog's images (stand-in images
under the seeds' names, in the controller's registry, the hosts' mirror) by podman under
systemd, GPUs by CDI.

One deployment of h200-pd-1node (a replica on each lab host) is shared by the module: the
smoke test passes, a re-run changes nothing and restarts nothing, a new digest of the
image restarts exactly the units that run it, each fault is refused with its fix before
any unit changes, and teardown removes the containers and keeps the image.
"""

from __future__ import annotations

import json
import re

import pytest
from labutil import changed_tasks, playbook, recap, ssh

from gpufleet_lab import images as lab_images

# slow (./scripts/test --slow): the stand-in images and this module's deploys add about 12
# minutes, more than .ci/run's budget holds beside the venv runtime's suite today
pytestmark = [pytest.mark.lab, pytest.mark.slow]

TARGET = "h200-pd-1node"
REF = "docker.io/vllm/vllm-openai:glm53-flash"
HOSTS = ("lab1",)  # the target's one node
ENGINES = ("gpufleet-prefill.service", "gpufleet-decode.service", "gpufleet-router.service")


def site(*extra: str):
    return playbook("-i", "inventories/lab", "site.yml", "-e", f"gpufleet_target={TARGET}",
                    "-e", "gpufleet_runtime=image", *extra)


def said(proc) -> str:
    return " ".join(proc.stdout.split())


def unit_files(host: str) -> str:
    return ssh(host, "sha256sum /etc/systemd/system/gpufleet-*.service", check=True)


def main_pids(host: str = "lab1") -> dict[str, str]:
    units = (*ENGINES, "gpufleet-gateway.service")
    out = ssh(host, "systemctl show -p Id,MainPID " + " ".join(units), check=True)
    pairs = re.findall(r"MainPID=(\d+)\nId=(\S+)|Id=(\S+)\nMainPID=(\d+)", out)
    return {(a[1] or a[2]): (a[0] or a[3]) for a in pairs}


@pytest.fixture(scope="module")
def deployed(lab):
    lab_images.ensure(engines=["vllm"], variants=("flashinfer-old",))
    proc = site()
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "smoke" in proc.stdout.lower()
    return proc


def test_engines_run_in_containers_of_the_pinned_digest(deployed):
    record = json.loads(ssh("lab1", "cat /var/lib/gpufleet/state/image.json", check=True))
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


def test_a_rerun_changes_nothing_and_restarts_nothing(deployed):
    before = {h: main_pids(h) for h in HOSTS}
    proc = site()
    assert proc.returncode == 0, proc.stdout[-4000:]
    for host in HOSTS:
        assert recap(proc.stdout)[host]["changed"] == 0, changed_tasks(proc.stdout, host)
    assert {h: main_pids(h) for h in HOSTS} == before


@pytest.mark.parametrize("case", ["image-absent", "flashinfer-old"])
def test_a_bad_image_is_refused_before_any_unit_changes(deployed, case):
    before = {h: main_pids(h) for h in HOSTS}
    if case == "image-absent":
        extra = ["-e", json.dumps({"gpufleet_images": {"vllm": REF + "-absent"}})]
        expect = ["could not pull docker.io/vllm/vllm-openai:glm53-flash-absent",
                  "Fix: push or mirror that image"]
    else:
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
    assert "TASK [serve" not in proc.stdout
    # the next good run puts every host back on one digest and serves
    again = site()
    assert again.returncode == 0, again.stdout[-4000:]


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
        record = json.loads(ssh("lab1", "cat /var/lib/gpufleet/state/image.json", check=True))
        assert (record["digest"], record["run"]) == (new, pinned)
        after = main_pids("lab1")
        for unit in ENGINES:
            assert after[unit] != before[unit], unit
        assert after["gpufleet-gateway.service"] == before["gpufleet-gateway.service"]
    finally:
        lab_images.ensure(engines=["vllm"])  # the tag back on the stand-in build


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
