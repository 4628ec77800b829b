"""gpufleet/host/cache_fetch.py run as a subprocess (real huggingface_hub) against the lab
mirror on loopback: one transfer, cheap re-runs, cuts mid-file, two concurrent fetchers, a
tampered blob, the disk-space refusal, gated repos and an unreachable endpoint."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpufleet_lab.hfmirror import Cut, MirrorServer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "gpufleet" / "host" / "cache_fetch.py"
FLASH = "zai-org/GLM-5.3-Flash"
BIG_REPO = "zai-org/GLM-5.3"
BIG = "zz-big.safetensors"  # top level, so the default file set takes it
BIG_SIZE = 24 * 1024 * 1024  # six of the 4 MiB parts the tests use: more than one window
PART_MIB = 4
PART_WINDOW_MAX = 4  # parts of one file requested before the first answers
GATED = "zai-org/GLM-5.3-BF16"
TOKEN = "hf_labGATEDcachetoken0123456789"
OTHER_TOKEN = "hf_labOTHERcachetoken0123456789"
WRONG_TOKEN = "hf_labWRONGcachetoken0123456789"
ENGINE_FILES = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors.index.json",
}

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def mirror():
    server = MirrorServer(gated={GATED: TOKEN}, tokens=[OTHER_TOKEN], log_stream=io.StringIO(),
                          repos=[FLASH, BIG_REPO, GATED])
    server.add_file(BIG_REPO, BIG, size=BIG_SIZE, lfs=True)
    with server:
        yield server


@pytest.fixture(autouse=True)
def clean(mirror):
    mirror.set_cuts([])
    mirror.stats.reset()
    yield
    mirror.lfs_redirect = mirror.ignore_ranges = False
    mirror.cdn_expired = 0


def fetch(mirror, cache, repo=FLASH, *extra, env=None, endpoint=True):
    cmd = [sys.executable, str(SCRIPT), "--repo", repo, "--cache-dir", str(cache), "--json",
           "--backoff", "0.05", "--progress-interval", "0.5", "--lock-stale", "5",
           "--part-mib", str(PART_MIB), *extra]
    if endpoint:
        cmd += ["--endpoint", mirror.url]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    full_env.update(env or {})
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env)


def run(mirror, cache, repo=FLASH, *extra, env=None, endpoint=True):
    proc = fetch(mirror, cache, repo, *extra, env=env, endpoint=endpoint)
    out, err = proc.communicate(timeout=100)
    summary = json.loads(out) if out.strip() else {}
    return proc.returncode, summary, out + err


def expected(mirror, repo) -> dict[str, object]:
    """The mirror's files that the default selection takes: path -> RepoFile."""
    files = mirror.repos[repo].files
    return {p: f for p, f in files.items() if p.endswith(".safetensors") or p in ENGINE_FILES}


def snapshot(cache, mirror, repo) -> Path:
    sha = mirror.repos[repo].sha
    return cache / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / sha


def assert_verified(cache, mirror, repo):
    snap = snapshot(cache, mirror, repo)
    want = expected(mirror, repo)
    assert sorted(p.name for p in snap.iterdir()) == sorted(want)
    for path, f in want.items():
        assert hashlib.sha256((snap / path).read_bytes()).hexdigest() == f.sha256, path
    manifest = json.loads((snap.parent.parent / f".gpufleet-manifest-{snap.name}.json")
                          .read_text())
    assert manifest["complete"] is True
    assert {e["file"]: e["sha256"] for e in manifest["files"]} == {
        p: f.sha256 for p, f in want.items()}


def total(mirror, repo) -> int:
    return sum(f.size for f in expected(mirror, repo).values())


