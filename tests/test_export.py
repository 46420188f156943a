"""Export with proof: torch.export with dynamic batch and sequence, ONNX checked in onnxruntime, OpenVINO's IR
in OpenVINO.

The exported graph is the plain model (the model a user loads; kernels run outside tracing only), so outputs are
compared at every position with torch's plain model and with a kernelized copy (`hf_bert_impl.kernelize`), which runs
the layers on the real tokens only: both write zeros at padding positions, so the exported and the kernelized model
agree everywhere. Tolerances: 1e-5 for torch.export (the same kernels), 1e-4 for onnxruntime (the issue's fp32 bound).
"""

import copy

import pytest
import torch

from hf_bert_impl import (
    BertImplForMaskedLM,
    BertImplForSequenceClassification,
    BertImplModel,
    export,
    kernelize,
    kernelized,
)

from .conftest import load_script


export_onnx = load_script("export_onnx")

MAX_POS = 64


def make(cls, debug_config, position):
    torch.manual_seed(0)
    return cls(debug_config(position_embedding_type=position, max_position_embeddings=MAX_POS)).eval()


def assert_matches(model, run, inputs, atol):
    """`run(inputs)` (the exported program) against torch's plain model and a kernelized copy, everywhere."""
    fast = kernelize(copy.deepcopy(model), "unpadded")
    assert kernelized(fast) and not kernelized(model)
    with torch.no_grad():
        got = run(inputs)
        plain = model(**inputs)
        unpadded = fast(**inputs)
    assert list(got.keys()) == list(plain.keys())
    for name, out in got.items():
        torch.testing.assert_close(out, plain[name], atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(out, unpadded[name], atol=atol, rtol=0, msg=lambda m: f"{name} vs kernelized: {m}")


@pytest.mark.parametrize(
    "cls,position",
    [
        (BertImplModel, "sinusoidal"),
        (BertImplModel, "learned"),
        (BertImplForSequenceClassification, "sinusoidal"),
        (BertImplForMaskedLM, "learned"),
    ],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_torch_export_dynamic_batch_and_sequence(cls, position, debug_config):
    model = make(cls, debug_config, position)
    seen = []
    model.base_model.embeddings.register_forward_pre_hook(lambda *_: seen.append(torch.compiler.is_compiling()))
    ep = torch.export.export(
        model, (), kwargs=export.sample_inputs(model, 13, 7), dynamic_shapes=export.dynamic_shapes(model)
    )
    # The data-dependent input checks (and the sinusoidal table's length check) see compiling=True...
    assert seen and all(seen), seen
    # ...so the graph has no data-dependent scalar read.
    ops = {str(node.target) for node in ep.graph.nodes if node.op == "call_function"}
    assert not ops & {"aten.item.default", "aten._local_scalar_dense.default"}, ops
    # Batch and sequence stayed symbolic: other shapes, longer than the traced 7, run and agree.
    assert len(ep.range_constraints) >= 2
    exported = ep.module()
    for b, s in [(1, 1), (2, 5), (6, 40), (3, MAX_POS)]:
        assert_matches(model, lambda x: exported(**x), export.sample_inputs(model, b, s, seed=s), atol=1e-5)
    # Past the position table the exported program refuses (eager sinusoidal would extend the table).
    with pytest.raises(Exception, match=f"<= {MAX_POS}"):
        exported(**export.sample_inputs(model, 2, MAX_POS + 1))


def test_input_checks_must_be_skipped_under_export(debug_config, monkeypatch):
    """Why the checks are skipped: run under export, their int(tensor.max()) is data-dependent."""
    model = make(BertImplModel, debug_config, "sinusoidal")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    with pytest.raises(Exception, match="data-dependent"):
        torch.export.export(
            model, (), kwargs=export.sample_inputs(model, 3, 7), dynamic_shapes=export.dynamic_shapes(model)
        )


@pytest.mark.parametrize(
    "cls,position",
    [(BertImplModel, "sinusoidal"), (BertImplForMaskedLM, "sinusoidal")],  # the command test does a learned classifier
    ids=lambda v: getattr(v, "__name__", v),
)
def test_onnx_export_matches_onnxruntime_at_two_lengths(cls, position, debug_config, tmp_path):
    import onnx

    model = make(cls, debug_config, position)
    path = str(tmp_path / "model.onnx")
    names = export.export_onnx(model, path)
    onnx.checker.check_model(path)
    graph = onnx.load(path, load_external_data=False).graph
    assert [i.name for i in graph.input] == list(export.INPUT_NAMES) and [o.name for o in graph.output] == names
    # Both input dims are symbolic in the file, not the traced 3 x 7.
    for i in graph.input:
        assert all(d.dim_param and not d.dim_value for d in i.type.tensor_type.shape.dim), i
    rows = export.check_export(model, path, lengths=[5, 23], batch=4)
    assert {r["sequence"] for r in rows} == {5, 23} and {r["output"] for r in rows} == set(names)
    for r in rows:
        assert r["max_abs_diff"] <= 1e-4 and r["real_token_diff"] <= 1e-4, r
        print(
            f"{cls.__name__} {position} seq {r['sequence']} {r['output']}: all {r['max_abs_diff']:.2e} "
            f"real {r['real_token_diff']:.2e}"
        )


def test_export_onnx_command(debug_config, tmp_path, capsys, minilm_dir):
    model = make(BertImplForSequenceClassification, debug_config, "learned")
    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "exported" / "cls.onnx"
    assert export_onnx.main(["--model", str(tmp_path / "ckpt"), "--out", str(out), "--check_lengths", "4", "17"]) == 0
    printed = capsys.readouterr().out
    assert out.is_file() and "onnxruntime matches torch" in printed and "BertImplForSequenceClassification" in printed
    # Errors are one line and a non-zero exit code.
    assert export_onnx.main(["--model", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert export_onnx.main(["--model", str(minilm_dir), "--out", str(tmp_path / "x.onnx")]) == 2
    assert "convert_checkpoint.py --from-hf" in capsys.readouterr().err
    assert export_onnx.main(["--model", str(tmp_path / "ckpt"), "--check_lengths", str(MAX_POS + 1)]) == 2
    assert "exceed max_position_embeddings" in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()
    # A check that fails (an impossible tolerance) writes nothing and leaves the earlier export alone.
    before = out.read_bytes()
    impossible = ["--check_lengths", "4", "--atol", "1e-15"]
    assert export_onnx.main(["--model", str(tmp_path / "ckpt"), "--out", str(out), *impossible]) == 1
    assert "nothing written" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["cls.onnx", "cls.onnx.data"]


def test_export_openvino_command_serves_the_model_in_openvino(debug_config, tmp_path, capsys, monkeypatch):
    """--format openvino: OpenVINO's IR of the plain model (float32 weights, free batch and sequence), checked in
    OpenVINO's CPU runtime at two lengths within the fp32 bound, and what it writes serves a batch of another shape
    as the README says (Core().compile_model(path, "CPU")), within 1e-5 of torch at the real tokens."""
    monkeypatch.setenv("CI", "true")  # openvino's usage telemetry is off in CI (tests/test_ecosystem.py)
    openvino = pytest.importorskip("openvino")
    model = make(BertImplForMaskedLM, debug_config, "sinusoidal")
    model.save_pretrained(tmp_path / "ckpt")
    args = ["--model", str(tmp_path / "ckpt"), "--format", "openvino", "--check_lengths", "4", "17"]
    assert export_onnx.main(args) == 0
    printed = capsys.readouterr().out
    assert "openvino matches torch" in printed and "max |openvino - torch|" in printed, printed
    written = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("openvino_model"))
    assert written == ["openvino_model.bin", "openvino_model.xml"]
    compiled = openvino.Core().compile_model(
        str(tmp_path / "ckpt" / "openvino_model.xml"), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
    inputs = export.sample_inputs(model, 5, 11, seed=7)
    logits = torch.from_numpy(compiled({k: v.numpy() for k, v in inputs.items()})[compiled.outputs[0]])
    with torch.no_grad():
        want = model(**inputs).logits
    real = inputs["attention_mask"].bool()
    assert logits.shape == want.shape and (logits[real] - want[real]).abs().max().item() <= 1e-5
    # A check that fails writes nothing.
    out = tmp_path / "ov" / "m.xml"
    assert export_onnx.main([*args, "--out", str(out), "--atol", "1e-15"]) == 1
    assert "openvino differs from torch" in capsys.readouterr().err
    assert not any(out.parent.iterdir())  # the staging folder removed, no file at --out


# ----------------------------------------------------------------------------------------------
# Pictures (scripts/plot_attention.py): what the model computes, exported as PNGs.

plot_attention = load_script("plot_attention")


def test_plot_attention_command_draws_real_probabilities(debug_config, tmp_path, capsys, minilm_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    torch.manual_seed(0)
    model = BertImplModel(debug_config(vocab_size=tokenizer.vocab_size, position_embedding_type="learned")).eval()
    model.save_pretrained(tmp_path / "ckpt")
    tokens, probs = plot_attention.attention_maps(model, tokenizer, "A tiny test sentence.", max_tokens=24)
    with torch.no_grad():
        expected = model(**tokenizer("A tiny test sentence.", return_tensors="pt"), output_attentions=True).attentions
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    assert probs.shape == (2, 4, len(tokens), len(tokens))
    torch.testing.assert_close(probs, torch.stack([a[0] for a in expected]), atol=0, rtol=0)

    argv = [
        "--model",
        str(tmp_path / "ckpt"),
        "--tokenizer",
        str(minilm_dir),
        "--text",
        "A tiny test sentence.",
        "--out",
        str(tmp_path / "att.png"),
        "--pe_out",
        str(tmp_path / "pe.png"),
        "--pe_positions",
        "40",
    ]
    assert plot_attention.main(argv) == 0
    for png in ("att.png", "pe.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2 layers x 4 heads" in capsys.readouterr().out
    assert plot_attention.main(argv + ["--layers", "2"]) == 2
    assert "--layers [2] outside [0, 2)" in capsys.readouterr().err
    assert plot_attention.main(["--model", str(tmp_path / "nope"), "--text", "x"]) == 2
    assert plot_attention.main(["--model", str(tmp_path / "ckpt")]) == 2
    assert "nothing to draw" in capsys.readouterr().err
