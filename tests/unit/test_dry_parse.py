"""gpufleet/host/dry_parse.py: an engine's command line parsed by the installed engine.

The program runs as a subprocess of this Python (scripts/host-pythons runs this file
under every host Python, 3.8 to 3.13) against
- the lab's stand-in engines (vllm and sglang from their wheels, the lab's dynamo.vllm
  from its shim): the same parser entry points as the real engines, the real flag tables
  behind them (needs the controller's packages to build the wheels: skipped elsewhere);
- small engines written here in the layout of older releases (``vllm.utils``,
  ``vllm.entrypoints.openai.cli_args`` without the model positional, a Dynamo
  ``parse_args()`` that reads sys.argv, an engine that logs to stdout on import).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROGRAM = REPO / "gpufleet" / "host" / "dry_parse.py"
FLASH = "zai-org/GLM-5.3-Flash"


def run(path: Path, data, *extra: str) -> tuple[int, dict, str]:
    env = dict(os.environ, PYTHONPATH=str(path), CUDA_VISIBLE_DEVICES="0")
    proc = subprocess.run([sys.executable, "-B", str(PROGRAM), *extra],
                          input=data if isinstance(data, str) else json.dumps(data),
                          capture_output=True, text=True, env=env, timeout=120)
    return proc.returncode, json.loads(proc.stdout), proc.stderr


# --- the lab's stand-ins ---------------------------------------------------------------
@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> Path:
    pytest.importorskip("yaml")  # build.py reads models.yml
    if sys.version_info < (3, 9):
        pytest.skip("the stand-in engines need Python 3.9 (their wheels say so)")
    root = tmp_path_factory.mktemp("standins")
    spec = importlib.util.spec_from_file_location(
        "standins_build", REPO / "lab" / "standins" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    site = root / "site"
    for wheel in build.build(root / "wheels"):
        if wheel.name.startswith(("vllm-", "sglang-")):
            zipfile.ZipFile(wheel).extractall(site)
    sys.path.insert(0, str(REPO / "lab" / "dynamo"))
    try:
        import build as dynamo_build
    finally:
        sys.path.pop(0)
    for name, data in dynamo_build.shim_files().items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(data)
    (site / "dynamo" / "__init__.py").write_text("")
    meta = site / "ai_dynamo-1.6.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: ai-dynamo\nVersion: 1.6.1\n")
    return site


VLLM_GOOD = ["vllm", "serve", FLASH, "--tensor-parallel-size", "8", "--port", "8001",
             "--no-enable-prefix-caching", "--speculative-config",
             '{"method":"mtp","num_speculative_tokens":5}', "--tool-call-parser", "glm47"]
SGLANG_GOOD = ["python3", "-m", "sglang.launch_server", "--model-path", FLASH, "--tp-size",
               "8", "--kv-cache-dtype", "fp8_e4m3", "--host", "127.0.0.1"]
DYNAMO_GOOD = ["python3", "-m", "dynamo.vllm", "--model", FLASH, "--tensor-parallel-size",
               "8", "--disaggregation-mode", "prefill", "--dyn-tool-call-parser", "glm47",
               "--block-size", "128"]


@pytest.mark.parametrize("argv,engine,version", [
    (VLLM_GOOD, "vllm", "0.33.0"), (SGLANG_GOOD, "sglang", "0.5.23"),
    (DYNAMO_GOOD, "dynamo", "1.6.1")])
def test_standin_parses_good_argv(standins, argv, engine, version):
    rc, out, err = run(standins, {"name": "decode", "argv": argv})
    assert (rc, out) == (0, {"ok": True, "name": "decode", "engine": engine,
                              "version": version, "error": None}), err


@pytest.mark.parametrize("argv,message", [
    (VLLM_GOOD + ["--max-num-seq", "8"],
     "vllm serve: error: unrecognized arguments: --max-num-seq"),
    (VLLM_GOOD[:3] + ["--dtype", "fp9"],
     "vllm serve: error: argument --dtype: invalid choice: 'fp9'"),
    (SGLANG_GOOD + ["--disaggregation-mode", "both"],
     "launch_server.py: error: argument --disaggregation-mode: invalid choice: 'both'"),
    (DYNAMO_GOOD + ["--dyn-tool-parser", "glm47"],
     "__main__.py: error: unknown flag --dyn-tool-parser"),
])
def test_standin_refuses_bad_flag_with_engine_message(standins, argv, message):
    rc, out, err = run(standins, {"argv": argv})
    assert rc == 1 and out["ok"] is False
    assert out["error"].startswith(message), out
    assert message in err  # argparse's own output reaches stderr


def test_list_reports_each_process_and_skips_non_engines(standins):
    rc, out, _ = run(standins, [{"name": "etcd", "argv": ["/usr/bin/etcd", "--name", "x"]},
                                {"name": "prefill", "argv": VLLM_GOOD},
                                {"name": "decode", "argv": VLLM_GOOD + ["--bogus"]}])
    assert rc == 1 and out["ok"] is False
    etcd, prefill, decode = out["results"]
    assert etcd["ok"] and etcd["engine"] is None and "not an engine" in etcd["skipped"]
    assert prefill["ok"] and not decode["ok"] and "--bogus" in decode["error"]


def test_argv_of_another_venv_is_refused(standins):
    argv = ["/opt/gpufleet/engines/vllm-0.33.0/bin/vllm"] + VLLM_GOOD[1:]
    rc, out, _ = run(standins, {"argv": argv})
    assert rc == 1 and "is not of this venv" in out["error"]
    assert "/opt/gpufleet/engines/vllm-0.33.0/bin/python" in out["error"]


def test_plan_argv_parses(standins):
    """Every engine argv of real plans (vLLM PD, SGLang PD, Dynamo PD) parses with the
    stand-ins' parsers; the routers, the frontend, etcd and nginx are skipped."""
    plan_mod = pytest.importorskip("gpufleet.plan")
    for target in ("h200-pd-1node", "sglang-h200-pd", "h200-disagg"):
        plan = plan_mod.make_plan(target).to_json()
        procs = [{"name": p["name"], "argv": [os.path.basename(p["argv"][0])] + p["argv"][1:],
                  "env": p["env"]} for p in plan["processes"]]
        rc, out, err = run(standins, procs)
        assert rc == 0, (target, out, err)
        engines = {r["name"] for r in out["results"] if r["engine"]}
        assert {"prefill", "decode"} <= engines, (target, out)