def test_one_transfer_then_rerun_downloads_nothing_and_serves_offline(mirror, tmp_path):
    code, summary, out = run(mirror, tmp_path)
    assert code == 0, out
    assert_verified(tmp_path, mirror, FLASH)
    stats = mirror.stats.snapshot()
    assert stats["bytes_sent"] == total(mirror, FLASH) == summary["bytes_downloaded"]
    assert "README.md" not in json.dumps(stats["files"])  # only what the engine reads
    assert summary["changed"] is True and summary["complete"] is True
    assert "fetched model-00001-of-00003.safetensors" in out and "[" in out

    mirror.stats.reset()
    code, summary, out = run(mirror, tmp_path)
    assert code == 0, out
    assert mirror.stats.snapshot()["bytes_sent"] == 0
    assert summary["changed"] is False and summary["bytes_downloaded"] == 0

    # an engine with HF_HUB_OFFLINE=1 finds the snapshot through refs/main
    probe = (
        "from huggingface_hub import snapshot_download, hf_hub_download;"
        f"print(snapshot_download({FLASH!r}));"
        f"print(open(hf_hub_download({FLASH!r}, 'config.json')).read()[:1])"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_ENDPOINT": "http://127.0.0.1:9"}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [str(snapshot(tmp_path, mirror, FLASH)), "{"]


def test_files_with_the_same_content_are_fetched_once_and_both_linked(tmp_path):
    twin = os.urandom(9 * 1024 * 1024 + 5)  # more than two parts
    server = MirrorServer(log_stream=io.StringIO(), repos=[FLASH])
    for name in ("zz-twin-a.safetensors", "zz-twin-b.safetensors"):
        server.add_file(FLASH, name, twin, lfs=True)
    with server:
        code, summary, out = run(server, tmp_path)
        assert code == 0, out
        assert_verified(tmp_path, server, FLASH)
        assert server.stats.snapshot()["bytes_sent"] == total(server, FLASH) - len(twin)
        assert summary["need_bytes"] == summary["bytes_downloaded"] == total(server, FLASH) - len(
            twin)
        snap = snapshot(tmp_path, server, FLASH)
        assert (snap / "zz-twin-a.safetensors").resolve() == (
            snap / "zz-twin-b.safetensors").resolve()


def test_a_large_file_moves_in_ranges_hashed_in_order_with_progress_in_a_status_file(
        mirror, tmp_path):
    status = tmp_path / "status" / "fetch.json"
    code, summary, out = run(mirror, tmp_path / "cache", BIG_REPO, "--status-file", str(status))
    assert code == 0, out
    assert_verified(tmp_path / "cache", mirror, BIG_REPO)
    stats = mirror.stats.snapshot()
    big = stats["files"][f"{BIG_REPO}/{BIG}"]
    assert big["gets"] == BIG_SIZE // (PART_MIB * 1024 * 1024) and big["bytes"] == BIG_SIZE
    assert stats["statuses"]["206"] == big["gets"]  # every part a range; small files whole
    assert summary["bytes_hashed_in_flight"] == summary["bytes_downloaded"] == total(
        mirror, BIG_REPO)
    line = json.loads(status.read_text())
    assert line["state"] == "done" and line["bytes_done"] == line["bytes_total"] == total(
        mirror, BIG_REPO)
    assert line["files_done"] == line["files"] == len(expected(mirror, BIG_REPO))
    shown = subprocess.run([sys.executable, str(SCRIPT), "--status", str(status)],
                           capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(shown.stdout) == line


@pytest.mark.parametrize("workers", [1, 3])
def test_a_large_file_alone_fills_every_connection_and_no_more(mirror, tmp_path, workers):
    # each connection held to 40 MiB/s: a 4 MiB part takes 0.1 s, so parts fetched ahead
    # overlap the one the file's thread reads and hashes itself. The mirror counts a body
    # as sent until it has booked its last byte, which may be after its client has gone on
    # to its next request; so "no more" is shown by time: one connection cannot beat
    # 40 MiB/s, and any second one would.
    mirror.set_rate_limit(40, "connection")
    start = time.monotonic()
    try:
        code, summary, out = run(mirror, tmp_path, BIG_REPO, "--allow", BIG,
                                 "--workers", str(workers))
    finally:
        mirror.set_rate_limit(0)
    took = time.monotonic() - start
    assert code == 0, out
    stats = mirror.stats.snapshot()
    assert stats["files"][f"{BIG_REPO}/{BIG}"]["gets"] == BIG_SIZE // (PART_MIB * 1024 * 1024)
    assert summary["bytes_hashed_in_flight"] == summary["bytes_downloaded"] == BIG_SIZE
    if workers == 1:
        assert took >= 0.95 * BIG_SIZE / (40 * 1024 * 1024), "more than one connection"
    else:
        assert stats["max_streams"] >= 2, "no part was fetched ahead"


def test_status_of_a_fetch_whose_process_is_gone_or_not_started(tmp_path):
    status = tmp_path / "fetch.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    status.write_text(json.dumps({"state": "running", "pid": dead.pid,
                                  "host": socket.gethostname(), "bytes_done": 1}))

    def show():
        res = subprocess.run([sys.executable, str(SCRIPT), "--status", str(status)],
                             capture_output=True, text=True, timeout=30, check=True)
        return json.loads(res.stdout)

    assert show()["state"] == "gone"
    status.write_text(json.dumps({"state": "running", "pid": os.getpid(),
                                  "host": socket.gethostname()}))
    assert show()["state"] == "running"
    status.unlink()
    assert show() == {"state": "starting"}


