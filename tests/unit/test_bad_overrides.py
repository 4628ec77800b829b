"""Every value that reaches a file or a command line is checked by the planner (exit 2,
naming it and the fix) before any host changes: host addresses (nginx's `listen`), the
cache path (the units' ExecStartPre), the revision (the downloader's path), ports, GPU
indices, environment and flag names and values, mirror URLs; credentials never go into
flags or environment overrides; a malformed `--set` and an inventory that would not end
are refused, not crashed on."""

from __future__ import annotations

import pytest
from test_plan_workers import hosts

from gpufleet import cli
from gpufleet import inventory as inv_mod
from gpufleet.model import PlanError
from gpufleet.plan import make_plan

TARGET = "h200-pd-1node"


def refused(overrides: dict, said: str, inventory=None) -> str:
    with pytest.raises(PlanError) as err:
        make_plan(TARGET, inventory, overrides)
    text = str(err.value)
    assert said in text and "Fix: " in text, text
    return text


@pytest.mark.parametrize("address", ["10.0.0.1\nlisten 0.0.0.0:80", "10.0.0.1;", "a b",
                                     "-x", "host_1", "", "fd00::1"])
def test_a_host_address_that_is_no_address_or_name_is_refused(address):
    inv = hosts(workers=1)
    name = next(iter(inv.hosts))
    inv.hosts[name] = inv_mod.Host(name, address, {})
    text = refused({}, f"hosts.{name}", inv)
    assert "gpufleet_internal_address" in text or "IPv4" in text


def test_addresses_and_names_that_are_fine_plan():
    for address in ("10.0.0.1", "gpu-node1.example.internal"):
        inv = hosts(workers=1)
        name = next(iter(inv.hosts))
        inv.hosts[name] = inv_mod.Host(name, address, {})
        assert make_plan(TARGET, inv)


@pytest.mark.parametrize("path", ["/var/cache/x\nExecStartPre=/bin/sh -c id", "relative/hf",
                                  "/var/cache/../../etc", "/var/cache/with space",
                                  "/var/cache/%h"])
def test_a_cache_dir_that_is_no_plain_absolute_path_is_refused(path):
    refused({"cache_dir": path}, "gpufleet_cache_dir")


@pytest.mark.parametrize("revision", ["../../../../x", "main/../../x", "/abs", "a b",
                                      "main\n", "refs..x", "x.lock"])
def test_a_revision_that_is_no_ref_or_commit_is_refused(revision):
    refused({"model_revision": revision}, "gpufleet_model_revision")


def test_refs_and_commits_plan():
    for revision in ("main", "v1.2", "refs/pr/3", "0123456789abcdef0123456789abcdef01234567"):
        assert make_plan(TARGET, None, {"model_revision": revision})


@pytest.mark.parametrize("port", [0, 22, 1023, 70000, True, "eighty", 8000.5])
def test_a_port_outside_1024_65535_or_not_a_number_is_refused(port):
    refused({"ports": {"router": {"http": port}}}, "gpufleet_ports.router.http")


@pytest.mark.parametrize("gpus,said", [([-1, 5, 6, 7], "-1 is not a GPU index"),
                                       ([4, 4, 5, 6], "lists a GPU twice"),
                                       ([True, 5, 6, 7], "True is not a GPU index")])
def test_gpu_indices_that_are_no_indices_are_refused(gpus, said):
    refused({"gpus": {"decode": gpus}}, said)


@pytest.mark.parametrize("env,said", [
    ({"BAD-NAME": "1"}, "is not an environment variable name"),
    ({"A B": "1"}, "is not an environment variable name"),
    ({"1X": "1"}, "is not an environment variable name"),
    ({"UCX_TLS": "tcp\nLD_PRELOAD=/tmp/x.so"}, "holds a control character"),
    ({"HF_TOKEN": "hf_x"}, "names a credential"),
    ({"MY_DB_PASSWORD": "x"}, "names a credential"),
])
def test_environment_names_values_and_credentials_are_checked(env, said):
    refused({"env": {"engines": env}}, said)


@pytest.mark.parametrize("args,said", [
    ({"--max-num-seqs": "256\nExecStartPre=/bin/true"}, "holds a control character"),
    ({"max num seqs": 3}, "is not a command-line flag"),
    ({"--hf-token": "hf_x"}, "names a credential"),
    ({"--api-key": "k"}, "names a credential"),
    ({"--enforce-eager": False}, "leave the flag out with --unset decode:--enforce-eager"),
])
def test_flag_names_values_and_credentials_are_checked(args, said):
    refused({"args": {"decode": args}}, said)


def test_flags_whose_names_only_look_like_tokens_plan():
    assert make_plan(TARGET, None, {"args": {"decode": {"--max-num-batched-tokens": 8192}}})


