"""The gateway's TLS certificate on the controller (gpufleet.tls) and in the plan: a
self-signed pair made once and kept like the API key, a site's pair checked before any
host changes, HTTPS by default and plain HTTP only where the inventory says so."""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gpufleet import cli, tls
from gpufleet.plan import PlanError

NAMES = ["10.0.0.5", "gpu-node1"]


def names_of(pem: str) -> set[str]:
    cert = x509.load_pem_x509_certificate(pem.encode())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(v) for v in san.get_values_for_type(x509.DNSName)} | {
        str(v) for v in san.get_values_for_type(x509.IPAddress)}


def site_pair(tmp_path, names, days=90, other_key=False):
    """A certificate (and key) as a site's own CA would issue it."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    now = datetime.datetime.now(datetime.UTC)
    alt = [x509.DNSName(n) for n in names]
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(now - datetime.timedelta(days=400))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .sign(key, hashes.SHA256()))
    if other_key:
        key = ec.generate_private_key(ec.SECP256R1())
    crt, kf = tmp_path / "site.crt", tmp_path / "site.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    kf.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    kf.chmod(0o600)
    return str(crt), str(kf)


def test_a_self_signed_pair_is_made_once_0600_and_names_every_gateway(tmp_path):
    crt, key = str(tmp_path / "tls" / "d.crt"), str(tmp_path / "tls" / "d.key")
    made = tls.ensure_self_signed(crt, key, NAMES)
    assert made["made"] and names_of(made["cert"]) == set(NAMES)
    for path in (crt, key):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "tls").st_mode) == 0o700
    kept = tls.ensure_self_signed(crt, key, NAMES)
    assert not kept["made"] and kept["cert"].strip() == made["cert"].strip()
    # its own CA: it verifies itself, for the names it carries
    assert tls.check_pair(made["cert"].encode(), made["key"].encode(), "it", NAMES) == []


def test_a_gateway_it_does_not_name_makes_a_new_one(tmp_path):
    crt, key = str(tmp_path / "d.crt"), str(tmp_path / "d.key")
    first = tls.ensure_self_signed(crt, key, NAMES)
    moved = tls.ensure_self_signed(crt, key, [*NAMES, "gpu-node2"])
    assert moved["made"] and moved["cert"] != first["cert"]
    assert names_of(moved["cert"]) == {*NAMES, "gpu-node2"}


def test_a_controller_without_the_pair_keeps_the_gateway_hosts(tmp_path):
    host = tls.ensure_self_signed(str(tmp_path / "a.crt"), str(tmp_path / "a.key"), NAMES)
    crt, key = str(tmp_path / "new" / "d.crt"), str(tmp_path / "new" / "d.key")
    kept = tls.ensure_self_signed(crt, key, NAMES, on_host=(host["cert"], host["key"]))
    assert not kept["made"] and kept["cert"] == host["cert"]
    assert Path(crt).read_text().strip() == host["cert"].strip()
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    # a host's pair that no longer names every gateway is not kept
    other = str(tmp_path / "o.crt"), str(tmp_path / "o.key")
    fresh = tls.ensure_self_signed(*other, ["gpu-node9"], on_host=(host["cert"], host["key"]))
    assert fresh["made"] and names_of(fresh["cert"]) == {"gpu-node9"}


def test_replicas_asking_at_once_get_one_certificate(tmp_path):
    crt, key = str(tmp_path / "d.crt"), str(tmp_path / "d.key")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        certs = set(pool.map(lambda _: tls.ensure_self_signed(crt, key, NAMES)["cert"].strip(),
                             range(16)))
    assert len(certs) == 1


def test_a_site_pair_is_checked(tmp_path):
    crt, key = site_pair(tmp_path, NAMES)
    cert, _ = tls.read_site_pair(crt, key, NAMES)
    assert "BEGIN CERTIFICATE" in cert
    with pytest.raises(tls.TLSError, match="does not name gpu-node2"):
        tls.read_site_pair(crt, key, [*NAMES, "gpu-node2"])
    with pytest.raises(tls.TLSError, match="does not belong to its certificate"):
        tls.read_site_pair(*site_pair(tmp_path, NAMES, other_key=True), NAMES)
    with pytest.raises(tls.TLSError, match="expired on"):
        tls.read_site_pair(*site_pair(tmp_path, NAMES, days=-1), NAMES)
    crt, key = site_pair(tmp_path, NAMES)
    os.chmod(key, 0o644)
    with pytest.raises(tls.TLSError, match="readable by others"):
        tls.read_site_pair(crt, key, NAMES)
    (tmp_path / "junk.crt").write_text("not a certificate\n")
    os.chmod(key, 0o600)
    with pytest.raises(tls.TLSError, match="is not a PEM certificate"):
        tls.read_site_pair(str(tmp_path / "junk.crt"), key, NAMES)


def _plan(tmp_path, monkeypatch, **vars_):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    inv = tmp_path / "inv"
    (inv / "group_vars").mkdir(parents=True, exist_ok=True)
    (inv / "hosts.yml").write_text(
        "all:\n  children:\n    workers:\n      hosts:\n        gpu-node1:\n"
        "          ansible_host: 10.0.0.5\n")
    import yaml

    (inv / "group_vars" / "all.yml").write_text(yaml.safe_dump(
        {"gpufleet_hardware": "h200", **vars_}))
    return cli.build("h200-pd-1node", str(inv))


def test_https_by_default_with_the_self_signed_ca(tmp_path, monkeypatch):
    p = _plan(tmp_path, monkeypatch)
    assert p.endpoint == "https://10.0.0.5:8000/v1"
    spec = p.api["tls"]
    assert spec["self_signed"] and spec["names"] == NAMES
    assert spec["ca_file"] == spec["cert_file"] == str(tmp_path / "config" / "gpufleet" /
                                                        "tls" / "inv.crt")
    (gateway,) = p.by_role("gateway")
    assert gateway.readiness.url == "https://10.0.0.5:8000/health"
    assert gateway.readiness.ca_file == gateway.health.ca_file == spec["host_ca_file"]
    assert not any("plain HTTP" in w for w in p.warnings)


def test_plain_http_only_where_the_inventory_says_so(tmp_path, monkeypatch):
    p = _plan(tmp_path, monkeypatch, gpufleet_tls=False)
    assert p.endpoint == "http://10.0.0.5:8000/v1" and p.api["tls"] is None
    assert p.by_role("gateway")[0].readiness.url.startswith("http://")
    assert any("plain HTTP (gpufleet_tls: false)" in w for w in p.warnings)


def test_a_site_certificate_is_refused_before_any_host_changes(tmp_path, monkeypatch):
    crt, key = site_pair(tmp_path, ["gpu-node1"])  # lacks the address
    with pytest.raises(PlanError) as err:
        _plan(tmp_path, monkeypatch, gpufleet_tls_cert_file=crt, gpufleet_tls_key_file=key)
    assert "gpufleet_tls_cert_file" in str(err.value) and "does not name 10.0.0.5" in str(
        err.value)
    crt, key = site_pair(tmp_path, NAMES)
    p = _plan(tmp_path, monkeypatch, gpufleet_tls_cert_file=crt, gpufleet_tls_key_file=key)
    assert not p.api["tls"]["self_signed"] and p.api["tls"]["ca_file"] is None
    assert p.by_role("gateway")[0].readiness.ca_file is None  # the host's trust store


@pytest.mark.parametrize("vars_, said", [
    ({"gpufleet_tls_cert_file": "/x.crt"},
     "gpufleet_tls_cert_file: is set without gpufleet_tls_key_file"),
    ({"gpufleet_tls_ca_file": "/ca.crt"}, "its own CA"),
    ({"gpufleet_tls": False, "gpufleet_tls_cert_file": "/x", "gpufleet_tls_key_file": "/y"},
     "gpufleet_tls is false"),
    ({"gpufleet_api_key": False, "gpufleet_tls_cert_file": "/x",
      "gpufleet_tls_key_file": "/y"}, "no gateway"),
])
def test_tls_settings_that_do_not_fit_are_named(tmp_path, monkeypatch, vars_, said):
    with pytest.raises(PlanError) as err:
        _plan(tmp_path, monkeypatch, **vars_)
    assert said in str(err.value) and "Fix:" in str(err.value)
