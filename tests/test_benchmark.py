"""scripts/benchmark.py, run in this process through its `main(argv)` on the tiny size with one timed pair: the output
checks ran and passed, every reported number follows from the raw times (no assertion on which model is faster), the
kernels ours ran are recorded (`ours_kernels`: the `--kernels` setting, the kernels it runs, the modules kernelized),
the anchors (`--against`) check each runner first, and bad arguments stop with a one-line message.

Run: pytest tests/test_benchmark.py -q
"""

import json
import statistics
from collections import Counter

import pytest
import torch

from hf_bert_impl import BertImplForMaskedLM, kernelized
from hf_bert_impl import kernels_bert_impl as K
from hf_bert_impl.configuration_bert_impl import SIZE_PRESETS

from .conftest import load_script


LAYERS = SIZE_PRESETS["tiny"]["num_hidden_layers"]
# what "unpadded" puts on a model (hf_bert_impl.kernelized's values, counted): the encoder, each layer's attention
UNPADDED = {"attention_function": LAYERS, "unpadded_encoder_forward": 1}


# the tiny size on the CPU, one timed pair; the matmul peak on 256² matrices (see `_tiny_benchmark`)
TINY = (
    "--size",
    "tiny",
    "--device",
    "cpu",
    "--seq_len",
    "16",
    "--batch_size",
    "2",
    "--pairs",
    "1",
    "--warmup",
    "0",
    "--peak_n",
    "256",
)


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmark")


def _tiny_benchmark(bench, tmp_path, *argv) -> dict:
    """scripts/benchmark.py on the CPU, the tiny size, one timed pair, plus `argv`; its JSON result. The matmul peak
    (MFU's ceiling, sampled before and after every workload) is measured on 256² instead of 1536² matrices
    (`--peak_n`): a bf16 GEMM of that size takes seconds on a CPU without bf16 instructions."""
    out = tmp_path / "bench.json"
    bench.main(
        [
            *TINY,
            *argv,
            "--json",
            str(out),
        ]
    )
    return json.loads(out.read_text())


def _assert_row_follows_from_its_times(row, baseline, peak):
    """A workload's numbers are derived from its raw times: latency = the median time, tokens/s = tokens / latency
    (real / padded = the real-token fraction), MFU = model FLOPs / latency / the run's matmul peak, and the ratio = the
    median over pairs of t_baseline / t_ours, which with one pair is ours' tokens/s over the baseline's."""
    a, b = row[baseline]["times_s"], row["ours"]["times_s"]
    assert len(a) == len(b) == row["pairs"] == 1
    assert row["ratio_median"] == pytest.approx(statistics.median(x / y for x, y in zip(a, b)), rel=1e-9)
    ours_speed, theirs_speed = row["ours"]["tokens_per_s_real"], row[baseline]["tokens_per_s_real"]
    assert row["ratio_median"] == pytest.approx(ours_speed / theirs_speed, rel=1e-9)
    for tag in (baseline, "ours"):
        r, t = row[tag], statistics.median(row[tag]["times_s"])
        assert r["latency_ms"] == pytest.approx(1e3 * t, rel=1e-9)
        assert r["tokens_per_s_real"] / r["tokens_per_s_padded"] == pytest.approx(row["real_token_fraction"])
        assert r["mfu"] == pytest.approx(row["model_flops"] / t / peak, rel=1e-9)


def _assert_peak_is_the_best_sample(result, samples):
    """The matmul peak: torch.mm's (the only kernel measured), sampled `samples` times; the best is the ceiling."""
    peak = result["matmul_peak_flops"]
    assert len(peak["samples"]) == samples and all(set(s) == {"torch.mm"} for s in peak["samples"])
    assert peak["best"] == max(s["torch.mm"] for s in peak["samples"]) == peak["best_per_kernel"]["torch.mm"]


