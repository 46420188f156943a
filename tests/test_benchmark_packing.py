"""scripts/benchmark_packing.py on its real command line, tiny settings: the loss check ran and passed,
and the JSON's numbers agree with each other (no timing assertions: only how they were derived)."""

import json
import math
import os
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT, SCRIPTS, load_script


ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",  # this checkout's package, whatever the environment has installed
    "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
}


def run(*argv):
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "benchmark_packing.py"), *argv],
        cwd=REPO_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_benchmark_packing_checks_the_loss_and_writes_consistent_json(tmp_path):
    out = tmp_path / "packing.json"
    argv = [
        "--num_batches",
        "2",
        "--passes",
        "1",
        "--warmup",
        "1",
        "--batch_size",
        "4",
        "--max_seq_length",
        "64",
        "--threads",
        "1",
        "--json",
        str(out),
    ]
    result = run(*argv)
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["command"] == "python scripts/benchmark_packing.py " + " ".join(argv)
    assert r["args"]["batch_size"] == 4 and r["args"]["kernels"] == "auto" and r["args"]["model_size"] == "tiny"
    assert {"cpu", "torch", "transformers"} <= set(r["machine"]) and r["machine"]["torch_threads"] == 1
    assert r["timed"] == "forward + backward per batch, training mode"

    check = r["loss_check"]
    assert check["tolerance"] == 1e-5 and check["abs_diff"] <= 1e-5
    assert check["abs_diff"] == pytest.approx(abs(check["padded"] - check["packed"]), abs=1e-12)

    d = r["data"]
    lengths = d["token_lengths"]
    assert d["rows"] == len(lengths) == 8 and max(lengths) <= 64
    assert d["real_tokens"] == sum(lengths)
    batches = [lengths[i : i + 4] for i in range(0, 8, 4)]
    assert d["padded_grid_tokens"] == sum(len(b) * max(b) for b in batches)  # each batch padded to its longest row
    assert d["real_token_fraction"] == pytest.approx(d["real_tokens"] / d["padded_grid_tokens"])
    assert d["tokens_min_median_max"][0] == min(lengths) and d["tokens_min_median_max"][2] == max(lengths)

    for path in ("padded", "packed"):
        p = r[path]
        assert p["seconds"] > 0 and len(p["seconds_per_pass"]) == 1
        assert p["seconds"] == pytest.approx(sum(p["seconds_per_pass"]))
        assert p["sequences_per_s"] == pytest.approx(8 / p["seconds"])
        assert p["real_tokens_per_s"] == pytest.approx(d["real_tokens"] / p["seconds"])
    assert r["speedup"] == pytest.approx(r["padded"]["seconds"] / r["packed"]["seconds"])
    assert r["speedup_min"] == pytest.approx(r["speedup"]) == pytest.approx(r["speedup_max"])
    assert f"{r['speedup']:.2f}x" in r["markdown_table"] and r["markdown_table"] in result.stdout
    assert "loss check (first batch, dropout off)" in result.stdout and math.isfinite(check["padded"])

    # "auto": the kernels KERNEL_TABLE names for the timed steps (CPU, training, float32); the tiny model (2 layers)
    # kernelized: the encoder seam and each layer's attention seam
    kernels = r["kernels"]
    layers = 2
    assert kernels == {
        "setting": "auto",
        "kernels": {"training": ["unpadded"]},
        "kernelized": {"attention_function": layers, "unpadded_encoder_forward": 1},
        "sparse_prediction": False,
    }
    assert "kernels: auto (unpadded)" in result.stdout


@pytest.mark.parametrize(
    "kernels,ran,cell",
    [
        ("reference", [], ", `kernels=reference`"),
        ("unpadded", ["unpadded"], ", `kernels=unpadded`"),
    ],
)
def test_benchmark_packing_runs_the_kernels_it_is_given(kernels, ran, cell, monkeypatch):
    """--kernels goes to hf_bert_impl.kernelize (reference: the model is not kernelized, the plain model runs padded
    batches on the whole grid and packed rows on a block-diagonal mask): the loss check still holds, the JSON records
    the forced set and the modules kernelized, the table's threads cell names it."""
    from hf_bert_impl import kernelized

    bench = load_script("benchmark_packing")
    built, build = [], bench.BertImplForTokenClassification
    monkeypatch.setattr(
        bench, "BertImplForTokenClassification", lambda config: built.append(build(config)) or built[-1]
    )
    r = bench.main(
        [
            "--num_batches",
            "1",
            "--batch_size",
            "4",
            "--max_seq_length",
            "32",
            "--passes",
            "1",
            "--warmup",
            "0",
            "--model_size",
            "debug",
            "--kernels",
            kernels,
        ]
    )
    modules = kernelized(built[0])
    assert r["args"]["kernels"] == kernels and len(modules) == sum(r["kernels"]["kernelized"].values())
    if kernels == "reference":
        assert modules == {}
    else:  # the seams of the debug model (2 layers) have the forced setting on them
        assert modules["bert.layers"] == "unpadded_encoder_forward"
        assert modules["bert.layers.0.attn.attention_function"] == "attention_function"
    assert r["kernels"] == {
        "setting": kernels,
        "kernels": {"training": ran},
        "kernelized": r["kernels"]["kernelized"],
        "sparse_prediction": False,
    }
    assert r["loss_check"]["abs_diff"] <= 1e-5 and f"| 1{cell} |" in r["markdown_table"]


def test_benchmark_packing_bad_value_is_a_one_line_usage_error():
    result = run("--num_batches", "0")
    assert result.returncode == 2
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert lines == [
        "benchmark_packing.py: error: --batch_size, --num_batches and --passes must be >= 1, got 32, 0, 3"
    ], result.stderr


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--passes", "0"], "--batch_size, --num_batches and --passes must be >= 1, got 32, 10, 0"),
        (["--max_seq_length", "1000"], "--max_seq_length must be in [8, 512]"),
        (["--model_size", "huge"], "--model_size must be one of ['debug', 'tiny', 'mini'"),
        (["--threads", "-1"], "--warmup and --threads must be >= 0, got 2, -1"),
        (["--kernels", "fast"], "--kernels must be auto, reference or kernel names from unpadded"),
        (["--kernels", "unpadded,nope"], "got 'unpadded,nope'"),
    ],
)
def test_benchmark_packing_rejects_bad_values_before_any_work(argv, message, capsys):
    bench = load_script("benchmark_packing")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("benchmark_packing.py: error: ") and message in err, err


def test_benchmark_packing_stops_when_the_layouts_disagree(monkeypatch, capsys):
    """Packed rows without position_ids read as one long sequence (attention crosses the boundaries):
    the loss check must catch it and stop before timing."""
    bench = load_script("benchmark_packing")
    real = bench.DataCollatorWithFlattening
    monkeypatch.setattr(bench, "DataCollatorWithFlattening", lambda **kw: real(return_position_ids=False))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--num_batches", "1", "--batch_size", "4", "--max_seq_length", "64", "--passes", "1"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("benchmark_packing.py: error: padded and packed losses differ"), err