def test_dry_run_reports_without_downloading_or_writing(mirror, tmp_path):
    cache = tmp_path / "cache"  # not there yet, as in check mode before the first run
    code, summary, out = run(mirror, cache, FLASH, "--dry-run")
    assert code == 0, out
    assert summary["complete"] is False and summary["to_download"] == len(expected(mirror, FLASH))
    assert summary["need_bytes"] == total(mirror, FLASH)
    assert "would download" in out
    assert mirror.stats.snapshot()["bytes_sent"] == 0
    assert not cache.exists()

    code, _, out = run(mirror, cache)
    assert code == 0, out
    blob = Path(os.path.realpath(snapshot(cache, mirror, FLASH) / "config.json"))
    blob.write_text("{}")
    mirror.stats.reset()
    code, summary, out = run(mirror, cache, FLASH, "--dry-run")
    assert code == 0, out
    assert summary["replaced"] == ["config.json"] and summary["to_download"] == 1
    assert blob.read_text() == "{}" and mirror.stats.snapshot()["bytes_sent"] == 0


class Watcher(threading.Thread):
    """Polls the snapshot folder and records any visible file whose content is wrong."""

    def __init__(self, snap: Path, files: dict):
        super().__init__(daemon=True)
        self.snap, self.files = snap, files
        self.stop = threading.Event()
        self.bad: list[str] = []
        self.seen: set[str] = set()

    def run(self):
        while not self.stop.is_set():
            for path, f in self.files.items():
                try:
                    data = (self.snap / path).read_bytes()
                except OSError:
                    continue
                self.seen.add(path)
                if hashlib.sha256(data).hexdigest() != f.sha256:
                    self.bad.append(path)
            time.sleep(0.01)


def test_interrupted_transfer_then_rerun_completes_and_no_bad_file_is_visible(mirror, tmp_path):
    cuts = 1  # with --retries 1 the first cut ends the file's only attempt
    mirror.set_cuts([Cut(f"{BIG_REPO}/{BIG}", 15 * 1024 * 1024, times=cuts, mode="close")])
    watcher = Watcher(snapshot(tmp_path, mirror, BIG_REPO), expected(mirror, BIG_REPO))
    watcher.start()
    try:
        code, summary, out = run(mirror, tmp_path, BIG_REPO, "--retries", "1")
        assert code == 1, out
        assert BIG in summary["error"] and "re-run" in summary["error"]
        assert mirror.stats.snapshot()["files"][f"{BIG_REPO}/{BIG}"]["cut"] == cuts
        assert not (snapshot(tmp_path, mirror, BIG_REPO) / BIG).exists()
        assert not list((tmp_path / "hub").rglob("*.incomplete"))
        snap = snapshot(tmp_path, mirror, BIG_REPO)
        kept = {p.name for p in snap.iterdir()} if snap.exists() else set()

        mirror.stats.reset()
        code, summary, out = run(mirror, tmp_path, BIG_REPO)
        assert code == 0, out
    finally:
        watcher.stop.set()
        watcher.join()
    assert watcher.bad == []
    assert BIG in watcher.seen
    assert_verified(tmp_path, mirror, BIG_REPO)
    # the files verified by the first run stay; only the rest moves
    rest = {p: f for p, f in expected(mirror, BIG_REPO).items() if p not in kept}
    assert sorted(summary["downloaded"]) == sorted(rest) and BIG in rest
    assert mirror.stats.snapshot()["bytes_sent"] == sum(f.size for f in rest.values())


