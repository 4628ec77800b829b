"""Engine releases (catalog engines.*.releases, gpufleet_engine_versions): the plan of
another release runs that release's environment, lock and flag table, says which release
each engine must report, and refuses what it cannot run; the catalog's own release plans
exactly as before."""

from __future__ import annotations

import http.server
import json
import sys
import threading
from pathlib import Path

import pytest

from gpufleet import catalog as cat
from gpufleet import engine_flags
from gpufleet.catalog import lockfile
from gpufleet.plan import PlanError, make_plan

REPO = Path(__file__).resolve().parents[2]
OLDER = {"engine_versions": {"vllm": "0.31.0"}}
VENVS = "/opt/gpufleet/engines"
CATALOG = cat.load()


def engines(plan):
    return [p for p in plan.processes if p.is_engine]


def test_another_release_runs_from_its_own_venv_and_lock():
    own, older = make_plan("h200-pd-1node"), make_plan("h200-pd-1node", overrides=OLDER)
    for o, p in zip(own.processes, older.processes, strict=True):
        # the same command line, from the release's environment
        assert p.argv[1:] == o.argv[1:] and p.unit == o.unit
        if p.role in ("prefill", "decode", "router"):
            assert o.argv[0].startswith("/opt/gpufleet/engines/vllm-0.33.0/bin/")
            assert p.argv[0].startswith("/opt/gpufleet/engines/vllm-0.31.0/bin/")
    (host,) = older.hosts.values()
    assert host.engine.venv == "/opt/gpufleet/engines/vllm-0.31.0"
    assert host.engine.lock == "gpufleet/catalog/locks/vllm-0.31.0-x86_64-py312.txt"
    lock = lockfile.read(REPO / host.engine.lock)
    assert lock.pins["vllm"][0] == "0.31.0" and lock.header["release"] == ["0.31.0"]
    assert older.engine.label.startswith("vLLM 0.31.0")
    # naming the catalog's own release is the catalog's plan
    same = make_plan("h200-pd-1node", overrides={"engine_versions": {"vllm": "0.33.0"}})
    assert {**same.to_json(), "inputs": None} == {**own.to_json(), "inputs": None}


def test_each_engine_must_report_the_planned_release():
    for overrides, version in (({}, "0.33.0"), (OLDER, "0.31.0")):
        plan = make_plan("h200-pd-1node", overrides=overrides)
        for p in engines(plan):
            assert p.readiness.version == version
            assert p.readiness.version_url == p.readiness.url.replace("/health", "/version")
        assert all(p.readiness.version is None for p in plan.processes if not p.is_engine)
    # the image runtime's engine is whatever its image holds; SGLang and Dynamo say nothing
    for name, overrides in (("h200-pd-1node", {"runtime": "image"}), ("sglang-h200-pd", {}),
                            ("h200-disagg", {})):
        assert all(p.readiness.version is None for p in make_plan(name, overrides=overrides)
                   .processes)


def test_the_release_picks_its_flag_table():
    """0.31.0 spells the chunked-prefill switch --no-enable-..., 0.33.0 also --disable-...:
    a flag only the newer release takes is refused in a plan of the older one."""
    flag = {"args": {"decode": {"--disable-log-requests": True}}}
    make_plan("h200-pd-1node", overrides=flag)
    with pytest.raises(PlanError) as err:
        make_plan("h200-pd-1node", overrides={**flag, **OLDER})
    (problem,) = err.value.problems
    assert problem.field == "decode.argv"
    assert "vLLM 0.31.0 `vllm serve`: unknown flag --disable-log-requests" in problem.message


