#!/usr/bin/env python3
"""Checkpoint cache benchmark, one run against the lab mirror on loopback.

1. Throughput of gpufleet/host/cache_fetch.py (metadata, lock, staging, ranges, SHA-256
   of every byte, manifest) versus a raw urllib copy of the same files from the same
   mirror, with the same number of parallel streams. Two raw copies: a plain one, and one
   that updates a SHA-256 with every 1 MiB read in the same loop and checks it at the end,
   which is the ceiling for a client that verifies what it writes. The main ratio is cache_fetch to
   that hashing copy (goal >= 0.9); the ratio to the plain copy is kept too.
2. CPU seconds per GiB of cache_fetch (user + system of its processes, from
   RUSAGE_CHILDREN around each run; goal <= 1.5).
3. Bytes pulled from the mirror when 1 fetcher and when 4 concurrent fetchers (as if on
   4 hosts) fill one shared cache directory (goal: the same bytes, 1x).
4. One fetch host against two (--host-mib R per client address, each "host" on its own
   loopback source address): two shares at once then the completing whole run, as the
   cache role runs cache_fetch_hosts: 2 (goal >= 1.7x, bytes from the mirror 1x).

    python bench/cache_bench.py [--shard-mib 160] [--extra-shards 5] [--workers 4] [--rounds 3]
                                [--rate-limit-mib R] [--host-mib R] [--out bench/results/cache.json]

The copies and cache_fetch take turns for --rounds rounds (fresh directories each time);
the ratios are of their medians, so one noisy second does not decide it.

--rate-limit-mib R starts the mirror with a limit of R MiB/s per client address (all the
streams here come from 127.0.0.1, so they share it, as one host shares its link); the
rates are then also given as a share of R, to see whether each client fills the link.

The mirror runs in its own process, so it does not share a GIL with the clients.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "gpufleet" / "host" / "cache_fetch.py"
REPO = "zai-org/GLM-5.3-Flash"
MIB = 1024 * 1024
GIB = 1024 * MIB


def start_mirror(shard_mib: float, rate_limit_mib: float = 0.0, extra_shards: int = 0):
    """The mirror: the repo's 3 shards of ``shard_mib`` and ``extra_shards`` more like them
    (a real checkpoint has dozens: what the fetch hosts split is files)."""
    cmd = [sys.executable, "-m", "gpufleet_lab.hfmirror", "--port", "0", "--repo", REPO,
           "--shard-mib", str(shard_mib)]
    for i in range(extra_shards):
        cmd += ["--extra-file", f"{REPO}:zz-shard-{i + 1:02d}.safetensors={shard_mib:g}"]
    if rate_limit_mib:
        cmd += ["--rate-limit-mib", str(rate_limit_mib), "--rate-limit-per", "client"]
    proc = subprocess.Popen(cmd, cwd=ROOT / "lab", stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    line = proc.stderr.readline()
    match = re.search(r"on (http://\S+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"mirror did not start: {line}")
    # its access log goes on: read it, or the mirror blocks once the pipe is full
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    return proc, match.group(1)


def admin(url: str, path: str, method: str = "GET") -> dict:
    req = urllib.request.Request(f"{url}/_admin/{path}", method=method)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def engine_files(url: str) -> list[tuple[str, int, str | None]]:
    """(path, size, SHA-256 if the file is in LFS) of the files cache_fetch downloads."""
    with urllib.request.urlopen(f"{url}/api/models/{REPO}?blobs=true", timeout=30) as resp:
        info = json.loads(resp.read())
    keep = re.compile(r"(config\.json|generation_config\.json|tokenizer.*|.*\.safetensors"
                      r"|.*\.safetensors\.index\.json)$")
    return [(s["rfilename"], s["size"], (s.get("lfs") or {}).get("sha256"))
            for s in info["siblings"] if keep.fullmatch(s["rfilename"])]


def raw_copy(url: str, files: list[tuple[str, int, str | None]], dest: Path, workers: int,
             verify: bool = False) -> float:
    """Seconds to copy ``files`` with ``workers`` streams; ``verify`` also hashes each 1 MiB
    read in the same loop and checks the SHA-256 at the end (hashlib lets go of the GIL, so
    the streams hash in parallel as separate processes would)."""
    def one(item):
        path, _, sha256 = item
        digest = hashlib.sha256() if verify else None
        with urllib.request.urlopen(f"{url}/{REPO}/resolve/main/{path}", timeout=60) as resp, \
                open(dest / path.replace("/", "_"), "wb") as out:
            while chunk := resp.read(MIB):
                out.write(chunk)
                if digest is not None:
                    digest.update(chunk)
        if digest is not None and sha256 and digest.hexdigest() != sha256:
            raise SystemExit(f"raw copy: {path} does not match its SHA-256")

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, files))
    return time.monotonic() - start


def copy_round(url: str, files, dest: Path, workers: int, verify: bool) -> tuple[float, int]:
    """One raw copy into a fresh directory: seconds and bytes the mirror sent."""
    dest.mkdir()
    admin(url, "reset", "POST")
    secs = raw_copy(url, files, dest, workers, verify)
    sent = admin(url, "stats")["bytes_sent"]
    shutil.rmtree(dest)
    return secs, sent


def children_cpu() -> float:
    """User + system seconds of the child processes waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def fetchers(url: str, cache: Path, count: int, workers: int,
             extra: list[list[str]] | None = None) -> tuple[float, float, list[dict]]:
    """Wall seconds, CPU seconds (all ``count`` processes) and each one's JSON summary;
    ``extra``: more arguments for each process."""
    cmd = [sys.executable, str(SCRIPT), "--repo", REPO, "--cache-dir", str(cache), "--endpoint",
           url, "--workers", str(workers), "--json", "--progress-interval", "3600"]
    # only these processes end while it runs (the mirror is reaped at the very end), so the
    # RUSAGE_CHILDREN difference is their CPU time
    cpu = children_cpu()
    start = time.monotonic()
    procs = [subprocess.Popen(cmd + (extra[i] if extra else []), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for i in range(count)]
    outs = [p.communicate() for p in procs]
    secs = time.monotonic() - start
    cpu = children_cpu() - cpu
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"cache_fetch failed ({p.returncode}): {err}")
    return secs, cpu, [json.loads(out) for out, _ in outs]