def test_benchmark_script_checks_outputs_and_writes_json(bench, tmp_path):
    """One timed pair of the tiny size: the output checks ran and passed, every reported number follows from the raw
    times, and each workload's row records the kernels ours ran ("auto": the table's entry for the CPU, inference and
    float32, and the modules kernelized); the run's record is the table's inference entry, without modules."""
    result = _tiny_benchmark(bench, tmp_path, "--workloads", "fixed,mixed", "--memory", "false")
    assert result["device_type"] == "cpu" and result["args"]["kernels"] == "auto"
    assert result["command"].startswith("python scripts/benchmark.py --size tiny --device cpu")
    checks = result["backends"]["sdpa"]["checks"]
    assert {
        "fixed_max_abs_diff",
        "mixed_max_abs_diff",
        "mlm_loss_abs_diff",
        "mlm_logits_max_abs_diff",
        "mlm_grad_max_abs_diff",
    } <= set(checks)
    assert "mlm_dense_loss_abs_diff" not in checks  # mlm_dense not asked for
    assert all(v <= 1e-5 for v in checks.values()), checks
    rows = result["backends"]["sdpa"]["workloads"]
    assert set(rows) == {"fixed", "mixed"}
    assert rows["mixed"]["real_token_fraction"] < 1.0 and rows["fixed"]["real_token_fraction"] == 1.0
    assert result["backends"]["sdpa"]["mixed_lengths"] == bench.mixed_lengths(16, 2, torch.Generator().manual_seed(1))
    entry = list(K.table_kernels("cpu", False, torch.float32))
    for row in rows.values():
        _assert_row_follows_from_its_times(row, "transformers", result["matmul_peak_flops"]["best"])
        assert row["ours_kernels"] == {
            "setting": "auto",
            "kernels": entry,
            "kernelized": UNPADDED if "unpadded" in entry else {},
        }
        assert "peak_memory_mb" not in row["ours"] and "memory_ratio" not in row  # --memory false
    assert result["kernels"] == {"setting": "auto", "kernels": entry}
    _assert_peak_is_the_best_sample(result, samples=1 + len(rows) + 1)  # the start, after each workload, the end
    assert "| sdpa | mixed |" in result["markdown_table"] and "| sdpa | fixed |" in result["markdown_table"]


def test_benchmark_measures_peak_memory_of_the_mlm_step(bench, tmp_path):
    """--memory (the default): one profiled call per model; an MLM step records its peak and activations, the memory
    ratio is ours' peak over transformers'."""
    result = _tiny_benchmark(bench, tmp_path, "--workloads", "mlm")
    row = result["backends"]["sdpa"]["workloads"]["mlm"]
    for tag in ("transformers", "ours"):
        assert row[tag]["peak_memory_mb"] > 0 and row[tag]["activation_memory_mb"] > 0
        assert row[tag]["activation_memory_mb"] <= row[tag]["peak_memory_mb"]
    assert row["memory_ratio"] == pytest.approx(row["ours"]["peak_memory_mb"] / row["transformers"]["peak_memory_mb"])
    assert row["ours_kernels"]["kernels"] == list(K.table_kernels("cpu", True, torch.float32))  # training's entry


