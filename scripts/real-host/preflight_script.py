"""Run gpufleet's GPU facts parser and preflight check on a real GPU host (no Ansible).

Usage: python3 scripts/real-host/preflight_script.py REQUIREMENTS.json
REQUIREMENTS.json maps a name to a `hosts` entry of `fab plan --format json`.
Prints one line per entry and writes preflight-report.json into the directory $OUT names
(the current one without it).
Stdlib only, so it runs with the host's own python3.
"""

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpufleet" / "module_utils"))
import gpu_facts as gf  # noqa: E402
import preflight as pf  # noqa: E402


def out(*cmd):
    if not shutil.which(cmd[0]):
        return None
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout


def main():
    reqs = json.loads(Path(sys.argv[1]).read_text())
    facts = gf.gpu_facts(
        xml=out("nvidia-smi", "-q", "-x"),
        query=out("nvidia-smi", "--query-gpu=index,uuid,name,compute_cap,memory.total",
                  "--format=csv"),
        topo=out("nvidia-smi", "topo", "-m"),
        nvlink=out("nvidia-smi", "nvlink", "-s"),
        proc_version=Path("/proc/driver/nvidia/version").read_text(),
    )
    ib = gf.ib_facts(out("ibv_devinfo"), out("ibstat"), Path("/proc/modules").read_text())
    arch, free = platform.machine(), shutil.disk_usage("/").free / 2**30
    report = {"facts": facts, "ib": ib, "cpu_arch": arch, "free_gib": round(free, 1),
              "results": {}}
    for name, req in reqs.items():
        result = {"preflight": pf.check_host(req, facts, ib, arch, free),
                  "after_prepare": pf.check_prepared(req, facts, ib)}
        report["results"][name] = result
        print(name, "->", result["preflight"] or "fits",
              "| after prepare:", result["after_prepare"] or "ok")
    target = Path(os.environ.get("OUT", ".")) / "preflight-report.json"
    target.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