# --- engines in older layouts, under every host Python -----------------------------------
OLD_VLLM = {
    "vllm/__init__.py": "print('INFO vllm imported: this line must not reach stdout')\n",
    "vllm/utils.py": """
        import argparse
        class FlexibleArgumentParser(argparse.ArgumentParser):
            pass
        """,
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/openai/__init__.py": "",
    "vllm/entrypoints/openai/cli_args.py": """
        import json, os
        def make_arg_parser(parser):
            parser.add_argument("--port", type=int)
            parser.add_argument("--gpu-memory-utilization", type=float)
            if os.environ.get("PROBE_OUT"):
                keys = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                        "HF_HUB_OFFLINE", "VLLM_X")
                with open(os.environ["PROBE_OUT"], "w") as f:
                    json.dump({k: os.environ.get(k) for k in keys}, f)
            return parser
        """,
    "vllm-0.6.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.6.0\n",
    "dynamo/__init__.py": "",
    "dynamo/vllm/__init__.py": "",
    "dynamo/vllm/args.py": """
        import argparse, sys
        def parse_args():
            p = argparse.ArgumentParser(allow_abbrev=False)
            p.add_argument("--model")
            p.add_argument("--disaggregation-mode")
            args = p.parse_args()
            if args.disaggregation_mode == "prefill" and "--kv-transfer-config" not in sys.argv:
                raise ValueError("prefill needs --kv-transfer-config")
            return args
        """,
}