@pytest.mark.parametrize("field,url,said", [
    ("hf_endpoint", "https://user:pw@mirror.internal", "carries credentials"),
    ("hf_endpoint", "ftp://mirror", "is not an http:// or https:// URL"),
    ("hf_endpoint", "http://mirror\n", "holds a control character"),
    ("registry_mirror", "https://u:p@registry", "carries credentials"),
])
def test_mirror_urls_are_urls_without_credentials(field, url, said):
    text = refused({field: url}, said)
    assert ":pw@" not in text and ":p@" not in text  # the refusal does not repeat them


@pytest.mark.parametrize("item,said", [
    ("decode:--max-num-seqs=", "empty value"),
    ("decode:UCX_TLS=", "empty value"),
    ("decode:--max-num-seqs=null", "remove it with --unset decode:--max-num-seqs"),
    ("decode:--max-num-seqs=~", "remove it with --unset"),
    ("decode:--x=[unclosed", "is not YAML"),
    ("decode:--x={a: [", "is not YAML"),
])
def test_a_malformed_set_is_refused_not_crashed_on_or_taken_as_a_removal(item, said):
    with pytest.raises(PlanError, match=said.replace("[", r"\[")):
        cli.parse_set([item], [])


def test_unset_still_removes():
    assert cli.parse_set([], ["decode:--enforce-eager"])["args"] == {
        "decode": {"--enforce-eager": None}}


@pytest.mark.parametrize("value", [42, {"hicache": True}, [1, 2], True])
def test_gpufleet_with_that_is_no_list_of_names_is_refused(value):
    inv = hosts(workers=1)
    inv.vars["gpufleet_with"] = value
    with pytest.raises(PlanError, match="gpufleet_with.*is not a list of option names"):
        cli.overrides_from(inv, [], {})


BOMB = "".join(f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n"
               for a, b in zip("abcdefgh", "bcdefghi", strict=True))


@pytest.fixture
def alias_bomb(tmp_path):
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "hosts.yml").write_text("all:\n  hosts:\n    h1: {ansible_host: 10.0.0.1}\n")
    (tmp_path / "group_vars" / "all.yml").write_text(
        'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + BOMB)
    return tmp_path


def test_an_inventory_that_would_not_end_is_stopped_by_time(alias_bomb, monkeypatch):
    monkeypatch.setattr(inv_mod, "TIMEOUT_S", 3)
    with pytest.raises(inv_mod.InventoryError, match=r"took over 3 s .*Fix: look for YAML "
                                                     r"aliases"):
        inv_mod.load(str(alias_bomb))


def test_an_inventory_that_would_fill_memory_is_stopped_by_its_bound(alias_bomb, monkeypatch):
    monkeypatch.setattr(inv_mod, "MEMORY_BYTES", 768 << 20)
    with pytest.raises(inv_mod.InventoryError, match=r"needed over 768 MiB"):
        inv_mod.load(str(alias_bomb))


def test_a_pin_the_recipe_requires_changes_only_with_its_reason_acknowledged():
    """002: GB200's image UCX lacks MNNVL IPC (UCX_TLS); 000/002: the layout pins must be
    identical on prefill and decode. An override of one is refused naming the recipe's
    reason; acknowledged in the inventory, it plans (and the other rules still apply)."""
    tls = {"env": {"engines": {"UCX_TLS": "cuda_copy,cuda_ipc,tcp"}}}
    text = refused_on("gb200-disagg", tls, "UCX_TLS is what gb200-disagg's recipe requires")
    assert "lacks MNNVL IPC" in text and "gpufleet_acknowledge: [UCX_TLS]" in text
    plan = make_plan("gb200-disagg", None, {**tls, "acknowledge": ["UCX_TLS"]})
    assert {p.env["UCX_TLS"] for p in plan.engines} == {"cuda_copy,cuda_ipc,tcp"}
    refused_on("gb200-disagg", {"env": {"engines": {"UCX_TLS": None}}}, "dropping it")
    layout = {"env": {"engines": {"VLLM_KV_CACHE_LAYOUT": "NHD"}}}
    refused_on(TARGET, layout, "must be pinned identically on prefill and decode")
    plan = make_plan(TARGET, None, {**layout, "acknowledge": ["VLLM_KV_CACHE_LAYOUT"]})
    assert {p.env["VLLM_KV_CACHE_LAYOUT"] for p in plan.engines} == {"NHD"}
    refused_on(TARGET, {"acknowledge": ["UCX_TSL"]}, "UCX_TSL is none of h200-pd-1node's pins")


def refused_on(target: str, overrides: dict, said: str) -> str:
    with pytest.raises(PlanError) as err:
        make_plan(target, None, overrides)
    assert said in str(err.value) and "Fix: " in str(err.value), str(err.value)
    return str(err.value)
