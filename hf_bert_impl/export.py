"""Export a bert_impl model to ONNX (torch's dynamo exporter) or to OpenVINO's IR (`openvino.convert_model`), and
check the exported file against the model in torch.

    from hf_bert_impl.export import check_export, export_onnx, load_model
    model = load_model("my-bert")                    # the head named in config.json's `architectures`
    names = export_onnx(model, "out/model.onnx")     # weights in out/model.onnx.data; returns the output names
    rows = check_export(model, "out/model.onnx", lengths=[8, 32])  # one row per (length, output)

The batch and sequence dimensions are dynamic (torch.export.Dim for ONNX; OpenVINO's converter leaves them free);
the sequence may be as long as config.max_position_embeddings. The check runs the file on the CPU (in onnxruntime,
or in OpenVINO compiled in f32) and the model in torch on padded random batches, and reports the largest absolute
difference at every position against the model as given, and at the real tokens against a kernelized copy
(`hf_bert_impl.kernelize`). onnx, onnxscript, onnxruntime and openvino (the `test` extra) are imported only by the
functions that use them. `scripts/export_onnx.py` is the command line.
"""

import copy
import os

import torch

from .configuration_bert_impl import BertImplConfig
from .kernels_bert_impl import kernelize
from .modeling_bert_impl import BertImplForMultipleChoice


INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
FORMATS = ("onnx", "openvino")
RUNTIMES = {"onnx": "onnxruntime", "openvino": "openvino"}  # format -> the module that runs the check


def load_model(model_dir: str) -> torch.nn.Module:
    """The head named in config.json's `architectures` (BertImplModel when there is none), in eval mode."""
    import hf_bert_impl  # the package's public names: the architecture must be one of them

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
    kernelized = kernelize(copy.deepcopy(model)).eval()  # the speed layer, "auto"
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