@pytest.mark.slow  # ONNX export, OpenVINO conversion, two torch.compile
def test_benchmark_against_the_serving_runtimes_in_one_run(bench, tmp_path, monkeypatch):
    """--against onnxruntime,openvino,compile: transformers in torch, ours (kernelized, "auto"), onnxruntime running
    transformers' and our ONNX export, OpenVINO (f32 hint and its defaults) and torch.compile of both, in one
    interleaved run; each runner's output checked against float32 transformers first (its error and precision in the
    JSON, within its precision's tolerance), the versions recorded, every ratio (ours / runner) from the raw times,
    one markdown row per runner."""
    monkeypatch.setenv("CI", "true")  # openvino's usage telemetry off (it writes under ~/intel outside CI)
    for module in ("openvino", "onnxruntime", "onnxscript"):
        pytest.importorskip(module)
    result = _tiny_benchmark(bench, tmp_path, "--against", "onnxruntime,openvino,compile", "--memory", "false")
    anchors = result["backends"]["anchors"]
    assert set(result["backends"]) == {"anchors"} and anchors["weights"] == "f32"
    runners = {
        "transformers",
        "ours",
        "onnxruntime_transformers",
        "onnxruntime_ours",
        "openvino_f32",
        "openvino_default",
        "transformers_compile",
        "ours_compile",
    }
    assert anchors["anchors"] == ["onnxruntime", "openvino", "compile"]
    assert set(anchors["versions"]) == {"torch", "onnxruntime", "openvino"}
    assert set(anchors["workloads"]) == {"fixed", "mixed"} and anchors["errors"] == {
        w: {tag: anchors["workloads"][w][tag]["max_abs_diff_vs_transformers_fp32"] for tag in runners}
        for w in ("fixed", "mixed")
    }
    entry = list(K.table_kernels("cpu", False, torch.float32))
    for workload, row in anchors["workloads"].items():
        assert runners == {tag for tag in row if isinstance(row[tag], dict) and "times_s" in row[tag]}, sorted(row)
        _assert_row_follows_from_its_times(row, "transformers", result["matmul_peak_flops"]["best"])
        assert row["ours_kernels"] == {
            "setting": "auto",
            "kernels": entry,
            "kernelized": UNPADDED if "unpadded" in entry else {},
        }
        for tag in runners - {"ours"}:
            ratio = statistics.median(a / b for a, b in zip(row[tag]["times_s"], row["ours"]["times_s"]))
            assert row[f"ours_vs_{tag}_median"] == pytest.approx(ratio, rel=1e-9)
        for tag in runners:
            error, mean = row[tag]["max_abs_diff_vs_transformers_fp32"], row[tag]["mean_abs_diff_vs_transformers_fp32"]
            assert error == anchors["errors"][workload][tag] <= anchors["tolerances"][tag]
            assert mean == anchors["mean_errors"][workload][tag] <= error
        assert row["openvino_f32"]["precision"] == "f32" and row["openvino_default"]["precision"] in ("f32", "bf16")
    for tag in runners:  # a float32 runner: within 1e-4 of float32 transformers
        if anchors["workloads"]["fixed"][tag]["precision"] == "f32":
            assert anchors["tolerances"][tag] == 1e-4
    assert all(f"| {tag} |" in result["markdown_table"] for tag in runners)


def test_benchmark_stops_when_a_runner_disagrees(bench, monkeypatch, capsys):
    """--against: a runner whose output is off float32 transformers (here 1.0 off; uncompiled, so the check is what
    is tested) stops the run before any timing, exit status 2, naming the runner."""

    def off_by_one(hf, ours, precision="f32"):
        return {"transformers_compile": (lambda batch: hf.bert(**batch).last_hidden_state + 1.0, precision)}

    timed = []
    monkeypatch.setattr(bench, "compiled_runners", off_by_one)
    monkeypatch.setattr(bench, "interleaved", lambda *a: timed.append(a) or pytest.fail("timed after a failed check"))
    with pytest.raises(SystemExit) as stop:
        bench.main(
            [
                *TINY,
                "--against",
                "compile",
                "--memory",
                "false",
            ]
        )
    assert stop.value.code == 2 and timed == []
    err = capsys.readouterr().err
    assert "benchmark.py: error: outputs differ from float32 transformers" in err and "transformers_compile" in err