def fetch_hosts(url: str, tmp: Path, workers: int, host_mib: float) -> dict:
    """One fetch host against two, on a mirror that sends each client address at most
    ``host_mib`` MiB/s (a host's link): each "host" is its own loopback source address.
    Two hosts: a share each at once (--share 1/2, 2/2), then the whole run that completes
    the manifest (as the cache role runs them)."""
    admin(url, f"rate?mib={host_mib}&per=client", "POST")
    try:
        admin(url, "reset", "POST")
        one_s, _, _ = fetchers(url, tmp / "host1", 1, workers, [["--source-address", "127.0.0.2"]])
        one_bytes = admin(url, "stats")["bytes_sent"]
        admin(url, "reset", "POST")
        shares_s, _, shares = fetchers(url, tmp / "host2", 2, workers, [
            ["--source-address", f"127.0.0.{i + 1}", "--share", f"{i}/2"] for i in (1, 2)])
        final_s, _, final = fetchers(url, tmp / "host2", 1, workers,
                                     [["--source-address", "127.0.0.2"]])
        two_bytes = admin(url, "stats")["bytes_sent"]
    finally:
        admin(url, "rate?mib=0", "POST")
    two_s = shares_s + final_s
    return {"measured": True, "mib_s_per_host": host_mib,
            "one_host": {"seconds": round(one_s, 2), "bytes_from_mirror": one_bytes},
            "two_hosts": {"seconds": round(two_s, 2), "shares_seconds": round(shares_s, 2),
                          "completing_run_seconds": round(final_s, 2),
                          "bytes_from_mirror": two_bytes,
                          "downloaded_by": [s["bytes_downloaded"] for s in shares]
                          + [final[0]["bytes_downloaded"]]},
            "speedup": round(one_s / two_s, 3)}