@pytest.mark.parametrize(("overrides", "where", "words"), [
    ({"engine_versions": {"vllm": "0.30.0"}}, "overrides.engine_versions.vllm",
     "vllm 0.30.0 is not a release gpufleet has locks and a flag table for; it has 0.33.0, "
     "0.31.0"),
    ({"engine_versions": {"sglang": "0.5.22"}}, "overrides.engine_versions.sglang",
     "no engine named sglang has releases to choose from"),
    ({"engine_versions": {"vlm": "0.31.0"}}, "overrides.engine_versions.vlm",
     "no engine named vlm has releases to choose from"),
    ({**OLDER, "runtime": "image"}, "overrides.engine_versions.vllm",
     "the image runtime runs the vllm its image brings"),
])
def test_what_cannot_run_is_refused_with_the_fix(overrides, where, words):
    with pytest.raises(PlanError) as err:
        make_plan("h200-pd-1node", overrides=overrides)
    (problem,) = err.value.problems
    assert problem.field == where and words in problem.message and problem.fix


def test_every_release_has_its_lock_and_its_flag_table():
    for name, engine in CATALOG.engines.items():
        for version, release in engine.releases.items():
            assert release.venv != engine.venv and version in release.venv
            for arch, python in CATALOG.lock_combos(name):
                assert (REPO / CATALOG.lock_path(name, arch, python, version)).is_file()
            program, _ = engine_flags.program_of(
                [engine.programs["engine"][0].split("/")[-1], *engine.programs["engine"][1:]])
            label, tables = engine_flags.RELEASES[program][version]
            assert version in label and all(version in t for t in tables)
            assert all((engine_flags.TABLE_DIR / t).is_file() for t in tables)


def test_a_release_is_the_engine_with_the_releases_environment():
    own, older = CATALOG.engine_at("vllm"), CATALOG.engine_at("vllm", "0.31.0")
    assert own is CATALOG.engines["vllm"] and own.version == "0.33.0"
    assert (older.version, older.venv) == ("0.31.0", "/opt/gpufleet/engines/vllm-0.31.0")
    assert older.programs == own.programs and older.managed == own.managed
    assert [r.req for r in older.requirements][0] == "vllm==0.31.0"
    assert CATALOG.versions("vllm") == ["0.33.0", "0.31.0"]
    assert CATALOG.versions("sglang") == [None]


class _Version(http.server.BaseHTTPRequestHandler):
    body = b'{"version": "0.31.0"}'

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_the_ready_module_reads_the_release_an_engine_reports():
    sys.path.insert(0, str(REPO / "collections"))
    from ansible_collections.gpufleet.fleet.plugins.modules import gpufleet_ready

    server = http.server.HTTPServer(("127.0.0.1", 0), _Version)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/version"
        assert gpufleet_ready.release_of(url) == "0.31.0"
        _Version.body = json.dumps(["not", "an", "object"]).encode()
        assert gpufleet_ready.release_of(url).startswith("none (")
    finally:
        server.shutdown()
        _Version.body = b'{"version": "0.31.0"}'
    assert gpufleet_ready.release_of("http://127.0.0.1:9/version").startswith("none (")


def test_the_venv_of_a_release_no_longer_run_is_not_drift():
    """After a release change the role's record names the old release's venv; the next run
    measures only the planned one: the old venv stays as it is and is no reason to rebuild
    the new one (switching back reinstalls nothing). A planned venv that changed is drift."""
    sys.path.insert(0, str(REPO / "collections"))
    from ansible_collections.gpufleet.fleet.plugins.modules import gpufleet_state

    old, new = f"{VENVS}/vllm-0.33.0", f"{VENVS}/vllm-0.31.0"
    recorded = {"venvs": {old: ["vllm==0.33.0"]}}
    now = {"files": {}, "units": {}, "packages": {}, "trees": {},
           "venvs": {new: ["vllm==0.31.0"]}}
    assert gpufleet_state.differences(recorded, now) == []
    recorded = {"venvs": {new: ["vllm==0.31.0", "torch==2.13.0"]}}
    assert gpufleet_state.differences(recorded, now) == [
        ("venvs", f"{new}: torch==2.13.0")]
