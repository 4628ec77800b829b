"""`fab lab.*`: bring the lab of real systemd hosts up and down on this machine."""

from __future__ import annotations

import os

from invoke import Collection, task
from invoke.exceptions import Exit

from gpufleet_lab import hosts as lab_hosts


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _guard(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except lab_hosts.LabError as exc:
        raise Exit(f"lab: {exc}", code=2) from None


@task(
    help={
        "hosts": "number of lab hosts (lab1..labN), default 2",
        "profile": "hardware profile(s), comma separated, assigned per host in order, the last "
        "one repeating (default h200x8)",
        "fault": "fault(s) to switch on in every host, comma separated (e.g. ib-down,driver-old)",
    }
)
def up(c, hosts=2, profile="", fault=""):
    """Boot the lab: N systemd-nspawn hosts with sshd on a private subnet (idempotent).

    Builds the cached Debian root on first use (a few minutes), then boots each
    host from it with its own overlay, starts the apt proxy and wheel source on
    the controller and writes inventories/lab/hosts.yml. Needs root.
    """
    _guard(lab_hosts.up, int(hosts), _split(profile), _split(fault))


@task
def status(c):
    """Show the lab hosts: host, address, profile, faults and state."""
    rows = _guard(lab_hosts.status)
    if not rows:
        print("lab is down (fab lab.up starts it)")
        return
    head = ("HOST", "ADDRESS", "PROFILE", "FAULTS", "STATE")
    table = [head] + [
        (r["name"], r["address"], r["profile"], ",".join(r["faults"]) or "-", r["state"])
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


@task
def down(c):
    """Stop every lab host and lab service; leaves only the blackhole route for the subnet."""
    _guard(lab_hosts.down)


@task(help={"host": "lab host name, e.g. lab1",
            "fault": "boot with this fault from now on (no-ipc-lock); 'none': without"},
      iterable=["fault"])
def reboot(c, host, fault=None):
    """Reboot one lab host (clean power-off, then boot from its own disk again)."""
    faults = None if not fault else [f for f in fault if f != "none"]
    _guard(lab_hosts.reboot, host, faults)


@task(help={"host": "lab host name, e.g. lab1", "user": "login user (root or labadmin)"})
def ssh(c, host, user="root"):
    """Open a shell on a lab host (same as: ssh -F /var/lib/gpufleet-lab/ssh/config HOST)."""
    if not lab_hosts.SSH_CONFIG.exists():
        raise Exit("lab: no ssh config yet; run `fab lab.up` first", code=2)
    cmd = lab_hosts.ssh_cmd(host, user=user, batch=False)
    os.execvp(cmd[0], cmd)


@task(help={"engine": "only the images of these engines, comma separated (default: all)",
            "fault": "also these fault variants, comma separated (flashinfer-old)"})
def images(c, engine="", fault=""):
    """Build the stand-in engine images and push them to the lab's registry.

    They carry the catalog's image names, and the registry is the image runtime's mirror
    (a few minutes the first time)."""
    from gpufleet_lab import images as lab_images

    for ref, digest in _guard(lab_images.ensure, _split(engine) or None,
                              tuple(_split(fault))).items():
        print(f"{ref}  {digest}")


lab = Collection("lab", up, status, down, reboot, ssh, images)
