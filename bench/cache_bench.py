#!/usr/bin/env python3
"""Checkpoint cache benchmark, one run against the lab mirror on loopback.

1. Throughput of gpufleet/host/cache_fetch.py (huggingface_hub, staging, SHA-256 verify,
   manifest) versus a raw urllib copy of the same files from the same mirror, with the
   same number of parallel streams, and their ratio.
2. Bytes pulled from the mirror when 1 fetcher and when 4 concurrent fetchers (as if on
   4 hosts) fill one shared cache directory.

    python bench/cache_bench.py [--shard-mib 64] [--workers 4] [--rounds 3]
                                [--out bench/results/cache.json]

Raw copy and cache_fetch take turns for --rounds rounds (fresh directories each time);
the ratio is of their medians, so one noisy second does not decide it.

The mirror runs in its own process, so it does not share a GIL with the clients.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "gpufleet" / "host" / "cache_fetch.py"
REPO = "zai-org/GLM-5.3-Flash"
MIB = 1024 * 1024


def start_mirror(shard_mib: float):
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufleet_lab.hfmirror", "--port", "0", "--repo", REPO,
         "--shard-mib", str(shard_mib)],
        cwd=ROOT / "lab", stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    line = proc.stderr.readline()
    match = re.search(r"on (http://\S+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"mirror did not start: {line}")
    return proc, match.group(1)


def admin(url: str, path: str, method: str = "GET") -> dict:
    req = urllib.request.Request(f"{url}/_admin/{path}", method=method)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def engine_files(url: str) -> list[tuple[str, int]]:
    with urllib.request.urlopen(f"{url}/api/models/{REPO}?blobs=true", timeout=30) as resp:
        info = json.loads(resp.read())
    keep = re.compile(r"(config\.json|generation_config\.json|tokenizer.*|.*\.safetensors"
                      r"|.*\.safetensors\.index\.json)$")
    return [(s["rfilename"], s["size"]) for s in info["siblings"] if keep.fullmatch(s["rfilename"])]


def raw_copy(url: str, files: list[tuple[str, int]], dest: Path, workers: int) -> float:
    def one(path: str):
        with urllib.request.urlopen(f"{url}/{REPO}/resolve/main/{path}", timeout=60) as resp, \
                open(dest / path.replace("/", "_"), "wb") as out:
            while chunk := resp.read(MIB):
                out.write(chunk)

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, [p for p, _ in files]))
    return time.monotonic() - start


def fetchers(url: str, cache: Path, count: int, workers: int) -> tuple[float, list[dict]]:
    cmd = [sys.executable, str(SCRIPT), "--repo", REPO, "--cache-dir", str(cache), "--endpoint",
           url, "--workers", str(workers), "--json", "--progress-interval", "3600"]
    start = time.monotonic()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(count)]
    outs = [p.communicate() for p in procs]
    secs = time.monotonic() - start
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"cache_fetch failed ({p.returncode}): {err}")
    return secs, [json.loads(out) for out, _ in outs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shard-mib", type=float, default=64.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "cache.json"))
    args = p.parse_args(argv)

    mirror, url = start_mirror(args.shard_mib)
    try:
        files = engine_files(url)
        total = sum(size for _, size in files)
        with tempfile.TemporaryDirectory(prefix="cache-bench-") as tmp:
            tmp = Path(tmp)
            raw_times, one_times = [], []
            for r in range(args.rounds):
                (tmp / f"raw{r}").mkdir()
                admin(url, "reset", "POST")
                raw_times.append(raw_copy(url, files, tmp / f"raw{r}", args.workers))
                raw_bytes = admin(url, "stats")["bytes_sent"]
                shutil.rmtree(tmp / f"raw{r}")

                admin(url, "reset", "POST")
                secs, one = fetchers(url, tmp / f"one{r}", 1, args.workers)
                one_times.append(secs)
                one_bytes = admin(url, "stats")["bytes_sent"]
                if r < args.rounds - 1:
                    shutil.rmtree(tmp / f"one{r}")
            raw_s, one_s = statistics.median(raw_times), statistics.median(one_times)
            last = tmp / f"one{args.rounds - 1}"

            admin(url, "reset", "POST")
            four_s, four = fetchers(url, tmp / "four", 4, args.workers)
            four_bytes = admin(url, "stats")["bytes_sent"]

            admin(url, "reset", "POST")
            rerun_s, _ = fetchers(url, last, 1, args.workers)
            rerun_bytes = admin(url, "stats")["bytes_sent"]
    finally:
        mirror.terminate()
        mirror.wait()

    raw_rate = raw_bytes / MIB / raw_s
    fetch_rate = one_bytes / MIB / one_s
    result = {
        "repo": REPO, "files": len(files), "total_mib": round(total / MIB, 1),
        "shard_mib": args.shard_mib, "workers": args.workers, "rounds": args.rounds,
        "raw_http": {"seconds": round(raw_s, 2), "mib_s": round(raw_rate, 1),
                     "bytes_from_mirror": raw_bytes,
                     "seconds_each_round": [round(t, 2) for t in raw_times]},
        "cache_fetch": {"seconds": round(one_s, 2), "mib_s": round(fetch_rate, 1),
                        "bytes_from_mirror": one_bytes,
                        "seconds_each_round": [round(t, 2) for t in one_times],
                        "bytes_hashed_in_flight": one[0].get("bytes_hashed_in_flight")},
        "ratio_cache_fetch_to_raw": round(fetch_rate / raw_rate, 3),
        "fetchers_1": {"bytes_from_mirror": one_bytes, "seconds": round(one_s, 2)},
        "fetchers_4": {"bytes_from_mirror": four_bytes, "seconds": round(four_s, 2),
                       "downloaded_by": [s["bytes_downloaded"] for s in four]},
        "rerun_complete_cache": {"seconds": round(rerun_s, 2), "bytes_from_mirror": rerun_bytes},
        "note": "cache_fetch seconds include process start, metadata, lock, staging and "
                "SHA-256 verification of every file (taken while the bytes are written); raw "
                "is a plain copy without checks; medians of the rounds",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(files)} files, {total / MIB:.1f} MiB, {args.workers} streams, loopback")
    print(f"raw HTTP copy      {raw_rate:8.1f} MiB/s  ({raw_s:.2f} s)")
    print(f"cache_fetch        {fetch_rate:8.1f} MiB/s  ({one_s:.2f} s, verified)")
    print(f"ratio              {fetch_rate / raw_rate:8.3f}")
    print(f"bytes from mirror  1 fetcher: {one_bytes}  4 fetchers: {four_bytes}  "
          f"(x{four_bytes / one_bytes:.2f})")
    print(f"re-run on a complete cache: {rerun_s:.2f} s, {rerun_bytes} bytes")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
