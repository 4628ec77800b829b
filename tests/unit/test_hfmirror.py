"""The lab's Hugging Face mirror, driven by the real huggingface_hub client (loopback only)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
import types
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
import pytest
from huggingface_hub import HfApi, file_download, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gpufleet_lab.hfmirror import Cut, MirrorServer, git_blob_sha1

FLASH = "zai-org/GLM-5.3-Flash"
GATED = "zai-org/GLM-5.3-BF16"
TOKEN = "hf_labGATEDtoken0123456789"
OTHER_TOKEN = "hf_labOTHERtoken0123456789"
WRONG_TOKEN = "hf_labWRONGtoken0123456789"
SHARD1 = "model-00001-of-00003.safetensors"
DTYPE_SIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1}
ALL_REPOS = [
    "zai-org/GLM-5.3-Flash",
    "zai-org/GLM-5.3-Flash-BF16",
    "zai-org/GLM-5.3",
    "zai-org/GLM-5.3-BF16",
    "RadixArk/GLM-5.3-NVFP4",
    "incoai/GLM-5.3-DFlash2",
]


@pytest.fixture(scope="module")
def log():
    return io.StringIO()


@pytest.fixture(scope="module")
def mirror(log):
    server = MirrorServer(gated={GATED: TOKEN}, tokens=[OTHER_TOKEN], log_stream=log)
    # Bigger than huggingface_hub's 10 MiB download chunk, so a cut can be resumed by Range.
    server.add_file(FLASH, "extra/big.safetensors", size=12 * 1024 * 1024)
    with server:
        yield server


@pytest.fixture(autouse=True)
def clean(mirror, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    mirror.set_cuts([])
    mirror.set_rate_limit(0)
    mirror.lfs_redirect = False
    mirror.stats.reset()


def sha256_file(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def http(method: str, url: str, headers=None, data=None):
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # hand the 3xx back as it came


def head_no_redirect(url: str, headers=None):
    req = urllib.request.Request(url, method="HEAD", headers=headers or {})
    try:
        with urllib.request.build_opener(_NoRedirect).open(req, timeout=10) as resp:
            return resp.status, resp.headers
    except urllib.error.HTTPError as err:
        return err.code, err.headers


def parse_safetensors(data: bytes) -> dict:
    """Check safetensors' rules: header size, JSON, dtypes, contiguous offsets covering the data."""
    (n,) = struct.unpack("<Q", data[:8])
    assert 0 < n <= len(data) - 8 and n % 8 == 0
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    end = 0
    for _name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        start, stop = info["data_offsets"]
        count = 1
        for dim in info["shape"]:
            count *= dim
        assert start == end and stop - start == count * DTYPE_SIZE[info["dtype"]]
        end = stop
    assert 8 + n + end == len(data)
    return header


# --------------------------------------------------------------------------- content


def test_every_repo_has_the_checkpoint_files_and_valid_shards(mirror):
    # the placeholder checkpoints (the lab's real model: tests/unit/test_lab_model.py)
    assert sorted(mirror.repos) == sorted([*ALL_REPOS, "gpufleet-lab/GLM-5.3-Tiny"])
    for repo_id in ALL_REPOS:
        files = mirror.repos[repo_id].files
        for name in (
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors.index.json",
            "README.md",
            ".gitattributes",
        ):
            assert name in files, (repo_id, name)
        shards = [p for p in files if p.startswith("model-") and p.endswith(".safetensors")]
        assert 3 <= len(shards) <= 4
        index = json.loads(files["model.safetensors.index.json"].blob.read())
        total = 0
        for shard in shards:
            data = files[shard].blob.read()
            assert 1024 < len(data) <= 2 * 1024 * 1024 + 65536
            for name, info in parse_safetensors(data).items():
                assert index["weight_map"][name] == shard
                total += info["data_offsets"][1] - info["data_offsets"][0]
        assert set(index["weight_map"].values()) == set(shards)
        assert index["metadata"]["total_size"] == total
        gen = json.loads(files["generation_config.json"].blob.read())
        assert (gen["temperature"], gen["top_p"]) == (1.0, 0.95)


