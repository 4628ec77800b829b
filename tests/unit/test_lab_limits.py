"""The lab raises the controller kernel's inotify limits its hosts share (a real host has its
own), and never lowers one an operator set higher."""

from __future__ import annotations

from gpufleet_lab import hosts


def test_low_limits_are_raised_and_higher_ones_kept(tmp_path):
    (tmp_path / "fs" / "inotify").mkdir(parents=True)
    instances = tmp_path / "fs/inotify/max_user_instances"
    watches = tmp_path / "fs/inotify/max_user_watches"
    instances.write_text("128\n")
    watches.write_text("9999999\n")
    hosts.raise_inotify_limits(tmp_path)
    assert int(instances.read_text()) == hosts.INOTIFY["fs/inotify/max_user_instances"] > 128
    assert watches.read_text() == "9999999\n"
