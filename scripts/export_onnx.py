"""Export a saved bert_impl checkpoint to ONNX (torch's dynamo exporter) and prove it in onnxruntime, or to
OpenVINO's IR (`openvino.convert_model`) and prove it in OpenVINO's CPU runtime.

    python scripts/export_onnx.py --model my-bert                          # -> my-bert/model.onnx (+ .onnx.data)
    python scripts/export_onnx.py --model my-bert --out out/bert.onnx --check_lengths 8 64 --atol 1e-4
    python scripts/export_onnx.py --model my-bert --no_check               # export only
    python scripts/export_onnx.py --model my-bert --format openvino        # -> my-bert/openvino_model.xml (+ .bin)

Serving the OpenVINO file: `openvino.Core().compile_model("my-bert/openvino_model.xml", "CPU")` (its default
precision; {"INFERENCE_PRECISION_HINT": "f32"} for float32 on a CPU with bf16 units), called with the tokenizer's
input_ids, attention_mask and token_type_ids as numpy arrays; outputs in the model's order.

The batch and sequence dimensions are dynamic (torch.export.Dim for ONNX; OpenVINO's converter leaves
them free); the sequence may be as long as config.max_position_embeddings. The head is the one in
config.json's `architectures`. After the export the script runs the file (in onnxruntime, or in
OpenVINO compiled for the CPU in f32) and the model in torch on padded random batches at each of
--check_lengths and fails (exit 1) if any output differs by more than --atol:
every position against the model as loaded (the plain model, the graph that is exported), and the
real tokens against a copy with the package's speed layer on it (`hf_bert_impl.kernelize`: the layers
run on the real tokens only; both write zeros at padding positions, tests/test_export.py compares
them everywhere).
Needs the `test` extra (onnx, onnxscript, onnxruntime, openvino): pip install -e '.[test]'.
"""

import copy
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser

import hf_bert_impl
from hf_bert_impl import BertImplConfig, BertImplForMultipleChoice


INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
FORMATS = ("onnx", "openvino")
RUNTIMES = {"onnx": "onnxruntime", "openvino": "openvino"}  # format -> the module that runs the check


@dataclass
class ExportArguments:
    model: str = field(metadata={"help": "directory of a saved bert_impl checkpoint (save_pretrained output)"})
    out: str | None = field(
        default=None,
        metadata={
            "help": "file to write (default: <model>/model.onnx, or <model>/openvino_model.xml with --format openvino)"
        },
    )
    format: str = field(default="onnx", metadata={"help": "onnx or openvino (OpenVINO's IR)", "choices": FORMATS})
    opset: int = field(default=18, metadata={"help": "ONNX opset version"})
    check_lengths: list[int] = field(default_factory=lambda: [8, 32], metadata={"help": "sequence lengths to check"})
    check_batch: int = field(default=3, metadata={"help": "batch size of the check inputs"})
    atol: float = field(default=1e-4, metadata={"help": "largest absolute difference accepted (fp32)"})
    no_check: bool = field(default=False, metadata={"help": "skip the onnxruntime check"})


def load_model(model_dir: str) -> torch.nn.Module:
    """The head named in config.json's `architectures` (BertImplModel when there is none), in eval mode."""
    config = BertImplConfig.from_pretrained(model_dir)
    name = (config.architectures or ["BertImplModel"])[0]
    cls = getattr(hf_bert_impl, name, None)
    if cls is None or name not in hf_bert_impl.__all__:
        raise ValueError(f"config.json of {model_dir} names architecture {name!r}, which is not a bert_impl class")
    return cls.from_pretrained(model_dir).eval()


def sample_inputs(model, batch: int, seq: int, seed: int = 0) -> dict:
    """Padded random inputs: row 0 full length, the others shorter (at least one token), two segments."""
    g = torch.Generator().manual_seed(seed)
    config = model.config
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    lengths[0] = seq
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()  # (b, s)
    ids = torch.randint(1, config.vocab_size, (batch, seq), generator=g) * mask
    types = (torch.arange(seq)[None, :] >= seq // 2).long().expand(batch, seq) % config.type_vocab_size * mask
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types.contiguous()}
    if isinstance(model, BertImplForMultipleChoice):  # (b, c, s): two choices per example
        inputs = {k: torch.stack([v, v.roll(1, dims=0)], dim=1) for k, v in inputs.items()}
    return inputs


def dynamic_shapes(model) -> dict:
    """Batch and sequence free (choices too for multiple choice); the sequence up to the position table."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("sequence", min=1, max=model.config.max_position_embeddings)
    if isinstance(model, BertImplForMultipleChoice):
        dims = {0: batch, 1: torch.export.Dim("choices", min=1, max=64), 2: seq}
    else:
        dims = {0: batch, 1: seq}
    return dict.fromkeys(INPUT_NAMES, dims)


def output_names(model, inputs) -> list[str]:
    with torch.no_grad():
        return list(model(**inputs).keys())  # the ModelOutput fields that are not None, in order


def export_onnx(model, path: str, opset: int = 18) -> list[str]:
    """Write `path` (weights in `path`.data beside it); returns the output names."""
    inputs = sample_inputs(model, batch=3, seq=7)
    names = output_names(model, inputs)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.onnx.export(
        model,
        (),
        path,
        kwargs=inputs,
        dynamic_shapes=dynamic_shapes(model),
        input_names=list(INPUT_NAMES),
        output_names=names,
        opset_version=opset,
        dynamo=True,
        verbose=False,
    )
    return names


def export_openvino(model, path: str) -> list[str]:
    """Write OpenVINO's IR `path` (.xml; float32 weights in the .bin beside it); returns the output names."""
    import openvino

    inputs = sample_inputs(model, batch=3, seq=7)
    names = output_names(model, inputs)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # compress_to_fp16=False: save_model halves the weights by default, a model that is not the one checked
    openvino.save_model(openvino.convert_model(model, example_input=inputs), path, compress_to_fp16=False)
    return names