def test_connection_reset_is_retried_with_backoff_in_the_same_run(mirror, tmp_path):
    mirror.set_cuts([Cut(f"{BIG_REPO}/{BIG}", 12 * 1024 * 1024, times=2, mode="reset")])
    code, summary, out = run(mirror, tmp_path, BIG_REPO, "--retries", "3")
    assert code == 0, out
    assert out.count(f"{BIG}: attempt") == 2 and "retrying in" in out
    assert_verified(tmp_path, mirror, BIG_REPO)


def test_two_concurrent_runs_download_each_byte_once(mirror, tmp_path):
    # slow the big file down (two cuts, 1 s and 2 s of backoff) so the runs overlap
    mirror.set_cuts([Cut(f"{BIG_REPO}/{BIG}", 15 * 1024 * 1024, times=2, mode="close")])
    procs = [fetch(mirror, tmp_path, BIG_REPO, "--backoff", "1") for _ in range(2)]
    results = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    summaries = [json.loads(out) for out, _ in results]
    assert sorted(s["bytes_downloaded"] for s in summaries) == [0, total(mirror, BIG_REPO)]
    assert any(s["lock_was_held"] for s in summaries)
    stats = mirror.stats.snapshot()
    # a cut request resumes at the byte it reached: not one byte twice
    assert stats["bytes_sent"] == total(mirror, BIG_REPO) and stats["cuts"] == 2
    assert all(entry["complete"] == 1 for entry in stats["files"].values())
    assert_verified(tmp_path, mirror, BIG_REPO)


def test_two_shares_fill_one_cache_with_each_byte_once_and_a_whole_run_completes_it(
        mirror, tmp_path):
    # two hosts, one share each, at once (on their own source addresses, as two hosts)
    procs = [fetch(mirror, tmp_path, BIG_REPO, "--share", f"{i}/2", "--source-address",
                   f"127.0.0.{i + 1}") for i in (1, 2)]
    results = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    shares = [json.loads(out) for out, _ in results]
    got = [set(s["downloaded"]) for s in shares]
    assert got[0] and got[1] and not got[0] & got[1]
    assert got[0] | got[1] == set(expected(mirror, BIG_REPO))
    assert BIG in got[0]  # the largest file opens the first share
    hub = tmp_path / "hub" / ("models--" + BIG_REPO.replace("/", "--"))
    sha = mirror.repos[BIG_REPO].sha
    assert sorted(p.name for p in hub.glob(".gpufleet-manifest-*")) == [
        f".gpufleet-manifest-{sha}.share-{i}-of-2.json" for i in (1, 2)]
    assert not (hub / "refs" / "main").exists()  # not complete until a whole run says so

    mirror.stats.reset()
    code, summary, out = run(mirror, tmp_path, BIG_REPO)
    assert code == 0, out
    assert summary["bytes_downloaded"] == 0 and summary["changed"] is False
    assert mirror.stats.snapshot()["bytes_sent"] == 0
    assert_verified(tmp_path, mirror, BIG_REPO)
    assert [p.name for p in hub.glob(".gpufleet-manifest-*")] == [f".gpufleet-manifest-{sha}.json"]


def test_a_share_that_never_ran_is_fetched_by_the_whole_run(mirror, tmp_path):
    code, first, out = run(mirror, tmp_path, BIG_REPO, "--share", "2/2")
    assert code == 0, out
    code, summary, out = run(mirror, tmp_path, BIG_REPO)
    assert code == 0, out
    assert set(summary["downloaded"]) == set(expected(mirror, BIG_REPO)) - set(first["downloaded"])
    assert mirror.stats.snapshot()["bytes_sent"] == total(mirror, BIG_REPO)
    assert_verified(tmp_path, mirror, BIG_REPO)


@pytest.mark.parametrize("share", ["0/2", "3/2", "1", "a/b"])
def test_a_bad_share_is_refused(mirror, tmp_path, share):
    code, _, out = run(mirror, tmp_path, BIG_REPO, "--share", share)
    assert code == 2 and "I/K with 1 <= I <= K" in out


