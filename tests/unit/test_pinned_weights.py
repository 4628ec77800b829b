"""Pinned weights: every engine's command line names its checkpoint's revision (the
catalog's, or gpufleet_model_revision), and the serve play replaces a branch or tag with
the commit the cache holds for it in each host's slice (gpufleet.model.pin_revisions,
from the refs the hosts read: filter gpufleet_checkpoint_commits), so a node restarted
after the branch moved loads the weights its peers serve."""

from __future__ import annotations

import base64

import pytest
from test_plan_workers import hosts

from gpufleet.ansible_plugins.filter.gpufleet import checkpoint_commits, ref_path
from gpufleet.model import host_slices, pin_revisions
from gpufleet.plan import PlanError, make_plan

A = "0123456789abcdef0123456789abcdef01234567"
B = "89abcdef0123456789abcdef0123456789abcdef"


def _after(argv: list, flag: str) -> list:
    return [argv[i + 1] for i, tok in enumerate(argv[:-1]) if tok == flag]


def _pinned(plan: dict, commits: dict) -> list[dict]:
    """Every host's slice of the plan, pinned as the serve play pins it."""
    return [pin_revisions(piece, commits) for piece in host_slices(plan).values()]


def _engines(pieces: list[dict]) -> list[dict]:
    return [p for piece in pieces for p in piece["processes"] if p["is_engine"]]


@pytest.mark.parametrize("target", ["h200-pd-1node", "h200-disagg", "sglang-h200-pd",
                                    "gb200-tray", "sglang-mi300x-pd"])
def test_every_engine_names_the_revision_and_only_engines_do(target):
    plan = make_plan(target).to_json()
    for p in plan["processes"]:
        assert _after(p["argv"], "--revision") == (["main"] if p["is_engine"] else []), p["name"]
    assert plan["cache"]["models"][0]["flag"] == "--revision"


def test_a_pin_replaces_the_branch_in_every_engine_and_nowhere_else():
    plan = make_plan("h200-pd-1node").to_json()
    (piece,) = host_slices(plan).values()
    pinned = pin_revisions(piece, {"zai-org/GLM-5.3-Flash": A})
    for before, after in zip(piece["processes"], pinned["processes"], strict=True):
        expected = list(before["argv"])
        if before["is_engine"]:  # only the revision's value moves
            expected[expected.index("--revision") + 1] = A
        assert after["argv"] == expected
    assert pinned["checkpoint"]["models"][0]["commit"] == A
    assert piece["checkpoint"]["models"][0].get("commit") is None  # the input is left as it was
    assert {k: v for k, v in pinned.items() if k not in ("processes", "checkpoint")} == \
        {k: v for k, v in piece.items() if k not in ("processes", "checkpoint")}


def test_the_draft_is_pinned_by_its_own_flag():
    plan = make_plan("sglang-h200-low-latency", overrides={"options": ["dflash2"]}).to_json()
    models = {m["repo"]: m for m in plan["cache"]["models"]}
    draft = next(r for r in models if r != plan["model"]["repo"])
    assert models[draft]["flag"] == "--speculative-draft-model-revision"
    (worker,) = _engines(_pinned(plan, {plan["model"]["repo"]: A, draft: B}))
    assert _after(worker["argv"], "--revision") == [A]
    assert _after(worker["argv"], "--speculative-draft-model-revision") == [B]


def test_a_commit_given_as_the_revision_is_its_own_pin():
    plan = make_plan("h200-pd-1node", overrides={"model_revision": B}).to_json()
    pinned = _pinned(plan, {})
    assert pinned[0]["checkpoint"]["models"][0]["commit"] == B
    assert all(_after(p["argv"], "--revision") == [B] for p in _engines(pinned))


def test_what_is_not_a_commit_is_never_pinned():
    plan = make_plan("h200-pd-1node").to_json()
    with pytest.raises(ValueError, match="not 40-hex"):
        _pinned(plan, {"zai-org/GLM-5.3-Flash": "main\nExecStartPre=/bin/sh"})


def test_the_revision_flags_are_the_plans_own():
    with pytest.raises(PlanError, match="pins the commit the cache step downloaded"):
        make_plan("h200-pd-1node", overrides={"args": {"decode": {"--revision": "abc"}}})
    with pytest.raises(PlanError, match="gpufleet_model_revision"):
        make_plan("h200-agg", overrides={"args": {"worker": {"--revision": "abc"}}})


def _slurped(repo: str, revision: str, content: str | None) -> dict:
    item = {"repo": repo, "revision": revision}
    if content is None:
        return {"item": item, "failed": True, "msg": "file not found"}
    return {"item": item, "content": base64.b64encode(content.encode()).decode()}


def _hostvars(**results) -> dict:
    return {h: {"__serve_refs": {"results": r},
                "gpufleet_host": {"checkpoint": {"hub": "/var/cache/gpufleet/hf/hub"}}}
            for h, r in results.items()}


def test_the_hosts_refs_give_one_commit_per_checkpoint():
    repo = "zai-org/GLM-5.3-Flash"
    got = checkpoint_commits(_hostvars(a=[_slurped(repo, "main", A + "\n")],
                                       b=[_slurped(repo, "main", A)],
                                       router=[{"skipped": True}]), ["a", "b", "router"])
    assert got == {"commits": {repo: A}, "problems": [], "notes": []}


def test_hosts_that_disagree_or_lack_the_ref_are_named_with_the_fix():
    repo = "zai-org/GLM-5.3-Flash"
    got = checkpoint_commits(_hostvars(a=[_slurped(repo, "main", A)],
                                       b=[_slurped(repo, "main", B)]), ["a", "b"])
    assert got["commits"] == {}
    assert f"a {A}, b {B}" in got["problems"][0] and "gpufleet_cache_dir" in got["problems"][0]
    missing = checkpoint_commits(_hostvars(a=[_slurped(repo, "v1", None)]), ["a"])
    path = ref_path("/var/cache/gpufleet/hf/hub", {"repo": repo, "revision": "v1"})
    assert path == "/var/cache/gpufleet/hf/hub/models--zai-org--GLM-5.3-Flash/refs/v1"
    assert missing["problems"] == [f"a: {repo}@v1 has no ref on the cache ({path}). Fix: run "
                                   "the cache play first (fab deploy, or playbooks/cache.yml "
                                   "before playbooks/serve.yml)"]
    # a check-mode run before the cache play: noted, the revision stays
    noted = checkpoint_commits(_hostvars(a=[_slurped(repo, "v1", None)]), ["a"], True)
    assert noted["problems"] == [] and noted["commits"] == {} and len(noted["notes"]) == 1
    garbage = checkpoint_commits(_hostvars(a=[_slurped(repo, "main", "../../etc")]), ["a"])
    assert "not a commit" in garbage["problems"][0]


def test_two_hosts_of_a_pool_serve_one_pin():
    inv = hosts(workers=2)
    plan = make_plan("h200-pd-1node", inv, {"workers": {"prefill": 2, "decode": 2}}).to_json()
    engines = _engines(_pinned(plan, {"zai-org/GLM-5.3-Flash": A}))
    assert len({p["host"] for p in engines}) == 2
    assert all(_after(p["argv"], "--revision") == [A] for p in engines)
