"""The cache role on the lab: a refused token is named, and never printed anywhere:
not in Ansible's -vvv output, not in a host's journal, not in a file on the hosts."""

from __future__ import annotations

import uuid

import pytest
from labutil import playbook, ssh

pytestmark = pytest.mark.lab


def test_a_bad_token_is_refused_clearly_and_never_printed(lab):
    secret = f"gpufleet-test-token-{uuid.uuid4().hex}"
    proc = playbook("-vvv", "-i", "inventories/lab", "playbooks/preflight.yml",
                    "playbooks/cache.yml", "-e", "gpufleet_target=h200-pd-1node",
                    "-e", "gpufleet_cache_dir=/var/cache/gpufleet/hf/token-test",
                    "-e", f"gpufleet_hf_token={secret}")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "gpufleet_hf_token in ansible-vault" in " ".join(out.split())
    assert secret not in out
    for host in ("lab1", "lab2"):
        assert secret not in ssh(host, "journalctl --no-pager -o cat")
        assert ssh(host, f"grep -rl {secret} /etc /var/lib/gpufleet /var/cache/gpufleet "
                         "/opt/gpufleet /tmp 2>/dev/null; true").strip() == ""