def test_configs_carry_the_real_metadata(mirror):
    def config(repo_id):
        return json.loads(mirror.repos[repo_id].files["config.json"].blob.read())

    glm = config("zai-org/GLM-5.3")
    assert glm["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert glm["model_type"] == "glm_moe_dsa"
    assert (glm["num_hidden_layers"], glm["n_routed_experts"], glm["num_experts_per_tok"]) == (
        78,
        256,
        8,
    )
    assert glm["num_nextn_predict_layers"] == 1
    assert glm["max_position_embeddings"] == 1048576
    assert glm["quantization_config"]["quant_method"] == "fp8"
    assert "quantization_config" not in config("zai-org/GLM-5.3-BF16")
    assert config("RadixArk/GLM-5.3-NVFP4")["quantization_config"]["quant_algo"] == "NVFP4"
    assert "hf_quant_config.json" in mirror.repos["RadixArk/GLM-5.3-NVFP4"].files

    flash = config(FLASH)
    text = flash["text_config"]
    assert "vision_config" in flash
    assert text["num_hidden_layers"] == 45
    kda, full = (
        text["linear_attn_config"]["kda_layers"],
        text["linear_attn_config"]["full_attn_layers"],
    )
    assert sorted(kda + full) == list(range(45)) and kda and full
    assert text["full_attention"]["use_nope"] is True
    assert (text["n_routed_experts"], text["num_experts_per_tok"]) == (288, 8)
    assert text["num_nextn_predict_layers"] == 1
    assert text["max_position_embeddings"] == 1048576
    assert flash["quantization_config"]["quant_method"] == "fp8"
    assert "quantization_config" not in config("zai-org/GLM-5.3-Flash-BF16")
    assert config("incoai/GLM-5.3-DFlash2")["dflash_config"]["block_size"] == 8


def test_tokenizer_and_chat_template(mirror):
    files = mirror.repos[FLASH].files
    tok = json.loads(files["tokenizer.json"].blob.read())
    vocab = tok["model"]["vocab"]
    assert len(set(vocab.values())) == len(vocab) == max(vocab.values()) + 1
    for a, b in tok["model"]["merges"]:
        assert a in vocab and b in vocab and a + b in vocab
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert all(vocab[content] == i for content, i in special.items())
    gen = json.loads(files["generation_config.json"].blob.read())
    assert special["<|endoftext|>"] in gen["eos_token_id"]

    cfg = json.loads(files["tokenizer_config.json"].blob.read())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    prompt = env.from_string(cfg["chat_template"]).render(
        messages=[{"role": "user", "content": "Reply with exactly: READY"}],
        add_generation_prompt=True,
    )
    assert prompt == "[gMASK]<sop><|user|>\nReply with exactly: READY<|assistant|>\n<think>"


def test_content_and_commit_are_deterministic(mirror):
    other = MirrorServer(repos=[FLASH], log_stream=io.StringIO())
    try:
        fresh, ours = other.repos[FLASH], mirror.repos[FLASH]
        for path, f in fresh.files.items():
            assert f.sha256 == ours.files[path].sha256
        # the extra file registered on `mirror` changes its commit, as a new commit would
        ours_without = {p for p in ours.files if not p.startswith("extra/")}
        assert ours_without == set(fresh.files) and fresh.sha != ours.sha
        assert len(fresh.sha) == 40
    finally:
        other.stop()
    big = MirrorServer(repos=[FLASH], shard_mib=3, log_stream=io.StringIO())
    try:
        size = big.repos[FLASH].files[SHARD1].size
        assert 3 * 1024 * 1024 - 4096 < size < 3 * 1024 * 1024 + 65536
        parse_safetensors(big.repos[FLASH].files[SHARD1].blob.read())
    finally:
        big.stop()


# --------------------------------------------------------------------------- HTTP surface


def test_resolve_headers_and_ranges(mirror, tmp_path):
    repo = mirror.repos[FLASH]
    url = f"{mirror.url}/{FLASH}/resolve/main/{SHARD1}"
    status, headers, _ = http("HEAD", url)
    f = repo.files[SHARD1]
    assert status == 200
    assert headers["X-Repo-Commit"] == repo.sha
    assert headers["ETag"] == f'"{f.sha256}"' == headers["X-Linked-Etag"]
    assert int(headers["X-Linked-Size"]) == int(headers["Content-Length"]) == f.size
    assert headers["Accept-Ranges"] == "bytes"
    assert not [h for h in headers if h.lower().startswith("x-xet") or h.lower() == "link"]

    status, headers, body = http("GET", url, {"Range": "bytes=100-199"})
    assert status == 206 and body == f.blob.read()[100:200]
    assert headers["Content-Range"] == f"bytes 100-199/{f.size}"
    status, headers, _ = http("GET", url, {"Range": f"bytes={f.size}-"})
    assert status == 416

    config = repo.files["config.json"]
    status, headers, body = http("GET", f"{mirror.url}/{FLASH}/resolve/{repo.sha}/config.json")
    assert status == 200 and headers["ETag"] == f'"{git_blob_sha1(body)}"'
    assert "X-Linked-Etag" not in headers and body == config.blob.read()

    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(FLASH, "nope.json", endpoint=mirror.url, cache_dir=tmp_path, token=False)
    status, headers, _ = http("HEAD", f"{mirror.url}/{FLASH}/resolve/main/nope.json")
    assert (status, headers["X-Error-Code"], headers["X-Repo-Commit"]) == (
        404,
        "EntryNotFound",
        repo.sha,
    )


def test_model_info_with_files_metadata(mirror):
    api = HfApi(endpoint=mirror.url, token=False)
    repo = mirror.repos[FLASH]
    info = api.model_info(FLASH, files_metadata=True)
    assert info.sha == repo.sha
    assert {s.rfilename for s in info.siblings} == set(repo.files)
    for sibling in info.siblings:
        f = repo.files[sibling.rfilename]
        assert sibling.size == f.size and sibling.blob_id == f.oid
        if sibling.rfilename.endswith(".safetensors") or sibling.rfilename == "tokenizer.json":
            assert sibling.lfs.sha256 == hashlib.sha256(f.blob.read()).hexdigest()
            assert sibling.lfs.size == f.size and sibling.lfs.pointer_size > 100
        else:
            assert sibling.lfs is None
            assert sibling.blob_id == git_blob_sha1(f.blob.read())
    assert api.model_info(FLASH, revision=repo.sha).sha == repo.sha
    plain = api.model_info(FLASH)
    assert plain.siblings[0].size is None
    assert plain.safetensors.total > 0

    tree = {f.path: f for f in api.list_repo_tree(FLASH, recursive=True)}
    assert tree[SHARD1].lfs.sha256 == repo.files[SHARD1].sha256
    assert "extra" in {f.path for f in api.list_repo_tree(FLASH)}  # the folder, not recursive

    with pytest.raises(RevisionNotFoundError):
        api.model_info(FLASH, revision="0" * 40)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("zai-org/GLM-9")


def test_snapshot_download_through_hf_endpoint(mirror, tmp_path):
    """The real client in a fresh process, pointed at the mirror only by HF_ENDPOINT."""
    script = textwrap.dedent(
        """
        import json, sys
        from huggingface_hub import HfApi, snapshot_download
        repo, sha = sys.argv[1], sys.argv[2]
        full = snapshot_download(repo, revision="main")
        only_json = snapshot_download(repo, revision=sha, allow_patterns=["*.json"],
                                      cache_dir=sys.argv[3])
        info = HfApi().model_info(repo, files_metadata=True)
        siblings = {s.rfilename: (s.lfs.sha256 if s.lfs else None) for s in info.siblings}
        print(json.dumps({"full": full, "only_json": only_json, "siblings": siblings}))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=mirror.url, HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="0")
    repo = mirror.repos[FLASH]
    out = subprocess.run(
        [sys.executable, "-c", script, FLASH, repo.sha, str(tmp_path / "other")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    full = Path(result["full"])
    assert full.name == repo.sha and str(full).startswith(str(tmp_path / "home"))
    got = {str(p.relative_to(full)) for p in full.rglob("*") if p.is_file()}
    assert got == set(repo.files)
    for path, lfs_sha in result["siblings"].items():
        data = (full / path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == repo.files[path].sha256
        if lfs_sha:
            assert hashlib.sha256(data).hexdigest() == lfs_sha
        else:
            assert git_blob_sha1(data) == repo.files[path].oid
    only = Path(result["only_json"])
    assert {p.name for p in only.iterdir()} == {p for p in repo.files if p.endswith(".json")}
    stats = mirror.stats.snapshot()
    assert stats["bytes_sent"] >= sum(f.size for f in repo.files.values())


# --------------------------------------------------------------------------- faults, stats


def test_cut_once_is_resumed_by_range(mirror, tmp_path):
    path = "extra/big.safetensors"
    f = mirror.repos[FLASH].files[path]
    cut_at = 11 * 1024 * 1024  # after the client's first full 10 MiB chunk
    mirror.set_cuts([Cut(f"{FLASH}/{path}", cut_at, times=1)])
    local = hf_hub_download(FLASH, path, endpoint=mirror.url, cache_dir=tmp_path, token=False)
    assert sha256_file(local) == f.sha256
    stats = mirror.stats.snapshot()
    entry = stats["files"][f"{FLASH}/{path}"]
    assert (entry["gets"], entry["cut"], entry["complete"]) == (2, 1, 1)
    assert stats["statuses"].get("206") == 1  # the retry asked for the rest only
    assert entry["bytes"] == cut_at + f.size - 10 * 1024 * 1024


def test_cut_fails_the_download_then_a_rerun_succeeds(mirror, tmp_path, monkeypatch):
    # huggingface_hub sleeps 1 s between its 5 in-process retries: skip the sleeps.
    monkeypatch.setattr(file_download, "time", types.SimpleNamespace(sleep=lambda s: None))
    f = mirror.repos[FLASH].files[SHARD1]
    mirror.set_cuts([Cut(f"*/{SHARD1}", 100_000, times=6)])  # the first GET and 5 retries
    with pytest.raises(httpx2.RemoteProtocolError):
        hf_hub_download(FLASH, SHARD1, endpoint=mirror.url, cache_dir=tmp_path, token=False)
    blobs = tmp_path / "models--zai-org--GLM-5.3-Flash" / "blobs"
    assert not list(blobs.glob("*"))  # no partial file left where it could be read
    assert not (tmp_path / "models--zai-org--GLM-5.3-Flash" / "snapshots").exists() or not list(
        (tmp_path / "models--zai-org--GLM-5.3-Flash" / "snapshots").rglob(SHARD1)
    )
    local = hf_hub_download(FLASH, SHARD1, endpoint=mirror.url, cache_dir=tmp_path, token=False)
    assert sha256_file(local) == f.sha256
    entry = mirror.stats.snapshot()["files"][f"{FLASH}/{SHARD1}"]
    assert (entry["gets"], entry["cut"], entry["complete"]) == (7, 6, 1)
    assert entry["bytes"] == 6 * 100_000 + f.size


def test_reset_cut_is_not_retried_by_the_client(mirror, tmp_path):
    mirror.set_cuts([Cut(f"*/{SHARD1}", 1000, times=1, mode="reset")])
    with pytest.raises(httpx2.ReadError, match="reset"):
        hf_hub_download(FLASH, SHARD1, endpoint=mirror.url, cache_dir=tmp_path, token=False)
    assert mirror.stats.snapshot()["files"][f"{FLASH}/{SHARD1}"]["gets"] == 1


def test_admin_endpoints(mirror):
    body = json.dumps([{"glob": "*config.json", "after_bytes": 10, "times": 1}]).encode()
    status, _, out = http("POST", f"{mirror.url}/_admin/faults", data=body)
    assert status == 200 and json.loads(out)[0]["after_bytes"] == 10
    url = f"{mirror.url}/{FLASH}/resolve/main/config.json"
    with pytest.raises(Exception):  # noqa: B017 - urllib raises IncompleteRead here
        http("GET", url)
    status, _, body = http("GET", url)
    assert status == 200 and len(body) == mirror.repos[FLASH].files["config.json"].size
    status, _, out = http("GET", f"{mirror.url}/_admin/stats")
    stats = json.loads(out)
    assert stats["files"][f"{FLASH}/config.json"] == {
        "bytes": 10 + len(body),
        "gets": 2,
        "complete": 1,
        "cut": 1,
    }
    assert stats["bytes_sent"] == 10 + len(body) and stats["cuts"] == 1
    assert stats["requests"][f"GET /{FLASH}/resolve/main/config.json"] == 2
    assert http("POST", f"{mirror.url}/_admin/reset", data=b"")[0] == 200
    assert json.loads(http("GET", f"{mirror.url}/_admin/stats")[2])["bytes_sent"] == 0
    assert json.loads(http("DELETE", f"{mirror.url}/_admin/faults")[2]) == []


# --------------------------------------------------------------------------- rate limit

BIG = "extra/big.safetensors"
TWO_MIB = 2 * 1024 * 1024


def timed_gets(mirror, count: int) -> float:
    """Seconds for ``count`` parallel GETs of the first 2 MiB of the big file, each on its own
    connection; each body is checked."""
    url = f"{mirror.url}/{FLASH}/resolve/main/{BIG}"
    want = mirror.repos[FLASH].files[BIG].blob.read()[:TWO_MIB]
    bodies = []

    def get():
        bodies.append(http("GET", url, {"Range": f"bytes=0-{TWO_MIB - 1}"})[2])

    threads = [threading.Thread(target=get) for _ in range(count)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.monotonic() - start
    assert bodies == [want] * count
    return secs


def test_rate_limit_per_connection(mirror):
    # set through the admin endpoint, as a test against a running mirror would
    status, _, out = http("POST", f"{mirror.url}/_admin/rate?mib=4&per=connection", data=b"")
    assert status == 200 and json.loads(out) == {"mib": 4.0, "per": "connection"}
    assert json.loads(http("GET", f"{mirror.url}/_admin/rate")[2])["per"] == "connection"
    assert timed_gets(mirror, 1) >= 0.45  # 2 MiB at 4 MiB/s
    assert timed_gets(mirror, 2) < 0.8  # each connection has its own 4 MiB/s
    for bad in ("mib=-1", "mib=x", "mib=4&per=host"):
        assert http("POST", f"{mirror.url}/_admin/rate?{bad}", data=b"")[0] == 400
    assert http("POST", f"{mirror.url}/_admin/rate?mib=0", data=b"")[0] == 200
    assert timed_gets(mirror, 1) < 0.3  # off again
    assert mirror.stats.snapshot()["statuses"]["206"] == 4


def test_rate_limit_per_client_is_shared_by_its_connections(mirror):
    mirror.set_rate_limit(4)  # per client by default
    assert timed_gets(mirror, 2) >= 0.95  # 4 MiB through one 4 MiB/s bucket


# --------------------------------------------------------------------------- CDN redirect


def test_lfs_redirect_to_another_host_like_the_hub(mirror):
    status, _, out = http("POST", f"{mirror.url}/_admin/lfs-redirect?on=1", data=b"")
    assert status == 200 and json.loads(out) == {"lfs_redirect": True}
    repo = mirror.repos[FLASH]
    f = repo.files[SHARD1]
    status, headers = head_no_redirect(f"{mirror.url}/{FLASH}/resolve/main/{SHARD1}")
    assert status == 302 and headers["Content-Length"] == "0"
    assert headers["X-Repo-Commit"] == repo.sha
    assert headers["X-Linked-Etag"] == f'"{f.sha256}"' and headers["X-Linked-Size"] == str(f.size)
    assert headers["ETag"]
    location = urlsplit(headers["Location"])
    assert location.scheme == "http" and location.path == f"/_cdn/{f.sha256}"
    assert (location.hostname, location.port) == ("localhost", mirror.address[1])
    assert "expires=" in location.query and "signature=" in location.query
    # reached as localhost, it sends the client to 127.0.0.1: the name always differs
    localhost = mirror.url.replace("127.0.0.1", "localhost")
    _, headers = head_no_redirect(f"{localhost}/{FLASH}/resolve/main/{SHARD1}")
    assert urlsplit(headers["Location"]).hostname == "127.0.0.1"

    # the CDN side serves ranges, and the bytes count for the file
    status, headers, body = http("GET", location.geturl(), {"Range": "bytes=100-199"})
    assert status == 206 and body == f.blob.read()[100:200]
    assert headers["Content-Range"] == f"bytes 100-199/{f.size}"
    assert mirror.stats.snapshot()["files"][f"{FLASH}/{SHARD1}"]["bytes"] == 100
    # files outside LFS are answered directly, as on the Hub
    status, _, body = http("GET", f"{mirror.url}/{FLASH}/resolve/main/config.json")
    assert status == 200 and body == repo.files["config.json"].blob.read()

    status, _, out = http("POST", f"{mirror.url}/_admin/lfs-redirect?on=0", data=b"")
    assert json.loads(out) == {"lfs_redirect": False}
    assert head_no_redirect(f"{mirror.url}/{FLASH}/resolve/main/{SHARD1}")[0] == 200


def test_lfs_redirect_keeps_the_token_off_the_cdn(mirror, tmp_path):
    mirror.lfs_redirect = True
    shard = "model-00001-of-00004.safetensors"
    f = mirror.repos[GATED].files[shard]
    # the gate is on the resolve, before the redirect
    with pytest.raises(GatedRepoError):
        hf_hub_download(GATED, shard, endpoint=mirror.url, cache_dir=tmp_path / "a", token=False)
    local = hf_hub_download(GATED, shard, endpoint=mirror.url, cache_dir=tmp_path, token=TOKEN)
    assert sha256_file(local) == f.sha256
    stats = mirror.stats.snapshot()
    assert stats["cdn_requests"] == 1 and stats["cdn_requests_with_authorization"] == 0
    assert mirror.stats.snapshot()["files"][f"{GATED}/{shard}"]["complete"] == 1
    assert stats["statuses"]["302"] == 1

    # urllib follows the redirect with every header it was given: the CDN sees the token
    url = f"{mirror.url}/{GATED}/resolve/main/{shard}"
    status, _, body = http("GET", url, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and hashlib.sha256(body).hexdigest() == f.sha256
    stats = mirror.stats.snapshot()
    assert stats["cdn_requests"] == 2 and stats["cdn_requests_with_authorization"] == 1


# --------------------------------------------------------------------------- gated repo, tokens


def test_gated_repo_and_tokens(mirror, log, tmp_path):
    def download(token, n):
        return hf_hub_download(
            GATED, "config.json", endpoint=mirror.url, cache_dir=tmp_path / n, token=token
        )

    # the repo's metadata stays public, as on the Hub
    assert HfApi(endpoint=mirror.url, token=False).model_info(GATED).gated == "manual"
    with pytest.raises(GatedRepoError) as err:
        download(False, "none")
    assert err.value.response.status_code == 401
    with pytest.raises(GatedRepoError) as err:  # a valid token without access
        download(OTHER_TOKEN, "other")
    assert err.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as err:
        download(WRONG_TOKEN, "wrong")
    assert not isinstance(err.value, GatedRepoError)
    assert err.value.response.status_code == 401
    assert "Invalid credentials in Authorization header" in str(err.value)
    with pytest.raises(GatedRepoError):  # listing works, the files do not
        snapshot_download(GATED, endpoint=mirror.url, cache_dir=tmp_path / "snap", token=False)
    local = download(TOKEN, "right")
    assert sha256_file(local) == mirror.repos[GATED].files["config.json"].sha256
    # an unknown token is refused everywhere, as on the Hub
    with pytest.raises(HfHubHTTPError):
        HfApi(endpoint=mirror.url, token=WRONG_TOKEN).model_info(FLASH)

    text = log.getvalue()
    assert f"GET /{GATED}/resolve/main/config.json 200" in text
    for secret in (TOKEN, OTHER_TOKEN, WRONG_TOKEN, "Bearer", "uthorization"):
        assert secret not in text


def test_cli_serves_and_never_logs_tokens(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufleet_lab.hfmirror", "--port", "0"]
        + ["--gated", f"{GATED}={TOKEN}", "--repo", GATED, "--shard-mib", "0.25"],
        cwd=Path(__file__).resolve().parents[2] / "lab",  # where gpufleet_lab is
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        assert "serving 1 repos on http://127.0.0.1:" in line, line
        url = line.split(" on ", 1)[1].strip()
        resolve = f"{url}/{GATED}/resolve/main/model-00001-of-00004.safetensors"
        assert http("HEAD", resolve)[0] == 401
        assert http("HEAD", resolve, {"Authorization": f"Bearer {WRONG_TOKEN}"})[0] == 401
        status, headers, body = http("GET", resolve, {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and 200_000 < len(body) < 300_000
        parse_safetensors(body)
    finally:
        proc.terminate()
        rest = proc.communicate(timeout=10)[1]
    text = line + rest
    assert text.count(f"/{GATED}/resolve/main/") == 3
    assert TOKEN not in text and WRONG_TOKEN not in text and "Bearer" not in text
