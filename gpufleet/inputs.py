"""What an operator's value must look like before it reaches a file or a command line.

Every value the planner passes on lands in a systemd unit, an environment file, nginx's
configuration or a downloader's path: a newline adds a line there, a `;` ends an nginx
directive, `..` leaves the cache. Each check returns the value or raises ValueError with
what it must be (the planner adds the field and the fix).
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse

CONTROL = re.compile(r"[\x00-\x1f\x7f]")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
FLAG = re.compile(r"--?[A-Za-z0-9][A-Za-z0-9_.-]*")
HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")
# a Hugging Face revision: a branch or tag name as git allows one, or a commit
REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")
COMMIT = re.compile(r"[0-9a-f]{40}")
PORTS = (1024, 65535)
# a word of a flag's or variable's name that makes its value a credential (--hf-token,
# HF_TOKEN, --api-key, DB_PASSWORD; not --max-num-batched-tokens or --tokenizer)
SECRET_WORDS = re.compile(r"(^|[-_])(token|secret|password|passwd|api[-_]key|apikey|"
                          r"credentials?)($|[-_])", re.I)


def text(value, what: str) -> str:
    """A value that goes into a file or a command line: no control characters."""
    if not isinstance(value, str):
        value = str(value)
    if CONTROL.search(value):
        raise ValueError(f"{what} {value!r} holds a control character (a newline adds a "
                         "line to the unit or environment file it lands in)")
    return value


def address(value, what: str) -> str:
    """A host address nginx listens on and the engines dial: an IPv4 address or a DNS
    name (the units, URLs and nginx's `listen` the plan writes take no IPv6 brackets)."""
    value = str(value)
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        ip = None
    if ip is not None and ip.version == 6:
        raise ValueError(f"{what} {value!r} is an IPv6 address, which gpufleet does not "
                         "write yet. Fix: give the host's IPv4 address or a DNS name")
    if ip is not None:
        return value
    if not HOSTNAME.fullmatch(value):
        raise ValueError(f"{what} {value!r} is neither an IP address nor a host name "
                         "(letters, digits, '-' and '.')")
    return value


def path(value, what: str) -> str:
    """An absolute path on the hosts, without '..', spaces, '%' (a systemd specifier) or
    control characters."""
    value = text(value, what)
    if not value.startswith("/") or ".." in value.split("/") or re.search(r"[\s%]", value):
        raise ValueError(f"{what} {value!r} is not an absolute path without '..', spaces "
                         "or '%'")
    return value


def revision(value, what: str) -> str:
    """A branch or tag name, or a 40-hex commit: never a path."""
    value = text(value, what)
    if COMMIT.fullmatch(value):
        return value
    if not REVISION.fullmatch(value) or ".." in value or value.endswith((".lock", ".")):
        raise ValueError(f"{what} {value!r} is neither a branch or tag name nor a 40-hex "
                         "commit")
    return value


def url(value, what: str, secrets_ok: bool = False) -> str:
    """An http(s) URL with a host; without credentials (they would show in `ps`, in logs
    and in the cache's manifest) unless secrets_ok."""
    value = text(value, what)
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or " " in value:
        raise ValueError(f"{what} {value!r} is not an http:// or https:// URL with a host")
    if (parts.username or parts.password) and not secrets_ok:
        raise ValueError(f"{what} carries credentials ({parts.scheme}://USER:...@): they "
                         "would show in process listings, logs and the cache's manifest. "
                         "Fix: give the mirror's token as gpufleet_hf_token (ansible-vault) "
                         "and the URL without them")
    return value


def port(value, what: str) -> int:
    """A TCP port the plan binds: an integer 1024-65535 (not a bool, not a string)."""
    low, high = PORTS
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} {value!r} is not a port number from {low} to {high}")
    return value


def network(value, what: str) -> str:
    """An address or network (CIDR) nginx's `allow` takes: IPv4 or IPv6, host bits zero;
    an address as written, a network with its prefix."""
    import ipaddress

    value = text(value, what)
    try:
        net = ipaddress.ip_network(value, strict=True)
    except ValueError:
        raise ValueError(f"{what} {value!r} is not an address or a network such as "
                         "10.0.0.0/8 (host bits zero)") from None
    return str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net)


def gpu_index(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} {value!r} is not a GPU index (0, 1, ...)")
    return value


def env_name(value, what: str) -> str:
    if not isinstance(value, str) or not ENV_NAME.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not an environment variable name (letters, "
                         "digits and '_', not starting with a digit)")
    return value


def flag_name(value, what: str) -> str:
    if not isinstance(value, str) or not FLAG.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not a command-line flag (--name)")
    return value


def secret_like(name: str) -> bool:
    """A flag or variable whose value is a credential by its name (--hf-token, --api-key,
    HF_TOKEN, *_PASSWORD)."""
    return bool(SECRET_WORDS.search(name.lstrip("-")))
