"""Ansible lookup `gpufleet_api_key`: the deployment's API key on the controller.

Reads and checks the key file, or makes it once (atomically, 0600): with the key the
gateway host already has where one is given (`on_host`, the host's key file), so that a new
controller, another operator or a job runner with a fresh HOME keep the key clients use.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: gpufleet_api_key
short_description: the deployment's API key (read, checked, or made once)
description:
  - >-
    The key in the file named by the term, checked (gpufleet.apikey: a bearer token of at
    least 24 characters in a file not readable by group or others). Where the file does
    not exist it is written atomically: the key found in C(on_host) (the text of the
    gateway host's key file) when there is one, else a new random key.
options:
  _terms:
    description: the key file on the controller
    required: true
  on_host:
    description: the gateway host's key file (its text), or empty
    type: str
    default: ""
"""

EXAMPLES = r"""
# roles/serve: the key the gateway serves with (no_log: it is a secret).
- name: The deployment's API key, read and checked, or made once
  ansible.builtin.set_fact:
    __serve_api_key: "{{ lookup('gpufleet.fleet.gpufleet_api_key', gpufleet_host.api.key_file) }}"
  no_log: true

# Where the controller has no key file (a new clone, another operator, a job runner's
# fresh HOME), keep the key this gateway already serves with. __serve_key_on_host is the
# gateway's api-key.conf, read with ansible.builtin.slurp.
- name: Read and checked, or kept, or made once
  ansible.builtin.set_fact:
    __serve_api_key: >-
      {{ lookup('gpufleet.fleet.gpufleet_api_key', gpufleet_host.api.key_file,
                on_host=(__serve_key_on_host.content | default('') | b64decode)) }}
  no_log: true
"""

RETURN = r"""
_raw:
  description: the key
  type: list
  elements: str
"""

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase

from gpufleet import apikey


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        self.set_options(var_options=variables, direct=kwargs)
        if len(terms) != 1:
            raise AnsibleError("gpufleet_api_key: name one key file")
        try:
            found = apikey.from_gateway(self.get_option("on_host"))
            return [apikey.ensure(str(terms[0]), on_host=found)]
        except apikey.KeyFileError as exc:
            raise AnsibleError(f"gpufleet: {exc}") from None