def per_gib(cpu_s: float, nbytes: int) -> float | None:
    return round(cpu_s / (nbytes / GIB), 3) if nbytes else None


def goal(value, text: str, met: bool) -> dict:
    return {"value": value, "goal": text, "met": met}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shard-mib", type=float, default=160.0)
    p.add_argument("--extra-shards", type=int, default=5,
                   help="shards beyond the repo's 3, each of --shard-mib")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate-limit-mib", type=float, default=0.0, metavar="R",
                   help="the mirror sends at most R MiB/s to each client address (default: "
                        "no limit)")
    p.add_argument("--host-mib", type=float, default=100.0, metavar="R",
                   help="the fetch-host measure's link: R MiB/s per client address")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "cache.json"))
    args = p.parse_args(argv)

    mirror, url = start_mirror(args.shard_mib, args.rate_limit_mib, args.extra_shards)
    try:
        files = engine_files(url)
        total = sum(size for _, size, _ in files)
        with tempfile.TemporaryDirectory(prefix="cache-bench-") as tmp:
            tmp = Path(tmp)
            raw_times, hashed_times, one_times, one_cpus = [], [], [], []
            for r in range(args.rounds):
                secs, raw_bytes = copy_round(url, files, tmp / f"raw{r}", args.workers, False)
                raw_times.append(secs)
                secs, hashed_bytes = copy_round(url, files, tmp / f"sha{r}", args.workers, True)
                hashed_times.append(secs)

                admin(url, "reset", "POST")
                secs, cpu, one = fetchers(url, tmp / f"one{r}", 1, args.workers)
                one_times.append(secs)
                one_bytes = admin(url, "stats")["bytes_sent"]
                one_cpus.append(cpu / (one_bytes / GIB))
                if r < args.rounds - 1:
                    shutil.rmtree(tmp / f"one{r}")
            raw_s, one_s = statistics.median(raw_times), statistics.median(one_times)
            hashed_s = statistics.median(hashed_times)
            cpu_per_gib = statistics.median(one_cpus)
            last = tmp / f"one{args.rounds - 1}"

            admin(url, "reset", "POST")
            four_s, four_cpu, four = fetchers(url, tmp / "four", 4, args.workers)
            four_bytes = admin(url, "stats")["bytes_sent"]

            admin(url, "reset", "POST")
            rerun_s, _, _ = fetchers(url, last, 1, args.workers)
            rerun_bytes = admin(url, "stats")["bytes_sent"]

            hosts = fetch_hosts(url, tmp, args.workers, args.host_mib)
    finally:
        mirror.terminate()
        mirror.wait()

    raw_rate = raw_bytes / MIB / raw_s
    hashed_rate = hashed_bytes / MIB / hashed_s
    fetch_rate = one_bytes / MIB / one_s
    ratio = fetch_rate / hashed_rate
    limit = args.rate_limit_mib

    def measure(secs, rate, nbytes, each):
        out = {"seconds": round(secs, 2), "mib_s": round(rate, 1), "bytes_from_mirror": nbytes,
               "seconds_each_round": [round(t, 2) for t in each]}
        if limit:
            out["share_of_rate_limit"] = round(rate / limit, 3)
        return out

    result = {
        "repo": REPO, "files": len(files), "total_mib": round(total / MIB, 1),
        "shard_mib": args.shard_mib, "workers": args.workers, "rounds": args.rounds,
        "rate_limit": {"mib_s": limit, "per": "client"} if limit else None,
        "raw_http": measure(raw_s, raw_rate, raw_bytes, raw_times),
        "raw_http_sha256": measure(hashed_s, hashed_rate, hashed_bytes, hashed_times),
        "cache_fetch": {**measure(one_s, fetch_rate, one_bytes, one_times),
                        "cpu_s_per_gib": round(cpu_per_gib, 3),
                        "cpu_s_per_gib_each_round": [round(c, 3) for c in one_cpus],
                        "bytes_hashed_in_flight": one[0].get("bytes_hashed_in_flight")},
        "ratio_cache_fetch_to_hashing_raw": round(ratio, 3),
        "ratio_cache_fetch_to_raw": round(fetch_rate / raw_rate, 3),
        "fetchers_1": {"bytes_from_mirror": one_bytes, "seconds": round(one_s, 2)},
        "fetchers_4": {"bytes_from_mirror": four_bytes, "seconds": round(four_s, 2),
                       "downloaded_by": [s["bytes_downloaded"] for s in four],
                       "cpu_s_per_gib": per_gib(four_cpu, four_bytes)},
        "rerun_complete_cache": {"seconds": round(rerun_s, 2), "bytes_from_mirror": rerun_bytes},
        "fetch_hosts": hosts,
        "goals": {
            "ratio_cache_fetch_to_hashing_raw": goal(round(ratio, 3), ">= 0.9", ratio >= 0.9),
            "cache_fetch_cpu_s_per_gib": goal(round(cpu_per_gib, 3), "<= 1.5",
                                              cpu_per_gib <= 1.5),
            "bytes_from_mirror_4_fetchers_over_1": goal(round(four_bytes / one_bytes, 3),
                                                        "== 1.0", four_bytes == one_bytes),
            "fetch_hosts_2_over_1": goal(hosts["speedup"], ">= 1.7", hosts["speedup"] >= 1.7),
            "bytes_from_mirror_2_hosts_over_1": goal(
                round(hosts["two_hosts"]["bytes_from_mirror"]
                      / hosts["one_host"]["bytes_from_mirror"], 3), "== 1.0",
                hosts["two_hosts"]["bytes_from_mirror"] == hosts["one_host"]["bytes_from_mirror"]),
        },
        "note": "cache_fetch seconds include process start, metadata, lock, staging and "
                "SHA-256 verification of every file (taken while the bytes are written); "
                "raw_http is a plain copy without checks, raw_http_sha256 hashes each read "
                "in the same loop and checks the SHA-256 (the ceiling for a verifying "
                "client); cpu_s_per_gib is user+system of the cache_fetch processes per GiB "
                "from the mirror, process start included (small runs overstate it); medians "
                "of the rounds",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    link = f"mirror limited to {limit:g} MiB/s per client" if limit else "no rate limit"

    def share(rate: float) -> str:
        return f"  {rate / limit:6.1%} of the limit" if limit else ""

    print(f"{len(files)} files, {total / MIB:.1f} MiB, {args.workers} streams, loopback, {link}")
    print(f"raw HTTP copy      {raw_rate:8.1f} MiB/s  ({raw_s:.2f} s){share(raw_rate)}")
    print(f"raw copy + SHA-256 {hashed_rate:8.1f} MiB/s  ({hashed_s:.2f} s){share(hashed_rate)}")
    print(f"cache_fetch        {fetch_rate:8.1f} MiB/s  ({one_s:.2f} s, verified)"
          f"{share(fetch_rate)}")
    print(f"ratio to raw + SHA-256 {ratio:6.3f}  (goal >= 0.9; to the plain copy "
          f"{fetch_rate / raw_rate:.3f})")
    print(f"cache_fetch CPU    {cpu_per_gib:8.3f} s/GiB  (goal <= 1.5; 4 fetchers: "
          f"{per_gib(four_cpu, four_bytes)} s/GiB)")
    print(f"bytes from mirror  1 fetcher: {one_bytes}  4 fetchers: {four_bytes}  "
          f"(x{four_bytes / one_bytes:.2f})")
    print(f"re-run on a complete cache: {rerun_s:.2f} s, {rerun_bytes} bytes")
    print(f"fetch hosts at {args.host_mib:g} MiB/s each: 1 host {hosts['one_host']['seconds']} s, "
          f"2 hosts {hosts['two_hosts']['seconds']} s (x{hosts['speedup']}, goal >= 1.7); "
          f"bytes from mirror {hosts['one_host']['bytes_from_mirror']} / "
          f"{hosts['two_hosts']['bytes_from_mirror']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