def test_stale_lock_of_a_dead_process_is_broken_and_its_partial_files_removed(mirror, tmp_path):
    locks = tmp_path / "hub" / ".gpufleet-locks"
    locks.mkdir(parents=True)
    partial = tmp_path / "hub" / "models--zai-org--GLM-5.3-Flash" / ".gpufleet-staging" / "dead"
    partial.mkdir(parents=True)
    (partial / "x.incomplete").write_bytes(b"\0" * 1000)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    lock = locks / "models--zai-org--GLM-5.3-Flash.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead),
                                "nonce": "x", "heartbeat": 0}))
    code, _, out = run(mirror, tmp_path)
    assert code == 0, out
    assert "breaking stale lock" in out and not lock.exists()
    assert not partial.parent.exists()
    assert_verified(tmp_path, mirror, FLASH)


def test_lock_with_a_live_heartbeat_times_out_and_a_silent_one_is_broken(mirror, tmp_path):
    locks = tmp_path / "hub" / ".gpufleet-locks"
    locks.mkdir(parents=True)
    lock = locks / "models--zai-org--GLM-5.3-Flash.lock"
    stop = threading.Event()

    def beat():
        while not stop.is_set():
            lock.write_text(json.dumps({"host": "other-host", "pid": 1, "nonce": "y",
                                        "heartbeat": time.time()}))
            time.sleep(0.2)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        code, summary, out = run(mirror, tmp_path, FLASH, "--lock-timeout", "2",
                                 "--lock-stale", "1.5")
    finally:
        stop.set()
        beater.join()
    assert code == 7, out
    assert "waiting for the lock held by other-host pid 1" in out
    assert mirror.stats.snapshot()["bytes_sent"] == 0
    # the other host died: its heartbeat stops changing, the lock is broken after --lock-stale
    code, _, out = run(mirror, tmp_path, FLASH, "--lock-stale", "1")
    assert code == 0, out
    assert "breaking stale lock of other-host pid 1" in out


def test_a_lock_caught_while_being_written_is_named_once_it_reads_whole(mirror, tmp_path):
    # the holder creates the file, then writes it: a waiter that reads it empty in between
    # must not report "held by None pid None"
    locks = tmp_path / "hub" / ".gpufleet-locks"
    locks.mkdir(parents=True)
    lock = locks / "models--zai-org--GLM-5.3-Flash.lock"
    lock.write_bytes(b"")
    proc = fetch(mirror, tmp_path, FLASH, "--lock-timeout", "3", "--lock-stale", "60")
    time.sleep(1.0)
    lock.write_text(json.dumps({"host": "other-host", "pid": 1, "nonce": "z",
                                "heartbeat": time.time()}))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, out + err
    assert "waiting for the lock held by other-host pid 1" in err
    assert "held by None" not in err


def test_tampered_blob_is_detected_and_replaced(mirror, tmp_path):
    code, _, out = run(mirror, tmp_path)
    assert code == 0, out
    shard = "model-00002-of-00003.safetensors"
    link = snapshot(tmp_path, mirror, FLASH) / shard
    blob = Path(os.path.realpath(link))
    st = blob.stat()
    with open(blob, "r+b") as f:  # same size, same mtime: only a rehash can tell
        f.seek(4096)
        f.write(b"\0" * 64)
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))
    mirror.stats.reset()

    code, summary, out = run(mirror, tmp_path, FLASH, "--verify", "full")
    assert code == 0, out
    assert summary["replaced"] == [shard] and summary["downloaded"] == [shard]
    assert summary["changed"] is True
    assert mirror.stats.snapshot()["bytes_sent"] == mirror.repos[FLASH].files[shard].size
    assert_verified(tmp_path, mirror, FLASH)

    # an edit that changes the mtime is caught by the default fast verify too
    with open(blob, "r+b") as f:
        f.write(b"garbage")
    code, summary, out = run(mirror, tmp_path)
    assert code == 0, out
    assert summary["replaced"] == [shard]
    assert_verified(tmp_path, mirror, FLASH)


