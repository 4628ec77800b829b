"""What fab acceptance takes from the plan (each host's spec) and the report it prints."""

from __future__ import annotations

import pytest

from gpufleet import acceptance, catalog, cli
from gpufleet.model import host_slices


def slices(target: str, inventory: str | None = None) -> dict:
    return host_slices(cli.build(target, inventory).to_json())


def test_each_engine_on_a_host_is_one_group_against_the_hardware_profile():
    host = slices("h200-pd-1node")
    (name,) = [n for n, h in host.items() if h.get("gpu")]
    spec = acceptance.host_spec(host[name], threshold=0.9, timeout_s=60)
    assert spec["groups"] == [{"name": "prefill", "gpus": [0, 1, 2, 3]},
                              {"name": "decode", "gpus": [4, 5, 6, 7]}]
    assert spec["gpus"] == list(range(8))
    assert spec["python"] == "/opt/gpufleet/engines/vllm-0.33.0/bin/python"
    h200 = catalog.load().hardware["h200"].acceptance
    busbw = {str(size): gbs for size, gbs in h200.busbw_gbs.items()}  # the plan is JSON
    assert spec["expect"] == {"busbw_gbs": busbw, "tflops_bf16": h200.tflops_bf16,
                              "mem_write_gbs": h200.mem_write_gbs}
    assert (spec["threshold"], spec["timeout_s"]) == (0.9, 60)
    assert "CUDA_VISIBLE_DEVICES" not in spec["env"]  # the program picks GPUs by index


def test_only_some_gpus_keeps_the_groups_that_still_have_two():
    host = next(h for h in slices("h200-pd-1node").values() if h.get("gpu"))
    spec = acceptance.host_spec(host, only=[0, 1, 4])
    assert spec["gpus"] == [0, 1, 4]
    assert spec["groups"] == [{"name": "prefill", "gpus": [0, 1]}]


def test_image_hosts_measure_with_the_image_python_and_hosts_without_gpus_get_none():
    hosts = slices("h200-disagg", "inventories/h200")
    for host in hosts.values():
        spec = acceptance.host_spec(host)
        assert spec["gpus"] == (host["gpu"]["used"] if host.get("gpu") else [])
    amd = next(h for h in slices("sglang-mi355x-balanced").values() if h.get("gpu"))
    spec = acceptance.host_spec(amd)
    assert amd["engine"]["runtime"] == "image" and spec["python"] == "python3"
    assert spec["expect"] == {}  # nothing measured on MI355X yet: figures without a verdict


@pytest.mark.parametrize("name", sorted(catalog.load().hardware))
def test_every_nvidia_profile_states_its_figures_and_where_they_come_from(name):
    hw = catalog.load().hardware[name]
    if hw.vendor == "amd":
        assert hw.acceptance is None
        return
    a = hw.acceptance
    assert a.source.startswith(("measured", "derived"))
    assert sorted(a.busbw_gbs) == acceptance.SIZES_MIB
    assert list(a.busbw_gbs.values()) == sorted(a.busbw_gbs.values())  # larger, faster


def test_the_report_has_a_row_per_check_and_names_each_failure_with_its_host():
    reports = {
        "node1": {"passed": False, "checks": [
            {"kind": "nccl", "name": "decode", "gpus": [4, 5], "size_mib": 1024,
             "measured": 150.0, "expected": 329.0, "unit": "GB/s", "ratio": 0.456,
             "verdict": "FAIL", "detail": "GPU 5: NVLink links 0,1 inactive"},
            {"kind": "gpu", "name": "GPU 0", "gpus": [0], "metric": "tflops_bf16",
             "measured": 790.0, "expected": 780.0, "unit": "TFLOPS", "ratio": 1.013,
             "verdict": "pass", "detail": ""}]},
        "node2": {"passed": False, "checks": [], "error": "PyTorch does not load"},
    }
    rows = acceptance.rows(reports)
    assert rows[0][:2] == ["host", "check"]
    assert rows[1] == ["node1", "nccl decode", "4,5", "1024 MiB", "150 GB/s", "329 GB/s", "46%",
                       "FAIL"]
    assert rows[2][3:] == ["tflops_bf16", "790 TFLOPS", "780 TFLOPS", "101%", "pass"]
    assert acceptance.failures(reports) == [
        "node1: nccl decode: GPU 5: NVLink links 0,1 inactive",
        "node2: PyTorch does not load"]


def test_hosts_that_move_data_over_rdma_get_the_all_reduce_across_them():
    hosts = slices("h200-disagg", "inventories/h200")
    every = list(hosts.values())
    specs = [acceptance.host_spec(h, hosts=every, port=30001, only=[0, 1]) for h in every
             if h.get("gpu")]
    assert [s["fabric"]["node_rank"] for s in specs] == [0, 1]
    for spec in specs:
        assert spec["fabric"] == {**spec["fabric"], "over": "ib", "port": 30001,
                                  "hosts": ["h200-node1", "h200-node2"],
                                  "gpus_per_host": [2, 2], "master": "192.0.2.11"}
    # one GPU host, or no host list: nothing across hosts
    single = next(h for h in slices("h200-pd-1node").values() if h.get("gpu"))
    assert acceptance.host_spec(single, hosts=[single])["fabric"] is None
    assert acceptance.host_spec(every[0])["fabric"] is None
