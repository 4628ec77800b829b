"""The lab network: namespaces, a bridge, veths, routes and the safety rules.

Layout (all names start with ``gfl``)::

    root netns (controller)       netns gfl-lab                        netns gfl-<host>
    gfl-ctl 10.213.77.1 <-veth-> gfl-ctl-p -- gfl-br0 -- gfl-<host>-p <-veth-> eth0 .11, .12..

The lab subnet exists only inside these namespaces.  The controller holds a
blackhole route for the subnet at all times (metric BLACKHOLE_METRIC), so when
the lab is down its addresses go nowhere; while it is up the connected route of
``gfl-ctl`` (metric 0) wins.  Hosts get no default route, the lab namespaces do
not forward, and an nftables table drops any forwarding of lab addresses in the
root namespace.
"""

from __future__ import annotations

import ipaddress
import subprocess

SUBNET = ipaddress.ip_network("10.213.77.0/24")
CTRL_ADDR = "10.213.77.1"
FIRST_HOST = 11  # lab1 -> .11, lab2 -> .12, ...
LAB_NS = "gfl-lab"
BRIDGE = "gfl-br0"
CTRL_LINK = "gfl-ctl"
BLACKHOLE_METRIC = 4242
NFT_TABLE = "gfl_lab"


class LabError(RuntimeError):
    """A lab problem the operator must fix; the message names the fix."""


def host_address(index: int) -> str:
    """Address of lab host number ``index`` (1-based)."""
    return str(SUBNET.network_address + FIRST_HOST + index - 1)


def host_ns(host: str) -> str:
    return f"gfl-{host}"


def host_link(host: str) -> str:
    """Name of the bridge-side veth end of ``host`` (IFNAMSIZ is 15)."""
    return f"gfl-{host}-p"[:15]


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise LabError(f"{' '.join(cmd)} failed: {res.stderr.strip()}")
    return res


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return _run("ip", *(("-n", ns) if ns else ()), *args, check=check)


def list_netns() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def lab_netns() -> list[str]:
    return [n for n in list_netns() if n.startswith("gfl-")]


def lab_links() -> list[str]:
    """gfl* links in the root namespace."""
    out = ip("-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]
    return [n for n in names if n.startswith("gfl")]


def link_exists(name: str, ns: str | None = None) -> bool:
    return ip("link", "show", name, ns=ns, check=False).returncode == 0


def ensure_guards() -> None:
    """Blackhole route and forward-drop rules; both stay when the lab is down."""
    ip("route", "replace", "blackhole", str(SUBNET), "metric", str(BLACKHOLE_METRIC))
    ruleset = f"""
table inet {NFT_TABLE} {{
    chain forward {{
        type filter hook forward priority -10; policy accept;
        ip saddr {SUBNET} drop
        ip daddr {SUBNET} drop
    }}
}}
"""
    _run("nft", "delete", "table", "inet", NFT_TABLE, check=False)
    subprocess.run(["nft", "-f", "-"], input=ruleset, text=True, check=True, capture_output=True)


def blackhole_present() -> bool:
    out = ip("route", "show", "type", "blackhole", check=False).stdout
    return str(SUBNET) in out


def lab_routes() -> list[str]:
    """Routes in the root namespace that touch the lab subnet, blackhole excluded."""
    out = ip("route", "show", "match", str(SUBNET), check=False).stdout
    return [
        line
        for line in out.splitlines()
        if str(SUBNET) in line and not line.startswith("blackhole")
    ]


def setup_lab_net() -> None:
    """Create the lab namespace, bridge and the controller's veth (idempotent)."""
    ensure_guards()
    if LAB_NS not in list_netns():
        ip("netns", "add", LAB_NS)
    ip("link", "set", "lo", "up", ns=LAB_NS)
    if not link_exists(BRIDGE, ns=LAB_NS):
        ip("link", "add", BRIDGE, "type", "bridge", ns=LAB_NS)
    ip("link", "set", BRIDGE, "up", ns=LAB_NS)
    peer = CTRL_LINK + "-p"
    if not link_exists(CTRL_LINK):
        ip("link", "add", CTRL_LINK, "type", "veth", "peer", "name", peer, "netns", LAB_NS)
    ip("link", "set", peer, "master", BRIDGE, "up", ns=LAB_NS)
    ip("addr", "replace", f"{CTRL_ADDR}/{SUBNET.prefixlen}", "dev", CTRL_LINK)
    ip("link", "set", CTRL_LINK, "up")
    # The controller never forwards for the lab, whatever the global setting is.
    _run("sysctl", "-qw", f"net.ipv4.conf.{CTRL_LINK}.forwarding=0")


def setup_host_net(host: str, index: int) -> None:
    """Namespace gfl-<host> with eth0 on the lab bridge, static address, no default route."""
    ns = host_ns(host)
    if ns not in list_netns():
        ip("netns", "add", ns)
    ip("link", "set", "lo", "up", ns=ns)
    peer = host_link(host)
    if not link_exists("eth0", ns=ns):
        ip("link", "del", peer, ns=LAB_NS, check=False)  # half of a stale pair
        ip("link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", ns, ns=LAB_NS)
    ip("link", "set", peer, "master", BRIDGE, "up", ns=LAB_NS)
    ip("addr", "replace", f"{host_address(index)}/{SUBNET.prefixlen}", "dev", "eth0", ns=ns)
    ip("link", "set", "eth0", "up", ns=ns)


def teardown() -> None:
    """Remove every gfl-* namespace and link; keep (and ensure) the guards."""
    for ns in lab_netns():
        ip("netns", "del", ns, check=False)
    for link in lab_links():
        ip("link", "del", link, check=False)
    ensure_guards()