def test_small_disk_refuses_before_any_byte_moves(mirror, tmp_path):
    code, summary, out = run(mirror, tmp_path, env={"GPUFLEET_CACHE_FAKE_FREE_BYTES": "1000000"})
    assert code == 6, out
    need = total(mirror, FLASH) / 1024**3
    assert f"needs {need:.2f} GiB (+0 GiB reserve), 0.00 GiB free on {tmp_path}" in out
    assert mirror.stats.snapshot()["bytes_sent"] == 0
    assert not snapshot(tmp_path, mirror, FLASH).exists()

    code, summary, out = run(mirror, tmp_path, FLASH, "--min-free-gib", "1000000")
    assert code == 6 and "+1e+06 GiB reserve" in out, out
    assert mirror.stats.snapshot()["bytes_sent"] == 0


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({}, "is gated and no token was given"),
        ({"HF_TOKEN": WRONG_TOKEN}, "refused the token (HTTP 401"),
        ({"HF_TOKEN": OTHER_TOKEN}, "the token has no access to the gated repo"),
    ],
    ids=["no-token", "unknown-token", "token-without-access"],
)
def test_gated_repo_refuses_clearly_and_never_prints_the_token(mirror, tmp_path, env, words):
    code, summary, out = run(mirror, tmp_path, GATED, env={**env, "HF_DEBUG": "1"})
    assert code == 3, out
    assert words in out
    assert "set HF_TOKEN on the controller or gpufleet_hf_token in ansible-vault" in out
    for token in (TOKEN, OTHER_TOKEN, WRONG_TOKEN):
        assert token not in out
    assert mirror.stats.snapshot()["bytes_sent"] == 0


