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
The export and the check are `hf_bert_impl.export`'s functions; this script is their command line.
Needs the `test` extra (onnx, onnxscript, onnxruntime, openvino): pip install -e '.[test]'.
"""

import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from hf_bert_impl.export import (
    FORMATS,
    INPUT_NAMES,
    RUNTIMES,
    check_export,
    export_onnx,
    export_openvino,
    load_model,
)


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
