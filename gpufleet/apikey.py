"""The deployment's API key on the controller: read and checked, or made once, atomically.

The gateway compares the key exactly (roles/serve/templates/gateway-key.conf.j2: nginx's
`if ($http_x_api_key = "...")`, a string comparison, never a pattern), so a key is a
bearer token as RFC 6750 spells one (letters, digits and `-._~+/`, then `=` padding) of
at least MIN_LENGTH characters: nothing in it means anything to nginx. A key file is the
controller user's own (not readable by group or others): naming /etc/passwd or an empty
file is refused before any host changes, and a key is written to a temporary file,
fsynced and renamed, so a full disk leaves no half-written key.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
import tempfile

MIN_LENGTH = 24
TOKEN = re.compile(r"[A-Za-z0-9._~+/-]+=*")
# the key as the gateway's key file holds it (and as older releases wrote it: a pattern)
_ON_HOST = re.compile(r'^\s*if \(\$http_x_api_key = "([^"]*)"\)|^\s*"~\^(?!Bearer )([^"$]*)\$" 1;',
                      re.M)


class KeyFileError(Exception):
    """The key file cannot be used: what is wrong (naming the file) and the fix."""

    def __init__(self, message: str, fix: str):
        self.message, self.fix = message, fix
        super().__init__(f"{message}. Fix: {fix}")


def check(key: str, where: str) -> str:
    """The key, or KeyFileError naming what is wrong with it (one final newline is fine)."""
    key = key[:-1] if key.endswith("\n") else key
    if not key:
        raise KeyFileError(f"{where} is empty", "delete it (the next deploy makes a new "
                           f"key) or write a key of at least {MIN_LENGTH} characters into it")
    if not TOKEN.fullmatch(key):
        raise KeyFileError(
            f"{where} holds characters an API key may not have (a bearer token: letters, "
            "digits and -._~+/ with = at the end, on one line)",
            "write such a key, e.g. `python3 -c 'import secrets; "
            "print(secrets.token_urlsafe(36))'`")
    if len(key) < MIN_LENGTH:
        raise KeyFileError(f"{where} holds a key of {len(key)} characters, fewer than "
                           f"{MIN_LENGTH}", "write a longer key into it")
    return key


def read(path: str) -> str:
    """The key in PATH, checked: a regular file of the controller user's, not readable by
    group or others."""
    where = f"API key file {path}"
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"{where} is not a regular file", "name the key's file")
        if st.st_mode & 0o077:
            raise KeyFileError(
                f"{where} is readable by others (mode {stat.S_IMODE(st.st_mode):04o})",
                f"`chmod 600 {path}` if it holds only the key, or name the file that does")
        with open(path, encoding="ascii") as fh:
            text = fh.read(4096)
    except OSError as exc:
        raise KeyFileError(f"{where}: {exc.strerror}", "make it readable by the controller "
                           "user, or set no gpufleet_api_key_file for a key gpufleet "
                           "makes") from exc
    except UnicodeDecodeError as exc:
        raise KeyFileError(f"{where} is not text", "name the key's file") from exc
    return check(text, where)


def write(path: str, key: str) -> None:
    """Write KEY to PATH (0600, in a 0700 directory): a temporary file, fsynced, renamed."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".key-")
    try:
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(key + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def from_gateway(text: str) -> str | None:
    """The key a host's gateway key file holds, or None."""
    found = _ON_HOST.search(text or "")
    return (found.group(1) or found.group(2)) if found else None


@contextlib.contextmanager
def made_once(path: str):
    """Held while a file of PATH's deployment is read or made: the gateways of several
    replicas ask at once (one Ansible fork each), and the first makes it for all."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def ensure(path: str, on_host: str | None = None) -> str:
    """The deployment's key: PATH's when it exists; else the key the gateway host already
    has (kept, so that a new controller or a fresh HOME rotates nothing); else a new one."""
    with made_once(path):
        if os.path.lexists(path):
            return read(path)
        key = check(on_host, "the gateway host's key") if on_host else \
            secrets.token_urlsafe(36)
        write(path, key)
        return key