def runtime(path: str, format: str = "onnx"):
    """fn(numpy inputs) -> the file's outputs (numpy, in the model's order), run on the CPU by its runtime:
    onnxruntime, or OpenVINO compiled in f32 (the precision the check compares)."""
    if format == "openvino":
        import openvino

        compiled = openvino.Core().compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})

        def run(feeds):
            result = compiled(feeds)
            return [result[port] for port in compiled.outputs]

        return run
    import onnxruntime as ort

    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)


def check_export(model, path: str, lengths, batch: int = 3, format: str = "onnx") -> list[dict]:
    """Run the exported file in its runtime and the model in torch on the same inputs at each length.
    Returns one row per (length, output): the largest absolute difference over every position against
    `model` (`max_abs_diff`), and over the real tokens against a kernelized copy of it (`real_token_diff`;
    per-token outputs keep only unmasked positions)."""
    run = runtime(path, format)
    kernelized = hf_bert_impl.kernelize(copy.deepcopy(model)).eval()  # the speed layer, "auto"
    rows = []
    for i, seq in enumerate(lengths):
        inputs = sample_inputs(model, batch, seq, seed=100 + i)
        real = inputs["attention_mask"].bool()
        with torch.no_grad():
            plain, fast = model(**inputs), kernelized(**inputs)
        got = run({k: v.numpy() for k, v in inputs.items()})
        for (name, ref), ref_fast, out in zip(plain.items(), fast.values(), got, strict=True):
            out = torch.from_numpy(out)
            per_token = out.dim() >= real.dim() and out.shape[: real.dim()] == real.shape
            pick = (lambda t: t[real]) if per_token else (lambda t: t)
            rows.append(
                {
                    "sequence": seq,
                    "batch": batch,
                    "output": name,
                    "shape": tuple(out.shape),
                    "max_abs_diff": (out - ref).abs().max().item(),
                    "real_token_diff": (pick(out) - pick(ref_fast)).abs().max().item(),
                }
            )
    return rows


def main(argv=None) -> int:
    (args,) = HfArgumentParser(ExportArguments).parse_args_into_dataclasses(args=argv)
    if not os.path.isdir(args.model):
        print(f"export_onnx: error: --model {args.model!r} is not a directory", file=sys.stderr)
        return 2
    checker = RUNTIMES[args.format]  # argparse took only FORMATS
    if not args.no_check and importlib.util.find_spec(checker) is None:  # fail before the export
        print(
            f"export_onnx: error: the check needs {checker}: pip install -e '.[test]' (or pass --no_check)",
            file=sys.stderr,
        )
        return 2
    if not args.no_check and (not args.check_lengths or min(args.check_lengths) < 1):
        print(f"export_onnx: error: --check_lengths needs positive lengths, got {args.check_lengths}", file=sys.stderr)
        return 2
    try:
        model = load_model(args.model)
        longest = model.config.max_position_embeddings
        if not args.no_check and max(args.check_lengths) > longest:
            raise ValueError(f"--check_lengths {args.check_lengths} exceed max_position_embeddings={longest}")
        default = "model.onnx" if args.format == "onnx" else "openvino_model.xml"
        out = os.path.abspath(args.out or os.path.join(args.model, default))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        # Export and check in a sibling folder; only a file that passed reaches --out (an existing one
        # is replaced only then). Same file name there, because model.onnx names its .data file (the .xml its .bin).
        staging = tempfile.mkdtemp(prefix=".export-", dir=os.path.dirname(out))
        staged = os.path.join(staging, os.path.basename(out))
        names = export_onnx(model, staged, args.opset) if args.format == "onnx" else export_openvino(model, staged)
    except (ValueError, OSError, ImportError) as e:  # ImportError: onnx / onnxscript / openvino missing
        hint = (
            " (pip install -e '.[test]' brings onnx, onnxscript, onnxruntime and openvino)"
            if isinstance(e, ImportError)
            else ""
        )
        print(f"export_onnx: error: {e}{hint}", file=sys.stderr)
        return 2
    try:
        print(f"exported {type(model).__name__} (inputs {list(INPUT_NAMES)}, outputs {names})")
        if not args.no_check:
            rows = check_export(model, staged, args.check_lengths, args.check_batch, args.format)
            for r in rows:
                print(
                    f"  seq {r['sequence']:>4}  batch {r['batch']}  {r['output']:<24} {str(r['shape']):<14} "
                    f"max |{args.format} - torch| "
                    f"all positions {r['max_abs_diff']:.3e}, real tokens vs kernelized {r['real_token_diff']:.3e}"
                )
            worst = max(max(r["max_abs_diff"], r["real_token_diff"]) for r in rows)
            if not worst <= args.atol:  # NaN fails too
                print(
                    f"export_onnx: error: {checker} differs from torch by {worst:.3e} > --atol {args.atol}; "
                    f"nothing written to {out}",
                    file=sys.stderr,
                )
                return 1
            print(f"{checker} matches torch: max abs diff {worst:.3e} <= {args.atol}")
        for name in sorted(os.listdir(staging), key=lambda n: n == os.path.basename(out)):  # the .onnx / .xml last
            os.replace(os.path.join(staging, name), os.path.join(os.path.dirname(out), name))
        print(f"wrote {out}")
        return 0
    finally:
        shutil.rmtree(staging, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
