"""The optional firewall role on a two-host deployment: the API port answers everyone,
the engines' ports only the other host of the plan; turned off, its table is gone."""

from __future__ import annotations

import socket

import pytest
from labutil import fab, lab_inventory, ssh

pytestmark = pytest.mark.lab

TARGET = "sglang-h200-pd"  # router + prefill on lab1, decode on lab2


def reachable(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(3)
        return s.connect_ex((address, port)) == 0


def from_lab1(address: str, port: int) -> bool:
    probe = (f"python3 -c \"import socket; s=socket.socket(); s.settimeout(3); "
             f"print(s.connect_ex(('{address}', {port})))\"")
    return ssh("lab1", probe).strip() == "0"


@pytest.mark.slow  # two deploys of their own, nearly 3 minutes
def test_the_firewall_lets_clients_reach_the_api_and_only_peers_the_engines(lab, tmp_path):
    inv = lab_inventory(tmp_path, {"gpufleet_firewall": True})
    proc = fab("deploy", "--target", TARGET, "-i", inv)
    assert proc.returncode == 0, proc.stdout[-3000:]  # the smoke test crossed hosts
    assert reachable("10.213.77.11", 8000)            # the controller is a client
    assert not reachable("10.213.77.12", 30000)       # ... but not a peer of decode
    assert from_lab1("10.213.77.12", 30000)           # the router's host is
    rules = ssh("lab2", "nft list table inet gpufleet")
    assert "30000" in rules and "drop" in rules
    assert ssh("lab2", "nft list tables").count("table") >= 1

    off = fab("deploy", "--target", TARGET, "-i", lab_inventory(tmp_path / "off"))
    assert off.returncode == 0, off.stdout[-3000:]
    assert "gpufleet" not in ssh("lab2", "nft list tables")
    assert reachable("10.213.77.12", 30000)
