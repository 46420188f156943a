"""scripts/gpu_check.sh, dry-run on the CPU, so the GPU check cannot rot between GPU runs: the same
command runs tests/test_cuda.py (HF_BERT_IMPL_TEST_DEVICE=cpu, small sizes) and scripts/benchmark.py
(--size tiny, bf16, CPU), and its JSON must hold every part the GPU run reports.

Run: pytest tests/test_gpu_check.py -q   (about a minute on two cores)
"""

import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT


SCRIPT = REPO_ROOT / "scripts" / "gpu_check.sh"


def run_check(*args, timeout=420):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_BERT_IMPL_TEST_DEVICE")}
    env["PYTHON"] = sys.executable
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "nested" / "check.json"
    proc = run_check("--device", "cpu", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_dry_run_reports_versions_and_every_cuda_test(dry_run):
    result, stdout = dry_run
    assert result["ok"] and result["problems"] == [] and result["device"] == "cpu"
    env = result["environment"]
    assert env["torch"] and env["transformers"] and env["python"] and env["cuda_available"] in (True, False)
    assert "environment: {" in stdout
    tests = result["tests"]
    assert tests["returncode"] == 0 and tests["failed"] == 0 and tests["error"] == 0
    # every test of tests/test_cuda.py ran; the only skips are flash-attention's (no CUDA here)
    names = {c["name"].split("[")[0] for c in tests["cases"] if c["outcome"] == "passed"}
    source = (REPO_ROOT / "tests" / "test_cuda.py").read_text()
    defined = {line.split("(")[0][4:] for line in source.splitlines() if line.startswith("def test_")}
    assert defined and names == defined, defined ^ names
    skipped = [c for c in tests["cases"] if c["outcome"] == "skipped"]
    assert all("flash_attention_2" in c["name"] for c in skipped), skipped
    assert tests["passed"] >= 30
    # the measured numbers travel in the JSON
    measured = [m for c in tests["cases"] if c["outcome"] == "passed" for m in c["measured"]]
    assert any(m.startswith("[cpu Trainer] float32 max|loss diff|") for m in measured)
    assert any("max|bf16 - fp32|: ours" in m for m in measured)


@pytest.mark.slow
def test_dry_run_benchmarks_both_lengths_in_bf16_with_checks_and_targets(dry_run):
    result, stdout = dry_run
    lengths = [str(n) for n in result["plan"]["seq_lens"]]
    assert len(lengths) == 2 and set(result["benchmarks"]) == set(lengths)
    for n in lengths:
        bench = result["benchmarks"][n]
        assert bench["returncode"] == 0
        run = bench["result"]
        assert run["args"]["dtype"] == "bf16" and run["args"]["device"] == "cpu" and run["args"]["seq_len"] == int(n)
        sdpa = run["backends"]["sdpa"]
        checks = sdpa["checks"]
        for w in ("fixed", "mixed"):  # the bf16 output check ran and passed (ours within 3x transformers)
            assert 0 < checks[f"{w}_ours_bf16_err"] <= 3 * checks[f"{w}_hf_bf16_err"], checks
        assert set(sdpa["workloads"]) == {"fixed", "mixed", "mlm", "mlm_dense"}
        assert run["matmul_peak_flops"]["best"] > 0
    rows = result["targets"]
    assert {(r["seq_len"], r["workload"]) for r in rows} == {
        (int(n), w) for n in lengths for w in ("fixed", "mixed", "mlm", "mlm_dense")
    }
    assert all(r["ratio"] > 0 and 0 < r["mfu_ours"] and r["met"] == (r["ratio"] >= r["target"]) for r in rows)
    assert "targets are the GPU proof's" in stdout


@pytest.mark.slow
def test_dry_run_records_the_fsdp_command_and_skips_it_without_cuda(dry_run):
    """The FSDP part runs on CUDA only (accelerate 1.15 applies FSDP on accelerators alone); the dry run still builds
    the one-GPU command a GPU run executes, and an FSDP run's problems are reported."""
    result, stdout = dry_run
    fsdp = result["fsdp"]
    assert "CUDA only" in fsdp["skipped"] and "fsdp: CUDA only" in stdout
    for flag in (
        "--num_processes 1",
        "--use_fsdp",
        "--fsdp_version 2",
        "--fsdp_transformer_layer_cls_to_wrap BertImplLayer",
        "scripts/pretrain_mlm.py",
        "--max_steps 20",
        "--bf16",
    ):
        assert flag in fsdp["command"], (flag, fsdp["command"])
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    ok = {"returncode": 0, "losses": [7.0] * gpu_check.FSDP_STEPS, "reload": "BertImplForMaskedLM"}
    assert gpu_check.fsdp_problems(ok) == [] and gpu_check.fsdp_problems(fsdp) == []
    assert gpu_check.fsdp_problems({**ok, "losses": [float("nan")] * gpu_check.FSDP_STEPS})
    assert gpu_check.fsdp_problems({**ok, "returncode": 1}) and gpu_check.fsdp_problems({**ok, "reload": "failed: x"})


@pytest.mark.parametrize(
    "args,message",
    [
        (["--device", "tpu", "--json", "x.json"], "--device must be cuda or cpu, got 'tpu'"),
        (["--device", "cpu"], "the following arguments are required: --json"),
        (
            ["--device", "cpu", "--json", "x.json", "--only", "speed"],
            "--only must be all, tests, benchmark or fsdp, got 'speed'",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors_with_exit_2(args, message):
    proc = run_check(*args, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("gpu_check.sh: error:")


def test_cuda_requested_without_a_gpu_is_an_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check would run for real")
    proc = run_check("--json", str(tmp_path / "x.json"), timeout=120)
    assert proc.returncode == 2 and "--device cuda, but torch" in proc.stderr and "sees no CUDA device" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_missing_interpreter_is_an_error(tmp_path):
    env = {**os.environ, "PYTHON": str(tmp_path / "no-python")}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--device", "cpu", "--json", "x.json"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and f"no Python interpreter '{tmp_path / 'no-python'}'" in proc.stderr
