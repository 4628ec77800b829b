#!/usr/bin/python
# Copyright: gpufleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: GPU, NVLink fabric and RDMA facts for gpufleet."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_facts
short_description: Gather GPU, NVLink fabric and InfiniBand facts
description:
  - Runs the vendor tools that are present on the host (C(nvidia-smi), C(nv-fabricmanager),
    C(nvidia-imex-ctl), C(amd-smi) or C(rocm-smi), C(ibv_devinfo) or C(ibstat), C(lsmod)) and
    reads C(/proc/driver/nvidia/version) and C(/opt/rocm/.info/version).
  - On NVIDIA hosts it also looks for the NVSwitches the host owns (C(/dev/nvidia-nvswitchN),
    NVSwitch PCI functions) and decides where the NVLink fabric is managed
    (C(gpufleet_gpu.fabric_manager)), from them and the GPUs' fabric state.
  - Parses their output with gpufleet's one parser (module_utils C(gpu_facts)) and returns
    C(gpufleet_gpu) and C(gpufleet_ib) as facts.
  - Read-only; never changes anything, so it runs unchanged in check mode.
  - A tool that is missing or fails leaves its part of the facts empty and adds a line to
    C(gpufleet_gpu.errors); the module itself only fails on bad arguments.
version_added: "0.1.0"
author: gpufleet contributors
options:
  collect:
    description:
      - What to gather. C(gpu) is the device inventory (C(nvidia-smi -q -x) and
        C(--query-gpu), or the ROCm tools); the others add to it.
    type: list
    elements: str
    choices: [gpu, topology, nvlink, fabric_manager, imex, ib]
    default: [gpu, topology, nvlink, fabric_manager, imex, ib]
  timeout:
    description: Seconds each tool may run before it is abandoned (needs C(timeout) on the host).
    type: int
    default: 60
  proc_driver_version:
    description: Where the NVIDIA kernel module reports its version.
    type: path
    default: /proc/driver/nvidia/version
  rocm_version_file:
    description: Where the ROCm installation records its version.
    type: path
    default: /opt/rocm/.info/version
  dev_dir:
    description: Where the NVSwitch device nodes (C(nvidia-nvswitchN)) are looked for.
    type: path
    default: /dev
  pci_devices_dir:
    description: Where NVSwitch PCI functions (vendor 0x10de, class 0x0680) are looked for.
    type: path
    default: /sys/bus/pci/devices
  apt_lists:
    description: The pattern of apt's package lists (counted for C(gpufleet_machine)).
    type: str
    default: /var/lib/apt/lists/*_Packages*
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
  facts:
    support: full
"""

EXAMPLES = r"""
# Preflight: everything in one round trip (GPUs, topology, NVLink, fabric manager, IMEX,
# HCAs), plus the CPU architecture and apt's package lists. check_mode: false keeps the
# facts fresh in a dry run too (the module changes nothing).
- name: GPUs, fabric, HCAs, CPU architecture, apt's lists
  gpufleet.fleet.gpu_facts:
    timeout: "{{ preflight_tool_timeout }}"
  check_mode: false

# After the driver role changed packages: the device inventory alone, read by the next
# task as ansible_facts.gpufleet_gpu (driver_version, kernel_module, persistence_mode).
- name: GPU facts now
  gpufleet.fleet.gpu_facts:
    collect: [gpu]
    timeout: "{{ nvidia_driver_tool_timeout }}"
  check_mode: false

# The RDMA role's check: ansible_facts.gpufleet_ib.all_active says every HCA has an
# Active port, .peermem_loaded that nvidia_peermem is loaded.
- name: HCAs and modules now
  gpufleet.fleet.gpu_facts:
    collect: [ib]
    timeout: "{{ rdma_tool_timeout }}"
  check_mode: false

# IMEX: poll until every peer of the NVLink domain is connected.
- name: Every peer connected (nvidia-imex-ctl -N)
  gpufleet.fleet.gpu_facts:
    collect: [gpu, imex]
    timeout: "{{ imex_tool_timeout }}"
  register: __imex_facts
  check_mode: false
  until: __imex_facts.ansible_facts.gpufleet_gpu.imex.all_connected | default(false)
  retries: "{{ (imex_connect_timeout | int / 5) | round(0, 'ceil') | int }}"
  delay: 5
  failed_when: false
"""

RETURN = r"""
ansible_facts:
  description: Facts added to the host.
  returned: always
  type: complex
  contains:
    gpufleet_machine:
      description:
        - C(cpu_arch) (uname -m) and C(apt_package_lists) (how many package lists apt has;
          0 on a fresh image that cleaned them).
      returned: always
      type: dict
      sample:
        cpu_arch: x86_64
        apt_package_lists: 12
    gpufleet_gpu:
      description:
        - GPU facts. Keys are always present; unknown values are null.
        - C(present) (a GPU was found), C(vendor) nvidia|amd|null, C(count), C(model), C(arch)
          (hopper, blackwell, cdna3, cdna4), C(compute_capability) (NVIDIA, for example
          C(9.0)), C(gfx_target) (AMD, for example C(gfx950)), C(memory_mib) (smallest GPU),
          C(driver_version),
          C(cuda_version), C(rocm_version), C(kernel_module) (from /proc/driver/nvidia/version),
          C(persistence_mode), C(ecc_mode), C(mig_mode), C(ecc_errors), C(fabric) (state,
          status, clique_id, cluster_uuid, completed, ok (every GPU Completed and Success),
          supported), C(nvswitches) (device nodes and PCI functions of the NVSwitches this host
          owns), C(fabric_manager) (where the NVLink fabric is managed, C(local) where the
          host owns NVSwitches, C(external) where it sees none but the GPUs report a fabric
          state (a VM on a shared NVSwitch system, NVLink switch trays), C(none) without a
          fabric; null on AMD), C(topology) (gpus, nics,
          matrix, affinity, gpu_link such as C(NV18)), C(nvlink) (per-GPU links),
          C(fabric_manager_version), C(fabric_manager_matches_driver), C(imex) (domain_state,
          nodes, connectivity, all_connected), C(gpus) (one dict per device), C(errors).
      returned: always
      type: dict
      sample:
        present: true
        vendor: nvidia
        count: 8
        model: NVIDIA H200
        arch: hopper
        compute_capability: "9.0"
        memory_mib: 143771
        driver_version: 580.159.04
        cuda_version: "13.0"
        persistence_mode: true
        ecc_mode: true
        mig_mode: false
        fabric: {state: Completed, status: Success, completed: true, ok: true}
        nvswitches: [/dev/nvidia-nvswitch0, /dev/nvidia-nvswitch1]
        fabric_manager: local
        fabric_manager_version: 580.159.04
    gpufleet_ib:
      description:
        - InfiniBand/RoCE HCAs from C(ibv_devinfo) (or C(ibstat)) and kernel modules.
        - C(present), C(count), C(hcas) (name, fw_ver, ports with state and link_layer),
          C(active) (names of HCAs with an Active port), C(all_active), C(link_layers),
          C(peermem_loaded), C(modules).
      returned: always
      type: dict
      sample:
        present: true
        count: 8
        active: [mlx5_0, mlx5_1]
        all_active: true
        link_layers: [InfiniBand]
        peermem_loaded: false
"""

import glob  # noqa: E402 (Ansible modules keep DOCUMENTATION first)
import os  # noqa: E402
import platform  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpu_facts import (
    find_nvswitches,
    gpu_facts,
    ib_facts,
)  # noqa: E402

ALL = ["gpu", "topology", "nvlink", "fabric_manager", "imex", "ib"]
QUERY = (
    "--query-gpu=index,uuid,name,pci.bus_id,memory.total,driver_version,compute_cap,"
    "persistence_mode,ecc.mode.current,mig.mode.current"
)


class Probe:
    """Runs the tools that exist; remembers what failed."""

    def __init__(self, module):
        self.module = module
        self.errors = []
        self.timeout_bin = module.get_bin_path("timeout")

    def run(self, tool, *args):
        binary = self.module.get_bin_path(tool)
        if not binary:
            return None
        cmd = [binary] + list(args)
        if self.timeout_bin:
            cmd = [self.timeout_bin, str(self.module.params["timeout"])] + cmd
        rc, out, err = self.module.run_command(
            cmd, environ_update={"LC_ALL": "C", "LANG": "C"}, check_rc=False
        )
        if rc != 0:
            message = (err or out).strip().splitlines()
            last = message[-1] if message else ""
            self.errors.append(f"{tool} {' '.join(args)}: rc={rc} {last}".strip())
            return None
        return out

    def read(self, path):
        try:
            with open(path) as handle:
                return handle.read()
        except OSError:
            return None


def gather(module):
    collect = set(module.params["collect"])
    probe = Probe(module)
    nvidia = {}
    amd = {}
    if module.get_bin_path("nvidia-smi"):
        nvidia["xml"] = probe.run("nvidia-smi", "-q", "-x")
        nvidia["query"] = probe.run("nvidia-smi", QUERY, "--format=csv,nounits")
        nvidia["proc_version"] = probe.read(module.params["proc_driver_version"])
        if "topology" in collect:
            nvidia["topo"] = probe.run("nvidia-smi", "topo", "-m")
        if "nvlink" in collect:
            nvidia["nvlink"] = probe.run("nvidia-smi", "nvlink", "-s")
        if "fabric_manager" in collect:
            nvidia["fm_version"] = probe.run("nv-fabricmanager", "--version")
        if "imex" in collect:
            nvidia["imex"] = probe.run("nvidia-imex-ctl", "-N")
        nvidia["nvswitches"] = find_nvswitches(
            module.params["dev_dir"], module.params["pci_devices_dir"]
        )
    elif module.get_bin_path("amd-smi") or module.get_bin_path("rocm-smi"):
        amd["amd_static"] = probe.run("amd-smi", "static", "--json")
        if not amd["amd_static"]:
            amd["rocm_smi"] = probe.run(
                "rocm-smi", "--showproductname", "--showmeminfo", "vram", "--json"
            )
        amd["rocm_version"] = probe.read(module.params["rocm_version_file"])
    elif os.path.exists(module.params["proc_driver_version"]):
        nvidia["proc_version"] = probe.read(module.params["proc_driver_version"])
    try:
        gpu = gpu_facts(**nvidia, **amd)
    except Exception as exc:  # a tool printed something unparseable: report, keep going
        gpu = gpu_facts()
        probe.errors.append(f"parse: {exc}")
    ib = ib_facts()
    if "ib" in collect:
        devinfo = probe.run("ibv_devinfo")
        ibstat = None if devinfo else probe.run("ibstat")
        modules = probe.run("lsmod") or probe.read("/proc/modules")
        ib = ib_facts(devinfo, ibstat, modules)
    gpu["errors"] = probe.errors
    return gpu, ib


def main():
    module = AnsibleModule(
        argument_spec={
            "collect": {"type": "list", "elements": "str", "choices": ALL, "default": ALL},
            "timeout": {"type": "int", "default": 60},
            "proc_driver_version": {"type": "path", "default": "/proc/driver/nvidia/version"},
            "rocm_version_file": {"type": "path", "default": "/opt/rocm/.info/version"},
            "dev_dir": {"type": "path", "default": "/dev"},
            "pci_devices_dir": {"type": "path", "default": "/sys/bus/pci/devices"},
            "apt_lists": {"type": "str", "default": "/var/lib/apt/lists/*_Packages*"},
        },
        supports_check_mode=True,
    )
    gpu, ib = gather(module)
    # the rest of what preflight needs from the host, in the same round trip: the CPU
    # architecture as `uname -m` says it (as every tool on the host sees it)
    uname = Probe(module).run("uname", "-m")
    machine = {"cpu_arch": uname.strip() if uname else platform.machine(),
               "apt_package_lists": len(glob.glob(module.params["apt_lists"]))}
    module.exit_json(changed=False, ansible_facts={"gpufleet_gpu": gpu, "gpufleet_ib": ib,
                                                   "gpufleet_machine": machine})


if __name__ == "__main__":
    main()
