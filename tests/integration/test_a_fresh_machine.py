"""A fresh machine, first: the lab root built from nothing (debootstrap into an empty
cache directory instead of the cached root), a host booted from it, and the default
target deployed onto it through the smoke test.

A warm machine hides what a first run meets: a root built an hour ago passed while a
fresh one (empty apt lists with a new mtime) failed the first package install. This
module's name sorts it first, so it is also the session's first deploy.
"""

from __future__ import annotations

import json
import shutil

import pytest
from labutil import fab, ssh

from gpufleet_lab import hosts as lab_hosts

# slow (about 3 minutes on a warm machine, where it builds a second root): on a fresh
# machine every lab module boots from a root built from nothing anyway
pytestmark = [pytest.mark.lab, pytest.mark.slow]


def test_a_root_built_from_nothing_boots_and_takes_the_deploy(_lab_session, tmp_path_factory):
    # On a fresh machine the lab's own root cache is empty too: the root is built from
    # nothing there, and the later modules boot from it. On a warm machine, a second root
    # is built from nothing in an empty directory.
    fresh = not lab_hosts.root_dir().exists()
    cache = lab_hosts.CACHE_DIR if fresh else tmp_path_factory.mktemp("lab-root-cache")
    assert not lab_hosts.root_dir(cache).exists()
    lab_hosts.down()
    try:
        lab_hosts.up(hosts=1, root_cache=cache)
        root = lab_hosts.load_state()["root"]
        assert root == str(lab_hosts.root_dir(cache)), root
        assert (lab_hosts.root_dir(cache) / "etc/os-release").exists()
        # the host knows no apt package yet, as a freshly imaged server
        assert "_Packages" not in ssh("lab1", "ls /var/lib/apt/lists")
        proc = fab("deploy", "--target", "h200-pd-1node")
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        assert "models          ok" in proc.stdout
        status = json.loads(fab("status", "--format", "json").stdout)
        assert {u["active"] for u in status["units"]} == {"active"}
    finally:
        lab_hosts.down()
        shutil.rmtree(cache, ignore_errors=True)
