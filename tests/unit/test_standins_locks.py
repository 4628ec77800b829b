"""The lab's engine locks: the repository's locks with the stand-ins' hashes, offline.

A stand-in must be a package of the lock it stands in for, at the locked version; the lab
lock must have the repository lock's names and versions, the stand-ins' hashes for them and
the real hashes for everything else; the FlashInfer fault variants must be below the floor
or mixed.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.version import Version

from gpufleet import catalog
from gpufleet.catalog import lockfile
from gpufleet_lab import wheels

DYNAMO_METADATA = ("Metadata-Version: 2.1\nName: ai-dynamo\nVersion: 1.6.1\n"
                   "Requires-Dist: aisimulate==0.13.0\nRequires-Dist: aiohttp\n")


def fake_upstream_dynamo(wheel_dir: Path) -> None:
    """Upstream's ai-dynamo wheel as far as the lab build reads it (the real one is 1 MB on
    pypi.org; the lab downloads it, this test stays offline)."""
    info = "ai_dynamo-1.6.1.dist-info"
    with zipfile.ZipFile(wheel_dir / "ai_dynamo-1.6.1-py3-none-any.whl", "w") as zf:
        zf.writestr("dynamo/__init__.py", "")
        zf.writestr(f"{info}/METADATA", DYNAMO_METADATA)
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nTag: py3-none-any\n")
        zf.writestr(f"{info}/entry_points.txt", "[console_scripts]\ndynamo = dynamo.cli:main\n")
        zf.writestr(f"{info}/RECORD", "")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lablocks")
    wheel_dir, lock_dir = root / "wheels", root / "locks"
    wheel_dir.mkdir()
    fake_upstream_dynamo(wheel_dir)
    built = wheels.write_lab_locks(wheel_dir, lock_dir)
    return built, lock_dir


def wheel_meta(path: Path) -> tuple[str, str]:
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(zf.read(meta).decode())
    return lockfile.canonicalize_name(msg["Name"]), msg["Version"]


def test_every_stand_in_is_a_locked_name_at_its_locked_version(lab):
    built, _ = lab
    locks = [lockfile.read(wheels.LOCKS / name).pins for name in wheels.LAB_LOCKS]
    faults = {(n, v) for f in wheels.FAULT_LOCKS.values() for n, v in f.items()}
    for (name, version), wheel in built.items():
        assert wheel_meta(wheel) == (name, version), wheel.name
        if (name, version) in faults:
            continue
        assert any(pins.get(name, ("",))[0] == version for pins in locks), (
            f"stand-in {name}=={version} is in none of {', '.join(wheels.LAB_LOCKS)}")


@pytest.mark.parametrize("name", wheels.LAB_LOCKS)
def test_lab_lock_has_the_names_and_versions_and_the_stand_ins_hashes(lab, name):
    built, lock_dir = lab
    real = lockfile.read(wheels.LOCKS / name)
    labl = lockfile.read(lock_dir / name)
    assert {n: v for n, (v, _) in labl.pins.items()} == {n: v for n, (v, _) in real.pins.items()}
    assert labl.header["requirement"] == real.header["requirement"]
    standins = 0
    for pkg, (version, hashes) in labl.pins.items():
        if wheels.substituted(pkg):
            digest = hashlib.sha256(built[pkg, version].read_bytes()).hexdigest()
            assert hashes == [digest], pkg
            standins += 1
        else:
            assert hashes == real.pins[pkg][1], pkg
    assert 20 < standins < len(labl.pins) / 2  # torch, CUDA and the like; most are real


def test_the_engines_the_lab_serves_with_are_stood_in_at_the_locked_versions():
    """dists.json's default versions (what build.py makes for the stand-in tests) are the
    locks' versions, and each shimmed package is one the lab substitutes."""
    dists = json.loads((wheels.STANDINS / "dists.json").read_text())
    dists.pop("_comment")
    locked = {}
    for name in wheels.LAB_LOCKS:
        for pkg, (version, _) in lockfile.read(wheels.LOCKS / name).pins.items():
            locked.setdefault(pkg, set()).add(version)
    for pkg, spec in dists.items():
        assert wheels.substituted(pkg), pkg
        if spec["version"]:
            assert spec["version"] in locked.get(pkg, ()), (pkg, spec["version"], locked.get(pkg))
    assert dists["vllm"]["version"] in locked["vllm"] and "sglang" in locked


def test_fault_variants_are_below_the_floor_or_mixed(lab):
    _, lock_dir = lab
    floor = catalog.load().engines["vllm"].flashinfer_floor
    old = lockfile.read(lock_dir / "flashinfer-old" / "vllm-x86_64-py311.txt").pins
    assert Version(old["flashinfer-python"][0]) < Version(floor)
    split = lockfile.read(lock_dir / "flashinfer-split" / "vllm-x86_64-py311.txt").pins
    assert split["flashinfer-cubin"][0] != split["flashinfer-python"][0]
    normal = lockfile.read(lock_dir / "vllm-x86_64-py311.txt").pins
    assert Version(normal["flashinfer-python"][0]) >= Version(floor)
    assert "flashinfer-cubin" not in normal


def test_a_stand_in_at_another_version_is_caught(tmp_path):
    """The check above fails when a stand-in's version is not the lock's."""
    build = wheels._load(wheels.STANDINS / "build.py", "standins_build_test")
    wheel = build.standin(tmp_path, "triton", "9.9.9")
    pins = lockfile.read(wheels.LOCKS / "vllm-x86_64-py311.txt").pins
    name, version = wheel_meta(wheel)
    assert pins[name][0] != version
    with zipfile.ZipFile(wheel) as zf:  # metadata only: nothing to import
        assert all(".dist-info/" in n for n in zf.namelist())
