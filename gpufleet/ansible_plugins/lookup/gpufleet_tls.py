"""Ansible lookup `gpufleet_tls`: the gateway's TLS certificate, key and CA on the controller.

The site's pair (the plan's api.tls names its files), read and checked; or the deployment's
self-signed pair, read where it still names every gateway, else kept from the gateway host
(`on_host`), else made once (atomically, 0600), as gpufleet_api_key keeps the API key.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: gpufleet_tls
short_description: the gateway's certificate, key and CA (read, checked, kept or made once)
description:
  - >-
    For the plan's C(api.tls): a site's certificate and key (C(self_signed) false) are read
    and checked (PEM, the key the certificate's, not expired, naming every gateway host),
    with the CA file clients verify them with where the plan names one. A self-signed pair
    (C(self_signed) true) is the controller's where it names every gateway and has more
    than 30 days left; else the gateway host's (C(on_host_cert), C(on_host_key)) where that
    does; else a new one, written 0600 to the plan's files. The self-signed certificate is
    its own CA.
options:
  _terms:
    description: the plan's api.tls (a dict)
    required: true
  on_host_cert:
    description: the gateway host's certificate file (its text), or empty
    type: str
    default: ""
  on_host_key:
    description: the gateway host's key file (its text), or empty
    type: str
    default: ""
"""

EXAMPLES = r"""
# roles/serve: the pair the gateway serves with (no_log: the key is a secret).
- name: The gateway's certificate, key and CA
  ansible.builtin.set_fact:
    __serve_tls: "{{ lookup('gpufleet.fleet.gpufleet_tls', gpufleet_host.api.tls) }}"
  no_log: true
"""

RETURN = r"""
_raw:
  description: >-
    one dict: cert (PEM, the chain), key (PEM), ca (PEM or none: clients use their trust
    store), made (a new self-signed CA this run)
  type: list
  elements: dict
"""

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase

from gpufleet import tls


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        self.set_options(var_options=variables, direct=kwargs)
        if len(terms) != 1 or not isinstance(terms[0], dict):
            raise AnsibleError("gpufleet_tls: give the plan's api.tls")
        spec = terms[0]
        try:
            if not spec.get("self_signed"):
                cert, key = tls.read_site_pair(spec["cert_file"], spec["key_file"],
                                               spec["names"])
                ca = tls.read_ca(spec["ca_file"]) if spec.get("ca_file") else None
                return [{"cert": cert, "key": key, "ca": ca, "made": False}]
            host = (self.get_option("on_host_cert"), self.get_option("on_host_key"))
            pair = tls.ensure_self_signed(spec["cert_file"], spec["key_file"],
                                          list(spec["names"]),
                                          on_host=host if all(host) else None)
            return [{**pair, "ca": pair["cert"]}]
        except tls.TLSError as exc:
            raise AnsibleError(f"gpufleet: {exc}") from None