def test_benchmark_against_openvino_in_bf16(bench, tmp_path, monkeypatch):
    """--dtype bf16 --against openvino: transformers and ours run bf16 weights (the same weights, rounded), OpenVINO
    converts the float32 model and runs its default precision (bf16 where the CPU has bf16 units) beside its f32
    hint; each error is against float32 transformers, a bf16 runner's within 3x transformers' own bf16 error (the
    transformers runner's), an f32 one's within 1e-4. Ours' kernels: the table's bf16 inference entry."""
    monkeypatch.setenv("CI", "true")  # openvino's usage telemetry off
    pytest.importorskip("openvino")
    result = _tiny_benchmark(bench, tmp_path, "--dtype", "bf16", "--against", "openvino", "--memory", "false")
    anchors = result["backends"]["anchors"]
    assert anchors["weights"] == "bf16" and "bf16_autocast_error_transformers" not in anchors
    own = max(anchors["errors"][w]["transformers"] for w in ("fixed", "mixed"))
    assert anchors["bf16_error_transformers"] == own > 1e-4  # bf16 rounding, far above float32's
    entry = list(K.table_kernels("cpu", False, torch.bfloat16))
    for workload, row in anchors["workloads"].items():
        assert row["transformers"]["precision"] == row["ours"]["precision"] == "bf16"
        assert row["openvino_f32"]["precision"] == "f32" and row["openvino_default"]["precision"] in ("f32", "bf16")
        for tag in ("transformers", "ours", "openvino_f32", "openvino_default"):
            limit = 1e-4 if row[tag]["precision"] == "f32" else 3 * own
            assert anchors["tolerances"][tag] == pytest.approx(limit)
            assert row[tag]["max_abs_diff_vs_transformers_fp32"] == anchors["errors"][workload][tag] <= limit
            mean = row[tag]["mean_abs_diff_vs_transformers_fp32"]
            assert mean == anchors["mean_errors"][workload][tag] <= anchors["errors"][workload][tag]
        assert row["transformers"]["mean_abs_diff_vs_transformers_fp32"] > 1e-5  # bf16 rounding, on average too
        assert row["ours_kernels"]["setting"] == "auto" and row["ours_kernels"]["kernels"] == entry
        _assert_row_follows_from_its_times(row, "transformers", result["matmul_peak_flops"]["best"])
    assert result["kernels"] == {"setting": "auto", "kernels": entry}


def test_benchmark_dense_mlm_step_checks_full_logits(bench, tmp_path, monkeypatch):
    """The MLM step with full logits (mlm_dense: ours with `config.sparse_prediction = False`) is checked against
    transformers' (b, s, V) logits before timing and timed as its own row; the mlm row runs the sparse decoder
    (`sparse_prediction = True`: logits (n, V), the masked positions only). Ours' prediction head is spied on: in
    the checks and in each timed step it ran on the rows its workload names."""
    heads, original = [], BertImplForMaskedLM._mlm_logits_and_loss  # [(phase, logits.dim())], ours only

    def spy(self, *args, **kwargs):
        logits, loss = original(self, *args, **kwargs)
        heads.append((phase[-1], self.config.sparse_prediction, logits.dim()))
        return logits, loss

    phase, interleaved = ["checks"], bench.interleaved

    def timed(fns, *rest):
        phase.append(f"timed {len(phase)}")
        return interleaved(fns, *rest)

    monkeypatch.setattr(BertImplForMaskedLM, "_mlm_logits_and_loss", spy)
    monkeypatch.setattr(bench, "interleaved", timed)
    result = _tiny_benchmark(bench, tmp_path, "--workloads", "mlm,mlm_dense", "--memory", "false")
    checks = result["backends"]["sdpa"]["checks"]
    assert checks["mlm_dense_logits_max_abs_diff"] <= 1e-5 and checks["mlm_dense_loss_abs_diff"] <= 1e-5
    assert checks["mlm_logits_max_abs_diff"] <= 1e-5 and checks["mlm_dense_grad_max_abs_diff"] <= 1e-5
    # the checks: the sparse step, then the dense one; timed: mlm sparse, mlm_dense dense (one pair each)
    assert heads == [("checks", True, 2), ("checks", False, 3), ("timed 1", True, 2), ("timed 2", False, 3)]
    rows = result["backends"]["sdpa"]["workloads"]
    assert list(rows) == ["mlm", "mlm_dense"]
    entry = list(K.table_kernels("cpu", True, torch.float32))
    for row in rows.values():
        _assert_row_follows_from_its_times(row, "transformers", result["matmul_peak_flops"]["best"])
        assert len(row["load_average_after"]) == 3
        assert row["ours_kernels"]["kernels"] == entry  # sparse prediction is a model option, not a kernel
    assert rows["mlm_dense"]["model_flops"] > rows["mlm"]["model_flops"]  # the head on every position
    assert "| sdpa | mlm_dense |" in result["markdown_table"]


