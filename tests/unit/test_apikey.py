"""The deployment's API key on the controller (gpufleet/apikey.py, the gpufleet_api_key
lookup, the planner's check): an empty, short, pattern-like or unreadable key, or a file
anyone can read, is refused before any host changes; a key is written atomically; a key the
gateway host already has is kept, never replaced by a new random one."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from test_plan_workers import hosts

from gpufleet import apikey
from gpufleet.model import PlanError
from gpufleet.plan import make_plan

PLUGINS = Path(__file__).resolve().parents[2] / "gpufleet" / "ansible_plugins" / "lookup"
GOOD = "Zx0-_.~+/" + "a" * 20 + "=="


def key_file(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / "key"
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("text,said", [
    ("", "is empty"),
    ("\n", "is empty"),
    ("short-key", "9 characters, fewer than 24"),
    # nginx's regex map once read these as patterns: `abc|` accepted any key
    ("abc|" + "x" * 24, "characters an API key may not have"),
    ("a" * 24 + ".*", "characters an API key may not have"),
    ('a' * 24 + '"; return 200;', "characters an API key may not have"),
    ("a" * 24 + " b", "characters an API key may not have"),
    ("a" * 24 + "\nsecond line", "characters an API key may not have"),
    ("=" + "a" * 24, "characters an API key may not have"),
])
def test_a_key_that_is_not_a_bearer_token_is_refused(tmp_path, text, said):
    with pytest.raises(apikey.KeyFileError, match=said) as err:
        apikey.read(str(key_file(tmp_path, text)))
    assert err.value.fix and str(tmp_path / "key") in err.value.message


def test_a_good_key_reads_back_without_its_newline(tmp_path):
    assert apikey.read(str(key_file(tmp_path, GOOD + "\n"))) == GOOD
    assert apikey.read(str(key_file(tmp_path, GOOD))) == GOOD


def test_a_file_others_can_read_or_not_a_file_is_refused(tmp_path):
    # /etc/passwd is a regular file anyone reads: it is not a key
    with pytest.raises(apikey.KeyFileError, match=r"readable by others \(mode 0644\)") as err:
        apikey.read(str(key_file(tmp_path, GOOD, 0o644)))
    assert "chmod 600" in err.value.fix
    with pytest.raises(apikey.KeyFileError, match="readable by others"):
        apikey.read("/etc/passwd")
    with pytest.raises(apikey.KeyFileError, match="not a regular file"):
        apikey.read(str(tmp_path))
    with pytest.raises(apikey.KeyFileError, match="No such file"):
        apikey.read(str(tmp_path / "absent"))
    binary = tmp_path / "bin"
    binary.write_bytes(b"\xff" * 30)
    binary.chmod(0o600)
    with pytest.raises(apikey.KeyFileError, match="not text"):
        apikey.read(str(binary))


def test_a_key_is_made_once_atomically_0600_in_a_0700_directory(tmp_path):
    path = tmp_path / "keys" / "prod.key"
    made = apikey.ensure(str(path))
    assert len(made) >= apikey.MIN_LENGTH and apikey.TOKEN.fullmatch(made)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert apikey.ensure(str(path)) == made  # read back, never made again
    # no temporary file left; .lock: the deployments' files are made one at a time
    assert sorted(os.listdir(path.parent)) == [".lock", "prod.key"]


def test_gateways_asking_at_once_get_one_key(tmp_path):
    """Replicas: each gateway's Ansible fork asks for the key at the same moment."""
    import concurrent.futures

    path = str(tmp_path / "keys" / "prod.key")
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        keys = set(pool.map(lambda _: apikey.ensure(path), range(64)))
    assert keys == {apikey.read(path)}


def test_a_failed_write_leaves_neither_a_key_nor_a_temporary_file(tmp_path, monkeypatch):
    # a full disk: the fsync fails; the key file does not exist half-written
    path = tmp_path / "keys" / "prod.key"

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        apikey.ensure(str(path))
    assert os.listdir(path.parent) == [".lock"]  # no key, no temporary file


@pytest.mark.parametrize("conf", [
    # what the gateway's key file holds (roles/serve/templates/gateway-key.conf.j2)
    f'set $gpufleet_key_ok 0;\nif ($http_authorization = "Bearer {GOOD}") {{\n'
    f'    set $gpufleet_key_ok 1;\n}}\nif ($http_x_api_key = "{GOOD}") {{\n',
    # and what earlier releases wrote
    f'map $http_authorization $gpufleet_bearer_ok {{\n    default 0;\n'
    f'    "~^Bearer {GOOD}$" 1;\n}}\nmap $http_x_api_key $x {{\n    "~^{GOOD}$" 1;\n}}\n',
])
def test_the_key_a_gateway_host_has_is_kept_where_the_controller_has_none(tmp_path, conf):
    # a new clone, another operator, a job runner with a fresh HOME: the clients' key stays
    assert apikey.from_gateway(conf) == GOOD
    path = tmp_path / "new-home" / "prod.key"
    assert apikey.ensure(str(path), on_host=apikey.from_gateway(conf)) == GOOD
    assert path.read_text() == GOOD + "\n"
    assert apikey.from_gateway("") is None and apikey.from_gateway("# nothing\n") is None


def test_a_host_key_that_is_no_key_is_refused_not_kept(tmp_path):
    with pytest.raises(apikey.KeyFileError, match="gateway host's key"):
        apikey.ensure(str(tmp_path / "k"), on_host="abc")
    assert not (tmp_path / "k").exists()


def test_the_lookup_reads_keeps_or_makes_the_key_and_names_a_bad_one(tmp_path):
    from ansible.errors import AnsibleError
    from ansible.plugins.loader import lookup_loader

    lookup_loader.add_directory(str(PLUGINS))
    lookup = lookup_loader.get("gpufleet_api_key")
    path = tmp_path / "prod.key"
    conf = f'if ($http_x_api_key = "{GOOD}") {{\n'
    assert lookup.run([str(path)], {}, on_host=conf) == [GOOD]
    assert lookup.run([str(path)], {}) == [GOOD]
    path.write_text("")
    with pytest.raises(AnsibleError, match="gpufleet: .* is empty"):
        lookup.run([str(path)], {})


def test_the_plan_refuses_a_bad_key_file_before_any_host_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    with pytest.raises(PlanError, match="gpufleet_api_key_file.*does not exist"):
        make_plan("h200-pd-1node", hosts(workers=1), {"api_key_file": str(tmp_path / "no")})
    for text, mode, said in (("", 0o600, "is empty"), (GOOD, 0o644, "readable by others")):
        bad = key_file(tmp_path, text, mode)
        with pytest.raises(PlanError, match=f"gpufleet_api_key_file.*{said}"):
            make_plan("h200-pd-1node", hosts(workers=1), {"api_key_file": str(bad)})
    # the deployment's own key file (none named): checked the same way where it exists
    plan = make_plan("h200-pd-1node", hosts(workers=1))
    own = plan.to_json()["api"]["key_file"]
    assert own.startswith(str(tmp_path / "cfg" / "gpufleet" / "api-keys"))
    os.makedirs(os.path.dirname(own), mode=0o700)
    with open(own, "w") as fh:
        fh.write("abc|")
    os.chmod(own, 0o600)
    with pytest.raises(PlanError, match="gpufleet_api_key_file.*may not have"):
        make_plan("h200-pd-1node", hosts(workers=1))
    assert make_plan("h200-pd-1node", hosts(workers=1), {"api_key": False})
