#!/usr/bin/env python3
"""What the health checker's GPU reads would cost through NVML (ctypes, stdlib only)
instead of `nvidia-smi -q -x`: CPU and wall time of one pass over every GPU (uncorrected
ECC, clock event reasons, PCIe width and generation, NVLink state of each link), and of
nvmlInit alone. Prints one JSON document. Run it on a real GPU host.

    python3 bench/nvml_cost.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

NVML_NVLINK_MAX_LINKS = 18


class FabricInfo(ctypes.Structure):
    """nvmlGpuFabricInfo_t: clusterUuid[16], status (an nvmlReturn_t), cliqueId, state."""
    _fields_ = [("clusterUuid", ctypes.c_char * 16), ("status", ctypes.c_int),
                ("cliqueId", ctypes.c_uint), ("state", ctypes.c_ubyte)]


def nvml():
    lib = ctypes.CDLL("libnvidia-ml.so.1")

    def call(name, *args):
        rc = getattr(lib, name)(*args)
        return rc

    return lib, call


def one_pass(lib, call):
    """Every GPU once; returns the values read (so nothing is optimized away)."""
    count = ctypes.c_uint()
    call("nvmlDeviceGetCount_v2", ctypes.byref(count))
    seen = []
    for index in range(count.value):
        handle = ctypes.c_void_p()
        call("nvmlDeviceGetHandleByIndex_v2", index, ctypes.byref(handle))
        ecc = ctypes.c_ulonglong()
        # NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1, NVML_VOLATILE_ECC = 0
        call("nvmlDeviceGetTotalEccErrors", handle, 1, 0, ctypes.byref(ecc))
        reasons = ctypes.c_ulonglong()
        call("nvmlDeviceGetCurrentClocksEventReasons", handle, ctypes.byref(reasons))
        width, gen = ctypes.c_uint(), ctypes.c_uint()
        call("nvmlDeviceGetCurrPcieLinkWidth", handle, ctypes.byref(width))
        call("nvmlDeviceGetCurrPcieLinkGeneration", handle, ctypes.byref(gen))
        corr, unc, pending, failed = (ctypes.c_uint() for _ in range(4))
        call("nvmlDeviceGetRemappedRows", handle, ctypes.byref(corr), ctypes.byref(unc),
             ctypes.byref(pending), ctypes.byref(failed))
        temp = ctypes.c_uint()
        call("nvmlDeviceGetTemperature", handle, 0, ctypes.byref(temp))  # NVML_TEMPERATURE_GPU
        max_width, max_gen = ctypes.c_uint(), ctypes.c_uint()
        call("nvmlDeviceGetMaxPcieLinkWidth", handle, ctypes.byref(max_width))
        call("nvmlDeviceGetMaxPcieLinkGeneration", handle, ctypes.byref(max_gen))
        fabric = FabricInfo()
        fabric_rc = call("nvmlDeviceGetGpuFabricInfo", handle, ctypes.byref(fabric))
        links = []
        for link in range(NVML_NVLINK_MAX_LINKS):
            state = ctypes.c_uint()
            rc = call("nvmlDeviceGetNvLinkState", handle, link, ctypes.byref(state))
            if rc == 0:
                links.append(state.value)
        seen.append((ecc.value, reasons.value, width.value, gen.value, sum(links), len(links),
                     corr.value, unc.value, pending.value, failed.value, temp.value,
                     max_width.value, max_gen.value, fabric_rc, fabric.state, fabric.status,
                     fabric.cliqueId))
    return seen


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    lib, call = nvml()
    cpu, wall = time.process_time(), time.monotonic()
    rc = call("nvmlInit_v2")
    init = {"rc": rc, "cpu_ms": (time.process_time() - cpu) * 1000,
            "wall_ms": (time.monotonic() - wall) * 1000}
    cpus, walls, seen = [], [], None
    for _ in range(args.rounds):
        cpu, wall = time.process_time(), time.monotonic()
        seen = one_pass(lib, call)
        cpus.append((time.process_time() - cpu) * 1000)
        walls.append((time.monotonic() - wall) * 1000)
    call("nvmlShutdown")
    print(json.dumps({"init": init, "pass_cpu_ms_median": statistics.median(cpus),
                      "pass_wall_ms_median": statistics.median(walls),
                      "gpus": [{"ecc_volatile_uncorrected": g[0], "clock_event_reasons": g[1],
                                "pcie_width": g[2], "pcie_gen": g[3], "nvlink_active": g[4],
                                "nvlink_links": g[5], "remapped_correctable": g[6],
                                "remapped_uncorrectable": g[7], "remap_pending": g[8],
                                "remap_failed": g[9], "temperature_c": g[10],
                                "pcie_width_max": g[11], "pcie_gen_max": g[12],
                                "fabric_rc": g[13], "fabric_state": g[14],
                                "fabric_status": g[15], "fabric_clique": g[16]}
                               for g in seen]}, indent=1))


if __name__ == "__main__":
    main()