def test_benchmark_under_bf16_autocast(bench, tmp_path):
    """--dtype autocast: float32 weights, every forward under bf16 autocast; the outputs are checked against float32
    first (ours within 3x transformers' own bf16 error, which must be non-zero: bf16 ran), MFU is against the bf16
    matmul peak and the bf16 targets apply."""
    result = _tiny_benchmark(
        bench, tmp_path, "--dtype", "autocast", "--workloads", "fixed,mixed,mlm_dense", "--memory", "false"
    )
    checks = result["backends"]["sdpa"]["checks"]
    for name in ("fixed", "mixed"):
        hf_err, ours_err = checks[f"{name}_hf_bf16_err"], checks[f"{name}_ours_bf16_err"]
        assert 0 < hf_err and ours_err <= 3 * hf_err, checks
    rows = result["backends"]["sdpa"]["workloads"]
    assert set(rows) == {"fixed", "mixed", "mlm_dense"}
    for row in rows.values():
        _assert_row_follows_from_its_times(row, "transformers", result["matmul_peak_flops"]["best"])
    assert rows["fixed"]["ours_kernels"]["kernels"] == list(K.table_kernels("cpu", False, torch.float32))  # weights
    assert "| sdpa | fixed |" in result["markdown_table"] and ">= 1.3x" in result["markdown_table"]


def test_benchmark_autocast_scope_run_times_inference_inside_one_context(bench, tmp_path, monkeypatch):
    """--autocast_scope run: every timed inference call of a workload runs inside one autocast context (what a serving
    loop does); training steps keep a context each."""
    timed, interleaved = [], bench.interleaved

    def spy(fns, *rest):  # records, per timed workload, whether autocast was already on around its calls
        timed.append(torch.is_autocast_enabled("cpu"))
        return interleaved(fns, *rest)

    monkeypatch.setattr(bench, "interleaved", spy)
    result = _tiny_benchmark(
        bench,
        tmp_path,
        "--dtype",
        "autocast",
        "--autocast_scope",
        "run",
        "--workloads",
        "fixed,mlm",
        "--memory",
        "false",
    )
    assert result["args"]["autocast_scope"] == "run" and timed == [True, False]
    _tiny_benchmark(bench, tmp_path, "--dtype", "autocast", "--workloads", "fixed", "--memory", "false")
    assert timed[-1] is False  # the default: a context per forward


@pytest.mark.parametrize("kernels", ["reference", "unpadded"])
def test_benchmark_kernels_option_kernelizes_ours(bench, tmp_path, monkeypatch, capsys, kernels):
    """--kernels goes to hf_bert_impl.kernelize(ours, kernels): "reference" leaves ours the plain model (nothing
    kernelized, no packed rows; it still matches transformers); forced "unpadded" runs the mixed batch's layers on its
    real tokens (attention per sequence of the packed row). Each workload's row records the setting, its kernels and
    the modules kernelized; the log says it too."""
    packed = []  # per attention call of a kernelized model: whether it got a packed row's sequence lengths
    per_sequence = K.per_sequence_attention  # looked up when the kernelized attention_function is called

    def spy(*args, seq_lengths=None, **kwargs):
        packed.append(seq_lengths is not None)
        return per_sequence(*args, seq_lengths=seq_lengths, **kwargs)

    monkeypatch.setattr(K, "per_sequence_attention", spy)
    built, build = [], bench.build_models
    monkeypatch.setattr(bench, "build_models", lambda *a: built.append(build(*a)) or built[-1])
    result = _tiny_benchmark(bench, tmp_path, "--kernels", kernels, "--workloads", "mixed,mlm", "--memory", "false")
    ours = built[0][1]
    assert result["args"]["kernels"] == kernels
    checks = result["backends"]["sdpa"]["checks"]
    assert checks["mixed_max_abs_diff"] <= 1e-5 and checks["mlm_logits_max_abs_diff"] <= 1e-5
    assert checks["mlm_grad_max_abs_diff"] <= 1e-5
    if kernels == "reference":
        assert kernelized(ours) == {} and packed == []
    else:
        assert Counter(kernelized(ours).values()) == UNPADDED
        assert any(packed)  # the mixed batch (checks and timing); the mlm batch has no padding: the plain forward
    expected = [] if kernels == "reference" else ["unpadded"]
    for row in result["backends"]["sdpa"]["workloads"].values():
        assert row["ours_kernels"] == {
            "setting": kernels,
            "kernels": expected,
            "kernelized": {} if kernels == "reference" else UNPADDED,
        }
    assert result["kernels"] == {"setting": kernels, "kernels": expected}
    said = "reference: none (the plain model)" if kernels == "reference" else "unpadded: unpadded"
    out = capsys.readouterr().out
    assert f"mixed  ours' kernels: {said}" in out and f"mlm    ours' kernels: {said}" in out