@pytest.fixture(scope="module")
def old_engines(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("old")
    for name, text in OLD_VLLM.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(textwrap.dedent(text))
    return site


def test_old_layout_parses_and_logs_stay_off_stdout(old_engines):
    rc, out, err = run(old_engines, {"argv": ["vllm", "serve", "m", "--port", "8000"]})
    assert (rc, out["ok"], out["version"]) == (0, True, "0.6.0"), err
    assert "vllm imported" in err  # the engine's own output went to stderr


def test_old_layout_refuses_bad_value_naming_flag(old_engines):
    rc, out, _ = run(old_engines, {"argv": ["vllm", "serve", "m", "--gpu-memory-utilization",
                                            "most"]})
    assert rc == 1
    assert out["error"] == ("vllm serve: error: argument --gpu-memory-utilization: "
                            "invalid float value: 'most'")


def test_devices_are_hidden_from_the_engine(old_engines, tmp_path):
    """The process's env reaches the engine, then every accelerator is hidden again."""
    probe = tmp_path / "probe.json"
    rc, out, _ = run(old_engines, {"argv": ["vllm", "serve", "m"], "env": {
        "CUDA_VISIBLE_DEVICES": "0,1", "VLLM_X": "1", "PROBE_OUT": str(probe)}})
    assert rc == 0 and out["ok"]
    assert json.loads(probe.read_text()) == {
        "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1", "VLLM_X": "1"}


def test_dynamo_without_argv_parameter_reads_sys_argv(old_engines):
    base = ["python3", "-m", "dynamo.vllm", "--model", "m"]
    rc, out, _ = run(old_engines, {"argv": base + ["--disaggregation-mode", "decode"]})
    assert rc == 0 and out["engine"] == "dynamo" and out["version"] is None
    rc, out, _ = run(old_engines, {"argv": base + ["--disaggregation-mode", "prefill"]})
    assert rc == 1 and out["error"] == "ValueError: prefill needs --kv-transfer-config"
    rc, out, _ = run(old_engines, {"argv": base + ["--modle", "m"]})
    assert rc == 1 and "unrecognized arguments: --modle" in out["error"]


def test_missing_engine_is_reported_not_crashed(tmp_path):
    rc, out, _ = run(tmp_path, {"argv": ["python3", "-m", "sglang.launch_server"]})
    assert rc == 1 and out["error"].startswith("could not load sglang (not installed)'s parser")
    assert "ModuleNotFoundError" in out["error"]


def test_the_memo_answers_the_same_input_without_loading_the_engine(standins, tmp_path):
    memo = tmp_path / "memo.json"
    good = {"argv": ["vllm", "serve", "m", "--max-num-seqs", "8"]}
    rc, out, _ = run(standins, good, "--memo", str(memo), "--memo-key", "p1")
    assert rc == 0 and out["ok"], out
    assert oct(memo.stat().st_mode & 0o777) == "0o600"
    # the memo is what answers now: make it say something the engine never would
    saved = json.loads(memo.read_text())
    memo.write_text(json.dumps({**saved, "rc": 1, "answer": '{"ok": false, "error": "memo"}\n'}))
    rc, out, _ = run(standins, good, "--memo", str(memo), "--memo-key", "p1")
    assert (rc, out["error"]) == (1, "memo")
    # a refusal is not remembered (the operator is about to fix it)
    bad = {"argv": good["argv"] + ["--max-num-seq", "8"]}
    memo.unlink()
    rc, out, _ = run(standins, bad, "--memo", str(memo), "--memo-key", "p1")
    assert rc == 1 and not memo.exists()
    rc, out, _ = run(standins, good, "--memo", str(memo), "--memo-key", "p1")
    # another input, or another program (key), asks the engine again
    rc, out, _ = run(standins, {**good, "argv": good["argv"] + ["--seed", "1"]},
                     "--memo", str(memo), "--memo-key", "p1")
    assert rc == 0 and out["ok"], out
    rc, out, _ = run(standins, good, "--memo", str(memo), "--memo-key", "p2")
    assert rc == 0 and out["ok"], out


def test_a_read_only_memo_answers_but_is_never_written(standins, tmp_path):
    memo = tmp_path / "memo.json"
    good = {"argv": ["vllm", "serve", "m", "--max-num-seqs", "8"]}
    rc, out, _ = run(standins, good, "--memo", str(memo), "--memo-key", "p1", "--memo-read-only")
    assert rc == 0 and out["ok"], out
    assert not memo.exists()
    run(standins, good, "--memo", str(memo), "--memo-key", "p1")
    saved = json.loads(memo.read_text())
    memo.write_text(json.dumps({**saved, "rc": 1, "answer": '{"ok": false, "error": "memo"}\n'}))
    before = memo.stat().st_mtime_ns
    rc, out, _ = run(standins, good, "--memo", str(memo), "--memo-key", "p1", "--memo-read-only")
    assert (rc, out["error"]) == (1, "memo")
    rc, out, _ = run(standins, {**good, "argv": good["argv"] + ["--seed", "1"]},
                     "--memo", str(memo), "--memo-key", "p1", "--memo-read-only")
    assert rc == 0 and out["ok"], out
    assert memo.stat().st_mtime_ns == before


@pytest.mark.parametrize("data", ["not json", {"argv": []}, [{"argv": "vllm serve"}],
                                  {"argv": ["vllm"], "env": ["A=1"]}])
def test_bad_input_exits_2(tmp_path, data):
    rc, out, _ = run(tmp_path, data)
    assert rc == 2 and out["ok"] is False and out["error"].startswith("bad input")


# --- vLLM 0.33's layout, as its wheel has it ----------------------------------------------
# make_arg_parser in vllm.entrypoints.common.cli_args, and a parser that cannot be built on
# an unspecified platform (DeviceConfig: "Failed to infer device type") without a GPU.
VLLM_033 = {
    "vllm/__init__.py": "",
    "vllm/utils/__init__.py": "",
    "vllm/utils/argparse_utils.py": """
        import argparse
        class FlexibleArgumentParser(argparse.ArgumentParser):
            pass
        """,
    "vllm/platforms/__init__.py": """
        class UnspecifiedPlatform:
            device_type = ""
            def is_unspecified(self):
                return True
        current_platform = UnspecifiedPlatform()
        """,
    "vllm/platforms/cpu.py": """
        class CpuPlatform:
            device_type = "cpu"
            def is_unspecified(self):
                return False
        """,
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/common/__init__.py": "",
    "vllm/entrypoints/common/cli_args.py": """
        def make_arg_parser(parser):
            from vllm.platforms import current_platform
            if not current_platform.device_type:
                raise RuntimeError("Failed to infer device type")
            parser.add_argument("model_tag", nargs="?")
            parser.add_argument("--max-num-seqs", type=int)
            return parser
        """,
    "vllm-0.33.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n",
}


def test_vllm_033_layout_parses_without_a_gpu(tmp_path):
    for name, text in VLLM_033.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    rc, out, err = run(tmp_path, {"argv": ["vllm", "serve", "m", "--max-num-seqs", "8"]})
    assert (rc, out["ok"], out["version"]) == (0, True, "0.33.0"), (out, err)
    rc, out, _ = run(tmp_path, {"argv": ["vllm", "serve", "m", "--max-num-sequences", "8"]})
    assert rc == 1
    assert out["error"] == "vllm serve: error: unrecognized arguments: --max-num-sequences 8"
