"""The engines' compile caches in the plan: every engine process of one engine build and
GPU type points its compile and JIT caches (vLLM's, SGLang's, Triton's, FlashInfer's) at
one directory on the shared cache, so what one host compiles the others load; the image
runtime's containers mount it writable; an operator's own setting wins."""

from __future__ import annotations

from gpufleet.model import host_slices
from gpufleet.plan import make_plan

CACHE = "/var/cache/gpufleet/hf"


def test_vllm_engines_share_one_directory_by_build_and_gpu():
    plan = make_plan("h200-pd-1node")
    compile_dir = plan.cache["compile"]
    assert compile_dir == f"{CACHE}/compile/vllm-0.33.0-h200"
    engines = [p for p in plan.processes if p.is_engine]
    assert engines and all(p.env["VLLM_CACHE_ROOT"] == f"{compile_dir}/vllm"
                           and p.env["TRITON_CACHE_DIR"] == f"{compile_dir}/triton"
                           and p.env["FLASHINFER_WORKSPACE_BASE"] == f"{compile_dir}/flashinfer"
                           for p in engines)
    assert not any("VLLM_CACHE_ROOT" in p.env for p in plan.processes if not p.is_engine)
    # the hosts' slices carry it (the serve role makes the directory)
    assert all(h["checkpoint"]["compile"] == compile_dir
               for h in host_slices(plan.to_json()).values())
    assert make_plan("b200-pd-1node").cache["compile"].endswith("/vllm-0.33.0-b200")


def test_sglang_and_dynamo_get_their_engines_variables():
    sglang = make_plan("sglang-h200-balanced")
    (worker,) = [p for p in sglang.processes if p.is_engine][:1]
    assert worker.env["SGLANG_JIT_CACHE_ROOT"].startswith(f"{CACHE}/compile/sglang-0.5.23-h200/")
    assert "VLLM_CACHE_ROOT" not in worker.env
    dynamo = make_plan("h200-agg")
    assert all(p.env["VLLM_CACHE_ROOT"].startswith(f"{CACHE}/compile/dynamo-1.6.1-h200/")
               for p in dynamo.processes if p.is_engine)


def test_the_image_runtime_keys_by_image_and_mounts_it_writable():
    plan = make_plan("h200-pd-1node", overrides={"runtime": "image"})
    compile_dir = plan.cache["compile"]
    assert compile_dir == f"{CACHE}/compile/vllm-openai-glm53-flash-h200"
    for p in plan.processes:
        if p.is_engine:
            assert {"source": compile_dir, "target": compile_dir, "read_only": False} \
                in p.container["mounts"]
    pinned = make_plan("h200-pd-1node", overrides={
        "runtime": "image", "images": {"vllm": "docker.io/vllm/vllm-openai@sha256:" + "ab" * 32}})
    assert pinned.cache["compile"].endswith("/compile/vllm-openai-abababababab-h200")


def test_an_operators_own_setting_wins():
    plan = make_plan("h200-pd-1node", overrides={"env": {"decode": {"VLLM_CACHE_ROOT": "/x"}}})
    decode = next(p for p in plan.processes if p.role == "decode")
    prefill = next(p for p in plan.processes if p.role == "prefill")
    assert decode.env["VLLM_CACHE_ROOT"] == "/x"
    assert prefill.env["VLLM_CACHE_ROOT"].endswith("/vllm-0.33.0-h200/vllm")