def test_benchmark_mlm_step_uses_the_optimizer_trainer_builds(bench, tmp_path, monkeypatch):
    """The MLM steps step the optimizer Trainer builds for --optim: by default Trainer's own (fused AdamW), the same
    for both models; --optim adamw_torch gives torch's per-parameter AdamW, which the runs before 0.3.6 timed."""
    from transformers import TrainingArguments

    made, make = [], bench.make_optimizer
    monkeypatch.setattr(bench, "make_optimizer", lambda *a: made.append(make(*a)) or made[-1])
    default = TrainingArguments(str(tmp_path)).optim
    assert bench.optimizer_args(bench.BenchmarkArguments()).optim == default  # Trainer's default
    _tiny_benchmark(bench, tmp_path, "--workloads", "mlm", "--memory", "false")
    assert len(made) == 2 and all(type(o) is torch.optim.AdamW and o.defaults["fused"] for o in made)
    assert [o.defaults["weight_decay"] for o in made] == [0.0, 0.0]  # TrainingArguments' default, as Trainer's groups
    result = _tiny_benchmark(bench, tmp_path, "--workloads", "mlm", "--memory", "false", "--optim", "adamw_torch")
    assert result["args"]["optim"] == "adamw_torch" and len(made) == 4
    assert not any(o.defaults["fused"] for o in made[2:])


def test_benchmark_mixed_lengths_are_the_uniform_quantiles(bench):
    lengths = bench.mixed_lengths(128, 8, torch.Generator().manual_seed(0))
    assert sorted(lengths) == [16, 32, 48, 64, 80, 96, 112, 128]
    assert sum(lengths) / (8 * 128) == 0.5625


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--size", "huge"], "--size must be tiny or base, got 'huge'"),
        (
            ["--workloads", "fixed,train"],
            "--workloads takes a comma-separated subset of fixed,mixed,mlm,mlm_dense, got 'fixed,train'",
        ),
        (["--seq_len", "1000"], "--seq_len must be in [8, 512]"),
        (["--dtype", "fp16"], "--dtype must be one of ['autocast', 'bf16', 'fp32'], got 'fp16'"),
        (["--device", "tpu"], "--device must be auto, cpu or cuda, got 'tpu'"),
        (
            ["--kernels", "fast"],
            "--kernels must be auto, reference or kernel names from unpadded (comma-separated), got 'fast'",
        ),
        (["--kernels", "unpadded,nope"], "got 'unpadded,nope'"),
        (
            ["--against", "tensorrt"],
            "--against must be transformers or a comma-separated subset of onnxruntime,openvino,compile, "
            "got 'tensorrt'",
        ),
        (
            ["--against", "openvino,transformers"],
            "comma-separated subset of onnxruntime,openvino,compile, got 'openvino,",
        ),
        (["--against", "onnxruntime", "--dtype", "bf16"], "--against onnxruntime runs float32 only"),
        (
            ["--against", "openvino", "--dtype", "autocast"],
            "--against openvino runs on the CPU with fp32 or bf16 weights, got --dtype autocast",
        ),
        (["--autocast_scope", "always"], "--autocast_scope must be forward or run, got 'always'"),
        (["--autocast_scope", "run"], "--autocast_scope run needs --dtype autocast, got --dtype fp32"),
        (["--optim", "adamw_fast"], "--optim 'adamw_fast': adamw_fast is not a valid OptimizerNames"),
        (["--backends", "xformers"], "unknown attention backend 'xformers' in --backends"),
    ],
)
def test_benchmark_rejects_bad_arguments(bench, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("benchmark.py: error: ") and err.count("\n") == 1