def test_gated_repo_with_the_right_token_from_a_file(mirror, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    code, summary, out = run(mirror, tmp_path / "cache", GATED, "--token-file", str(token_file),
                             env={"HF_DEBUG": "1"})
    assert code == 0, out
    assert TOKEN not in out
    assert_verified(tmp_path / "cache", mirror, GATED)


def test_gated_files_redirected_to_a_cdn_get_the_token_only_at_the_hub(mirror, tmp_path):
    # as on the Hub: an LFS file's resolve answers 302 to a CDN host with a signed link
    mirror.lfs_redirect = True
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    code, summary, out = run(mirror, tmp_path / "cache", GATED, "--token-file", str(token_file))
    assert code == 0, out
    assert_verified(tmp_path / "cache", mirror, GATED)
    stats = mirror.stats.snapshot()
    lfs = [p for p, f in expected(mirror, GATED).items() if f.lfs]
    assert lfs and stats["cdn_requests"] >= len(lfs)
    assert stats["cdn_requests_with_authorization"] == 0


def test_a_cdn_link_that_expired_is_resolved_again(mirror, tmp_path):
    mirror.lfs_redirect = True
    mirror.cdn_expired = 1
    code, summary, out = run(mirror, tmp_path, BIG_REPO, "--workers", "1")
    assert code == 0, out
    assert "LinkRefused" in out and "answered HTTP 403" in out
    assert mirror.cdn_expired == 0
    assert_verified(tmp_path, mirror, BIG_REPO)


def test_a_server_that_ignores_ranges_gets_each_file_in_one_stream(mirror, tmp_path):
    mirror.ignore_ranges = True
    code, summary, out = run(mirror, tmp_path, BIG_REPO)
    assert code == 0, out
    assert "ignores byte ranges; taking the file in one stream" in out
    assert_verified(tmp_path, mirror, BIG_REPO)
    big = mirror.stats.snapshot()["files"][f"{BIG_REPO}/{BIG}"]
    # the first part's request got the whole file and was dropped; then one stream
    assert big["complete"] >= 1 and big["gets"] <= 1 + PART_WINDOW_MAX


def test_unreachable_endpoint_names_the_setting(mirror, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, summary, out = run(mirror, tmp_path, FLASH, endpoint=False,
                             env={"HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    assert code == 5, out
    assert f"cannot reach http://127.0.0.1:{port}" in out
    assert "check HF_ENDPOINT / gpufleet_hf_endpoint" in out
    assert "Traceback" not in out


def test_unknown_repo_and_revision(mirror, tmp_path):
    code, _, out = run(mirror, tmp_path, "zai-org/GLM-9")
    assert code == 4 and "repo zai-org/GLM-9 not found" in out, out
    code, _, out = run(mirror, tmp_path, FLASH, "--revision", "v0.0-nope")
    assert code == 4 and "gpufleet_model_revision" in out, out


@pytest.mark.parametrize(("repo", "extra", "env", "code", "words"), [
    (GATED, (), {}, 3, "is gated and no token was given"),
    (GATED, (), {"HF_TOKEN": WRONG_TOKEN}, 3, "refused the token"),
    (FLASH, ("--revision", "v0.0-nope"), {}, 4, "gpufleet_model_revision"),
    (GATED, (), {"HF_TOKEN": TOKEN}, 0, "readable"),
    (FLASH, (), {}, 0, "readable"),
], ids=["gated-no-token", "wrong-token", "bad-revision", "gated-ok", "open-ok"])
def test_access_only_checks_without_writing_or_downloading(mirror, tmp_path, repo, extra, env,
                                                           code, words):
    """What preflight runs on the controller: one header, never a weight byte, no file."""
    cache = tmp_path / "cache"
    got, _summary, out = run(mirror, cache, repo, "--access-only", *extra, env=env)
    assert got == code, out
    assert words in out
    assert not cache.exists()
    assert mirror.stats.snapshot()["bytes_sent"] == 0
    for token in (TOKEN, WRONG_TOKEN):
        assert token not in out


def test_a_rerun_on_a_complete_cache_rewrites_no_file(mirror, tmp_path):
    """Not even the manifest or the ref: a re-deploy leaves the shared cache as it was."""
    code, _, out = run(mirror, tmp_path, FLASH)
    assert code == 0, out
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if not p.is_dir()}
    time.sleep(0.05)
    code, summary, out = run(mirror, tmp_path, FLASH)
    assert code == 0 and summary["changed"] is False, out
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if not p.is_dir()}
    assert after == before


def test_bytes_damaged_in_transit_are_caught_and_fetched_again(mirror, tmp_path):
    # the hash is taken while the file is written: a flipped byte late in the file must
    # still fail verification, be retried, and never reach blobs/ or the snapshot
    mirror.set_cuts([Cut(glob=f"{BIG_REPO}/{BIG}", after_bytes=BIG_SIZE - 10, mode="flip")])
    code, _summary, out = run(mirror, tmp_path, BIG_REPO)
    assert code == 0, out
    assert "downloaded bytes do not match the Hub's hash" in out
    # the whole file again (its parts were hashed as they landed; the last one was bad)
    parts = BIG_SIZE // (PART_MIB * 1024 * 1024)
    assert mirror.stats.snapshot()["files"][f"{BIG_REPO}/{BIG}"]["gets"] == 2 * parts
    assert_verified(tmp_path, mirror, BIG_REPO)


def test_bytes_damaged_on_every_attempt_fail_and_leave_nothing_visible(mirror, tmp_path):
    mirror.set_cuts([Cut(glob=f"{BIG_REPO}/{BIG}", after_bytes=5, times=3, mode="flip")])
    code, _, out = run(mirror, tmp_path, BIG_REPO, "--retries", "3")
    assert code == 1, out
    assert f"{BIG}: downloaded bytes do not match the Hub's hash" in out
    assert not list(tmp_path.rglob(BIG)), "a damaged file is visible in the snapshot"
    blobs = next(tmp_path.glob("hub/models--*--GLM-5.3/blobs"), None)
    assert blobs is None or not any(p.name == mirror.repos[BIG_REPO].files[BIG].blob.sha256
                                    for p in blobs.iterdir())


def _follow(tmp_path, writes, lfs=True, on_read=None):
    """Write `writes` (a list of byte strings, or "swap" to start a new file) into an
    .incomplete file the way huggingface_hub does, while a StreamHash follows it."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import cache_fetch
    finally:
        sys.path.pop(0)
    data = b"".join(w for w in writes if w != "swap")
    etag = hashlib.sha256(data).hexdigest()
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    follower = cache_fetch.StreamHash(blobs, etag, lfs, len(data), on_read)
    follower.start()
    tmp = blobs / f"{etag}.0001.incomplete"
    fh = open(tmp, "wb")  # noqa: SIM115
    for w in writes:
        if w == "swap":  # a second writer's file replaces the one being followed
            fh.close()
            tmp.unlink()
            tmp = blobs / f"{etag}.0002.incomplete"
            fh = open(tmp, "wb")  # noqa: SIM115
            continue
        fh.write(w)
        fh.flush()
        time.sleep(0.05)
    fh.close()
    final = blobs / etag
    os.replace(tmp, final)
    return follower.digest(final), etag


def test_stream_hash_follows_a_growing_file_to_its_final_name(tmp_path):
    seen = []  # the bytes of each progress call
    writes = [os.urandom(300_000) for _ in range(5)]
    digest, etag = _follow(tmp_path, writes, on_read=seen.append)
    assert digest == etag
    assert sum(seen) == 5 * 300_000 and len(seen) >= 5  # progress while the file grew


def test_stream_hash_gives_nothing_when_it_followed_another_file(tmp_path):
    # the followed file vanished mid-way: its bytes are not the final file's, so no digest
    # (the caller hashes the final file itself)
    digest, _ = _follow(tmp_path, [b"a" * 1000, "swap", b"b" * 1000, b"c" * 1000])
    assert digest is None


# ---- --check-files: what each serving host sees of the shared cache (roles/cache verify)


def check_files(cache, revision, repo=FLASH, json_out=True):
    """The read-only check with the Hub's environment pointing nowhere: it needs no Hub.
    With --json it prints the result and nothing else, on stderr neither."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    res = subprocess.run([sys.executable, "-I", str(SCRIPT), "--check-files", "--repo", repo,
                          "--revision", revision, "--cache-dir", str(cache)]
                         + (["--json"] if json_out else []),
                         capture_output=True, text=True, env=env, timeout=60)
    if not json_out:
        return res.returncode, res.stderr
    assert res.stderr == ""
    return res.returncode, json.loads(res.stdout), res.stderr


@pytest.fixture
def fetched(mirror, tmp_path):
    """A complete fetch of FLASH: (its snapshot, its manifest)."""
    code, summary, out = run(mirror, tmp_path)
    assert code == 0, out
    mirror.stats.reset()
    return Path(summary["snapshot"]), Path(summary["manifest"])


def test_check_files_passes_a_complete_fetch_by_commit_or_branch(mirror, tmp_path, fetched):
    sha = mirror.repos[FLASH].sha
    for revision in (sha, "main"):
        code, result, _ = check_files(tmp_path, revision)
        assert (code, result) == (0, {"files": len(expected(mirror, FLASH)), "problems": []})
    assert check_files(tmp_path, sha, json_out=False) == (
        0, f"cache_fetch: {FLASH}@{sha}: all {len(expected(mirror, FLASH))} files of the "
           "manifest seen\n")
    assert mirror.stats.snapshot()["requests"] == {}


def test_check_files_names_an_incomplete_manifest(mirror, tmp_path, fetched):
    _, manifest = fetched
    data = json.loads(manifest.read_text())
    data["complete"] = False
    manifest.write_text(json.dumps(data))
    code, result, _ = check_files(tmp_path, mirror.repos[FLASH].sha)
    assert (code, result["problems"]) == (1, [f"manifest {manifest} is not complete"])
    assert check_files(tmp_path, mirror.repos[FLASH].sha, json_out=False) == (
        1, f"cache_fetch: problem: manifest {manifest} is not complete\n")


def test_check_files_names_a_file_of_the_wrong_size_a_missing_one_and_an_unreadable_one(
        mirror, tmp_path, fetched):
    snap, _ = fetched
    grown, gone, private = ("model-00001-of-00003.safetensors",
                            "model-00002-of-00003.safetensors", "config.json")
    size = (snap / grown).stat().st_size
    with open(snap / grown, "ab") as fh:
        fh.write(b"x")
    (snap / gone).unlink()
    os.chmod(os.path.realpath(snap / private), 0o600)
    code, result, _ = check_files(tmp_path, mirror.repos[FLASH].sha)
    assert code == 1 and result["files"] == len(expected(mirror, FLASH))
    assert sorted(result["problems"]) == sorted([
        f"{snap / grown}: {size + 1} bytes, manifest says {size}",
        f"{snap / gone}: No such file or directory",
        f"{snap / private}: not readable by other users (mode 600)"])


def test_check_files_names_a_missing_manifest(mirror, tmp_path, fetched):
    _, manifest = fetched
    manifest.unlink()
    code, result, _ = check_files(tmp_path, mirror.repos[FLASH].sha)
    assert (code, result) == (1, {"files": 0, "problems": [
        f"manifest {manifest}: [Errno 2] No such file or directory: '{manifest}'"]})
