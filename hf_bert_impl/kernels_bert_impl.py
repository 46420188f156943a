"""The speed layer of hf-bert-impl: faster kernels put on a loaded model from outside, with one call.

    model = AutoModelForMaskedLM.from_pretrained(path, trust_remote_code=True)
    hf_bert_impl.kernelize(model)                # kernels="auto": each kernel measured against the plain model here
    hf_bert_impl.kernelize(model, frozen=True)   # serving: the weights stay as they are (may pack them once)
    hf_bert_impl.kernelize(model, "reference")   # back to the plain model

The model file (modeling_bert_impl.py) is the plain model and the reference; it knows nothing of this file. `kernelize`
replaces the `forward` of module instances (transformers' `kernelize` does the same), never their class, parameters or
buffers, so a kernelized model saves exactly what the plain one saves, and a module another tool has replaced (a peft
LoRA layer, a quantized linear) or hooked runs its own forward. The kernels, by the names `kernels=` takes:

  where                kernels                                          reference (the plain model)
  nn.Linear            "onednn_linear": oneDNN's GEMM (the one          F.linear (torch's BLAS)
                       torch.compile's CPU backend emits)
  MLP, MLM head        "fused_activation": GELU / ReLU inside           act(Linear(x))
                       oneDNN's float32 or bfloat16 GEMM
                       (inference; bfloat16: applied before the
                       output's rounding, not after)
  nn.Linear, MLP,      "packed_linear" (inference; "auto" only with     F.linear, act(Linear(x))
  MLM head             `frozen=True`): oneDNN's GEMM on the weight
                       reordered once into its blocked layout, kept
                       beside the layer (never in it) until the
                       weight changes; the activation inside where
                       "fused_activation" puts it
  MLM decoder          "skip_zero_rows": the backward skips rows        the full backward
                       of positions without a label
  nn.Dropout and       "bits_dropout": masks from 32 random bits        F.dropout (torch's bernoulli_, element by
  attention dropout    per element (training attention runs the         element on most CPUs)
                       formula with them)
  encoder, attention   "unpadded": the layers run on real tokens        the padded batch, masked
                       only; attention per sequence
                       ("per_sequence_attention") or on a compact
                       masked grid ("grid_attention")
  attention (SDPA)     "matmul_attention" (CPU inference, in the        SDPA's fused kernel
                       layouts above; forced, it implies "unpadded"):
                       softmax(QKᵀ·scaling + M) V as the formula
                       writes it, two batched GEMMs and a softmax
                       on q, k, v made contiguous
  MLM heads            the loss from the labelled rows only; with       the loss from every row
                       `sparse_prediction=True` the decoder too         logits (b, s, V)
                       (logits (n, V), the same loss)

`kernels`: "auto" (default) measures, "reference" removes every kernel, and a name (or several, comma-separated) forces
those kernels and runs the reference elsewhere. "auto": the first time a kernel point meets a (device, dtype, shape
class) it times its candidates against the reference on that input (a warm-up and 3 timed calls each) and keeps the
fastest of those that agree with the reference within the kernel's tolerance (`TOLERANCE`; a disagreeing kernel is
never chosen). Choices are kept for the process and recorded in a JSON file under the Hugging Face cache
(`cache_path()`: $HF_HOME/hf_bert_impl/kernels.json; `HF_BERT_IMPL_KERNEL_CACHE=off` keeps them in memory only), keyed
by this package's version, torch's, the CPU capability, the thread count and the kernels chosen among, and written
under a file lock that is given up after `LOCK_TIMEOUT_S` (the choices are then made and kept in memory): the processes
of one machine and later seeded runs make the same choices. `chosen_kernels()` returns them; the logger
"hf_bert_impl.kernels" says each one; `kernelized(model)` lists the modules and their kernels. The linear and dropout
kernels run on plain CPU tensors outside torch.compile, export and tracing (there the reference runs), except that
under torch.compile inference's linear layers keep the GEMM "auto" chose, oneDNN's as one op (`onednn_linear`, or
`packed_linear` on the packed weights of a frozen model); the unpadded layout runs on accelerators too (a compact
grid, or flash-attention's varlen arguments), and under torch.compile where dynamo is set to capture data-dependent
sizes (`torch._dynamo.config.capture_dynamic_output_shape_ops = True`: the layers on the real tokens; in inference (no
gradients) on a CPU with SDPA attention, attention laid out as in eager inside one op, `varlen_attention`, elsewhere on
the padded grid; otherwise the padded batch, as the plain model runs it).
"""

import functools
import json
import logging
import os
import threading
import time
import types
import weakref
from dataclasses import dataclass, field

import filelock
import torch
import torch.nn.functional as F
from huggingface_hub import constants
from torch import nn
from transformers import activations
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import modeling_bert_impl as plain


logger = logging.getLogger("hf_bert_impl.kernels")

KERNELS = ("onednn_linear", "fused_activation", "packed_linear", "skip_zero_rows", "bits_dropout", "unpadded",
           "per_sequence_attention", "grid_attention", "matmul_attention")
# A kernel is kept only if its output is within this of the reference's on the measured input (max abs difference,
# relative to the reference's largest magnitude; float32: GEMM reordering, bfloat16: its 8-bit mantissa).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LOCK_TIMEOUT_S = 30.0  # another process holding the record's lock longer: choose without the record
_UNRECORDED: set = set()  # record paths given up in this process (lock not had in time, unwritable): warned once


# ----------------------------------------------------------------------------------------------
# The choice: forced, reference, or measured once per (point, device, dtype, shape class)


def kernel_names(setting) -> frozenset | str:
    """`kernels` -> "auto", "reference", or the frozenset of forced kernel names; ValueError naming a bad value."""
    if setting in ("auto", "reference"):
        return setting
    names = [s.strip() for s in setting.split(",")] if isinstance(setting, str) else \
        list(setting) if isinstance(setting, (list, tuple, set, frozenset)) else []
    unknown = [n for n in names if not isinstance(n, str) or n not in KERNELS]
    if not names or unknown:
        raise ValueError(f"kernels must be 'auto', 'reference' or kernel names from {KERNELS} (comma-separated), "
                         f"got {setting!r}")
    return frozenset(names)


def parse_setting(setting) -> frozenset | str:
    """`kernels` -> "auto", "reference", or the forced kernel names ("fused_activation" and "packed_linear" imply
    "onednn_linear", the GEMM they run on and the one a training call of theirs runs; "matmul_attention" implies
    "unpadded", the layout it attends in)."""
    choice = kernel_names(setting)
    if not isinstance(choice, frozenset):
        return choice
    on_onednn = choice & {"fused_activation", "packed_linear"}
    choice = choice | {"onednn_linear"} if on_onednn else choice
    return choice | {"unpadded"} if "matmul_attention" in choice else choice


class _Choices:
    """The choices made in this process, and their record on disk."""

    def __init__(self):
        self.made: dict[str, str] = {}
        self.seconds = 0.0  # time spent measuring in this process
        self.lock = threading.Lock()

    def get(self, key: str, measure) -> str:
        if key in self.made:
            return self.made[key]
        with self.lock, _Record() as record:
            if key not in self.made:
                name = record.get(key)
                if name is None:
                    start = time.perf_counter()
                    name = measure()
                    self.seconds += time.perf_counter() - start
                record[key] = self.made[key] = name
                logger.info("kernel for %s: %s", key, name)
        return self.made[key]


_CHOICES = _Choices()


def cache_path() -> str | None:
    """Where choices are recorded: $HF_BERT_IMPL_KERNEL_CACHE, else $HF_HOME/hf_bert_impl/kernels.json; None: "off"."""
    path = os.environ.get("HF_BERT_IMPL_KERNEL_CACHE", os.path.join(constants.HF_HOME, "hf_bert_impl", "kernels.json"))
    return None if path.lower() in ("", "off", "0", "false") else path


def _machine() -> str:  # what a recorded choice holds for: this package, the torch build, CPU capability, threads,
    from . import __version__  # the kernels it was chosen among

    return (f"hf_bert_impl {__version__}, torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads, kernels {'/'.join(KERNELS)}")


class _Record:
    """The record of this machine's choices (a dict), read under the record's file lock and written back on exit; an
    empty dict, kept in memory, where there is no record (off, unwritable, or the lock not had in LOCK_TIMEOUT_S: then
    for the rest of the process, so that a held lock costs one wait, not one per choice)."""

    def __enter__(self) -> dict:
        self.path, self.lock, self.all, self.record = cache_path(), None, {}, {}
        self.path = None if self.path in _UNRECORDED else self.path
        if self.path is None:
            return self.record
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self.lock = filelock.FileLock(self.path + ".lock", timeout=LOCK_TIMEOUT_S)
            self.lock.acquire()
        except (OSError, filelock.Timeout) as e:
            logger.warning("kernel choices not recorded in %s (%s): they are made in memory", self.path, e)
            _UNRECORDED.add(self.path)
            self.path, self.lock = None, None
            return self.record
        try:
            with open(self.path) as f:
                self.all = json.load(f)
        except (OSError, ValueError):  # no record yet, or an unreadable one: measure anew
            pass
        self.all = self.all if isinstance(self.all, dict) else {}
        mine = self.all.get(_machine())
        self.record = {k: v for k, v in mine.items() if isinstance(v, str)} if isinstance(mine, dict) else {}
        return self.record

    def __exit__(self, *exc):
        try:
            if self.path is not None and exc[0] is None and self.record != self.all.get(_machine()):
                self.all[_machine()] = self.record
                tmp = f"{self.path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(self.all, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
        except OSError as e:  # a read-only cache: the choices stay in memory
            logger.debug("kernel choices not recorded in %s: %s", self.path, e)
        finally:
            if self.lock is not None:
                self.lock.release()


def chosen_kernels() -> dict[str, str]:
    """The choices "auto" made in this process: {"point|device|dtype|shape class": kernel or "reference"}."""
    return dict(_CHOICES.made)


def measurement_seconds() -> float:
    """Seconds this process spent measuring kernels (once per key; zero when every choice came from the record)."""
    return _CHOICES.seconds


def _bucket(n: int) -> int:  # shape classes: sizes rounded up to a power of two
    return 1 << max(int(n) - 1, 0).bit_length()


def _median_seconds(fn, reps: int = 3, warm: bool = False) -> float:
    """Median time of `reps` calls of fn, after a warm-up call (first-call allocations, oneDNN's primitive cache)
    unless `warm`; one call where a call takes over 20 ms (a large GEMM: the measuring's cost stays small)."""
    if not warm:
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if times[0] > 0.02:
            break
    return sorted(times)[len(times) // 2]


def _agrees(out: torch.Tensor, ref: torch.Tensor) -> bool:
    tol = TOLERANCE.get(ref.dtype, 1e-5) * max(float(ref.abs().max()), 1.0)
    if out.shape != ref.shape or not bool(torch.isfinite(out).all()):
        return False
    return float((out.float() - ref.float()).abs().max()) <= tol


def _fastest(candidates: dict, reference: str = "reference") -> str:
    """Name of the fastest of `candidates` ({name: fn() -> Tensor}) whose output agrees with candidates[reference]'s
    (each candidate's first call is its warm-up and its agreement check)."""
    with torch.no_grad():
        ref = candidates[reference]()
        agreeing = {name: fn for name, fn in candidates.items() if name == reference or _try_agrees(fn, ref)}
        return min(agreeing, key=lambda name: _median_seconds(agreeing[name], warm=True))


def _try_agrees(fn, ref) -> bool:
    try:
        return _agrees(fn(), ref)
    except Exception:  # noqa: BLE001  a kernel that fails on this input is not a candidate
        return False


def _plain_cpu(*tensors) -> bool:  # kernels run on plain CPU tensors outside tracing (compile, export, jit, DTensor)
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_cpu for t in tensors) and not (
        torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.jit.is_scripting()
        or torch.onnx.is_in_onnx_export())


# ----------------------------------------------------------------------------------------------
# linear / decoder: oneDNN's GEMM, the activation inside it, the decoder's skipped rows


def _onednn_op():
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


_POST_OPS = {"GELUActivation": ("gelu", [], "none"), "GELUTanh": ("gelu", [], "tanh"),
             "NewGELUActivation": ("gelu", [], "tanh"), "ReLU": ("relu", [], "")}  # activation class -> oneDNN post-op


_ONEDNN_RUNS: dict = {}  # dtype -> whether oneDNN's op runs here and reproduces F.linear (asked at first use)


def _reproduces_linear(dtype, gemm) -> bool:  # gemm(x, w, b) on small seeded inputs of `dtype` gives F.linear's
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((5, 8), (3, 8), (3,)))
    return _try_agrees(lambda: gemm(x, w, b), F.linear(x, w, b))


def _onednn_runs(dtype) -> bool:
    if dtype not in _ONEDNN_RUNS:
        op = _onednn_op()
        _ONEDNN_RUNS[dtype] = op is not None and _reproduces_linear(dtype, lambda x, w, b: op(x, w, b, "none", [], ""))
    return _ONEDNN_RUNS[dtype]


_PACKS: dict = {}  # dtype -> whether oneDNN reorders a weight of it into its blocked layout here (asked at first use)
# Packed weights: nn.Linear -> (weakref to the weight, its state, the packed weight). One per layer, packed for
# PACK_ROWS rows: oneDNN's layout for 16 rows ran as fast as the one for the call's own rows from 16 to 1024 rows
# (bert-base's four GEMM shapes, AMD EPYC Zen 3, 2 threads); "auto" keeps the plain weight where that is faster.
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
PACK_ROWS = 16


def _reorder_op():
    return getattr(torch.ops.mkldnn, "_reorder_linear_weight", None) if _onednn_op() is not None else None


def _packs(dtype) -> bool:
    if dtype not in _PACKS:
        reorder = _reorder_op()
        _PACKS[dtype] = reorder is not None and _onednn_runs(dtype) and _reproduces_linear(
            dtype, lambda x, w, b: _onednn_op()(x, reorder(w, 8), b, "none", [], ""))
    return _PACKS[dtype]


def _weight_state(w: torch.Tensor, dtype) -> tuple:  # what a packed weight was made from: changed, it is made again
    try:
        version = w._version  # in-place changes: an optimizer step, load_state_dict, a merged adapter
    except RuntimeError:  # an inference tensor has no version counter (and cannot change outside inference mode)
        version = None
    return w.data_ptr(), version, tuple(w.shape), w.dtype, dtype


def _packed_weight(layer: nn.Module, w: torch.Tensor, dtype) -> torch.Tensor:
    """`layer`'s weight in `dtype`, reordered into oneDNN's blocked layout: made once and kept beside the layer (never
    in its parameters, buffers or state dict) until the weight changes (its data, version, shape or dtype: a training
    step, load_state_dict, `.to()`, a new Parameter) or `kernelize` is called again."""
    entry, state = _PACKED.get(layer), _weight_state(w, dtype)
    if entry is None or entry[0]() is not w or entry[1] != state:
        entry = _PACKED[layer] = (weakref.ref(w), state, _reorder_op()(w.detach().to(dtype), PACK_ROWS))
    return entry[2]


def _linear_key(dtype, out_in: tuple, rows: int, mode: str, act: str) -> str:  # the "linear" point's choice key
    return f"linear|cpu|{str(dtype)[6:]}|{out_in[1]}x{out_in[0]}|rows<={_bucket(rows)}|{mode}|{act}"


def _forced_linear(choice) -> str:  # a forced setting's linear kernel: the most specific one named (each of
    # "fused_activation" and "packed_linear" brings "onednn_linear" with it, `parse_setting`), else the reference
    for name in ("packed_linear", "fused_activation", "onednn_linear"):
        if name in choice:
            return name
    return "reference"


@torch.library.custom_op("hf_bert_impl::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(x Wᵀ + b) by oneDNN's GEMM, `activation` ("none" or an activation class of `_POST_OPS`) inside it: the
    "linear" point in a torch.compile graph, one op that inductor calls as it is (it lowers oneDNN's own op only on
    frozen weights, and otherwise emits its GEMM and a separate activation kernel)."""
    return _onednn_post_op(x, weight, bias, activation)


def _onednn_post_op(x, weight, bias, activation: str) -> torch.Tensor:  # the body of the two linear ops
    return _onednn_op()(x, weight, bias, *_POST_OPS.get(activation, ("none", [], "")))


def _linear_like(x, weight) -> torch.Tensor:  # the fake (meta) output of the two linear ops: (..., out)
    return x.new_empty((*x.shape[:-1], weight.size(0)))


@onednn_linear.register_fake
def _(x, weight, bias, activation):
    return _linear_like(x, weight)


# id() -> each nn.Linear kernelize put a kernel on: `packed_linear` in a compiled graph finds its layer by this number
_KERNELIZED_LINEARS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@torch.library.custom_op("hf_bert_impl::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str,
                  layer: int) -> torch.Tensor:
    """`onednn_linear` on the weight packed once, in a torch.compile graph of a frozen model: `layer` is id() of the
    nn.Linear `weight` belongs to, whose packed copy is the one eager runs (`_packed_weight`: made at the first
    call, again when the weight changes). A weight that is not that layer's own runs as passed, unpacked (the same
    numbers). (Inductor's own weight freezing fails on the unpadded graph, whose token count is data-dependent.)"""
    module = _KERNELIZED_LINEARS.get(layer)
    if module is not None and module.weight is weight:
        weight = _packed_weight(module, weight, x.dtype)
    return _onednn_post_op(x, weight, bias, activation)


@packed_linear.register_fake
def _(x, weight, bias, activation, layer):
    return _linear_like(x, weight)


@torch.compiler.assume_constant_result  # asked on real tensors once while tracing, a constant of the graph
def _onednn_runs_traced(dtype) -> bool:
    return _onednn_runs(dtype)


@torch.compiler.assume_constant_result  # asked on real tensors once while tracing, a constant of the graph
def _packs_traced(dtype) -> bool:
    return _packs(dtype)


TRACED_ROWS = 1024  # the shape class "auto" takes for a compiled linear layer: its row count is often a size of the
# graph known only when it runs (the real tokens of a padded batch; dynamic shapes): 8 x 128 tokens, the benchmark's
# batch


@torch.compiler.assume_constant_result  # measured on real tensors once while tracing, a constant of the graph
def _traced_choice(out_in: tuple, dtype, act: str, bias: bool, rows: int, frozen: bool = False) -> str:
    """"auto"'s choice for an inference linear layer (weight (out, in), `act` its activation's class name or "none")
    inside a torch.compile graph: the eager choice of that (dtype, shape class, activation, `frozen`), from this
    process or the record, else measured as eager measures it, on seeded random inputs of that shape (timing does not
    depend on the values; the candidates are checked against F.linear on them)."""
    key = _linear_key(dtype, out_in, rows, "infer-frozen" if frozen else "infer", act)

    def measure():
        g = torch.Generator().manual_seed(0)
        x, w = (torch.randn(*shape, generator=g).to(dtype) for shape in ((rows, out_in[1]), out_in))
        b = torch.randn(out_in[0], generator=g).to(dtype) if bias else None
        fusable = act in _POST_OPS  # measured with it (the GEMM with it inside a candidate); other activations
        cls = (nn.ReLU if act == "ReLU" else getattr(activations, act)) if fusable else None  # run after any GEMM
        return _fastest(_linear_candidates(x, w, b, cls() if cls is not None else None, False, frozen))
    return _CHOICES.get(key, measure)


def _traced_linear(choice, layer, x: torch.Tensor, act, frozen: bool = False) -> torch.Tensor | None:
    """The "linear" point while torch.compile traces (not exports): inference on plain CPU tensors in the weight's
    dtype runs `onednn_linear` (the activation inside it for "fused_activation") where the choice is oneDNN's,
    `packed_linear` where it is the packed weight (a `frozen` model's "auto", or forced), and None, inductor's code,
    otherwise. "auto" cannot time inside a trace: `_traced_choice` asks eager's choice (or measures it) outside the
    graph, for the shape class of TRACED_ROWS rows whatever the call's (dynamo can pass no row count that is a size
    of the graph to it)."""
    w, b = layer.weight, layer.bias
    if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or x.dtype != w.dtype or x.dtype not in TOLERANCE:
        return None
    if not (type(x) is torch.Tensor and type(w) in (torch.Tensor, nn.Parameter) and x.device.type == "cpu"):
        return None
    if not _onednn_runs_traced(x.dtype):
        return None
    if choice == "auto":
        act_name = type(act).__name__ if act is not None else "none"
        name = _traced_choice(tuple(w.shape), x.dtype, act_name, b is not None, TRACED_ROWS, frozen)
    else:
        name = _forced_linear(choice)
    if name == "reference":
        return None
    fuse = name in ("fused_activation", "packed_linear") and _fusable(act, False, x.dtype)
    activation = type(act).__name__ if fuse else "none"
    if name == "packed_linear" and _packs_traced(x.dtype):
        y = packed_linear(x, w, b, activation, id(layer))
    else:
        y = onednn_linear(x, w, b, activation)
    return y if act is None or fuse else act(y)


def _gemm(x, weight, bias, onednn: bool):  # x Wᵀ + b
    return _onednn_op()(x, weight, bias, "none", [], "") if onednn else F.linear(x, weight, bias)


class _LinearFunction(torch.autograd.Function):
    """y = x Wᵀ + b with its backward written out (dx = dy W, dW = dyᵀ x, db = Σ dy). (1) oneDNN's op has no
    autograd formula; it copies dyᵀ, which torch.mm reads as a strided view, so dW goes through torch.mm in bfloat16
    and, in float32, for outputs over 8x wider than the input. (2) `skip_zero_rows`: rows of dy that are all zero
    (positions without a label) add nothing; when at most half are left the backward runs on those only."""

    @staticmethod
    def forward(x, weight, bias, onednn: bool, skip_zero_rows: bool):
        return _gemm(x, weight, bias, onednn)

    @staticmethod
    def setup_context(ctx, inputs, output):  # apart from forward: torch.func transforms (grad) can then run it
        x, weight, _, ctx.onednn, ctx.skip_zero_rows = inputs
        ctx.save_for_backward(x, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (x, weight), need = ctx.saved_tensors, ctx.needs_input_grad
        grad_2d, x_2d = grad.reshape(-1, grad.size(-1)), x.reshape(-1, x.size(-1))  # (N, out), (N, in)
        rows = grad_2d.ne(0).any(1).nonzero().squeeze(1) if ctx.skip_zero_rows else None  # (n,) not all zero
        if rows is not None and 2 * rows.numel() <= grad_2d.size(0):
            grad_2d, x_2d = grad_2d.index_select(0, rows), x_2d.index_select(0, rows)  # (n, out), (n, in)
        grad_x = _gemm(grad_2d, weight.t(), None, ctx.onednn) if need[0] else None  # (N, in) or (n, in)
        if grad_x is not None and grad_x.size(0) < x.numel() // x.size(-1):  # the skipped rows' dx is zero
            grad_x = x.new_zeros(x.shape).view(-1, x.size(-1)).index_copy_(0, rows, grad_x)
        by_mm = not ctx.onednn or grad.dtype == torch.bfloat16 or grad_2d.size(1) > 8 * x_2d.size(1)
        grad_w = None
        if need[1]:
            grad_w = torch.mm(grad_2d.t(), x_2d) if by_mm else _gemm(grad_2d.t(), x_2d.t(), None, True)
        grad_b = grad_2d.sum(0) if need[2] else None
        return None if grad_x is None else grad_x.view(x.shape), grad_w, grad_b, None, None


_CAST_BUFFERS = threading.local()  # per thread: (shape, dtype) -> the buffer no-grad autocast casts of weights reuse


def _linear_candidates(x, w, b, act, grad: bool, pack: bool = False) -> dict:
    """The ways to compute act(x Wᵀ + b) here: {name: fn() -> Tensor}; oneDNN only where it also computes the
    backward's transposed GEMM right; with `pack` (inference of a frozen model) also on the weight packed once.
    In grad mode each runs with its backward (dy random), as a training step does: a GEMM faster forward can be
    slower forward + backward."""
    identity = (lambda y: y) if act is None else act
    forwards = {"reference": F.linear}
    op = _onednn_op()
    if op is not None and x.dtype in TOLERANCE:
        y = torch.randn(8, w.size(0), dtype=x.dtype, generator=torch.Generator().manual_seed(0))  # a few rows suffice
        if _try_agrees(lambda: op(y, w.t(), None, "none", [], ""), F.linear(y, w.t())):  # the backward's GEMM
            forwards["onednn_linear"] = ((lambda x_, w_, b_: _LinearFunction.apply(x_, w_, b_, True, False)) if grad
                                         else (lambda x_, w_, b_: op(x_, w_, b_, "none", [], "")))
    if not grad:
        out = {name: (lambda f=f: identity(f(x, w, b))) for name, f in forwards.items()}
        if "onednn_linear" in out and _fusable(act, grad, x.dtype):
            out["fused_activation"] = lambda: op(x, w, b, *_POST_OPS[type(act).__name__])
        if pack and "onednn_linear" in out and _packs(x.dtype):  # packed once (in the warm-up call), as served
            packed = functools.cache(lambda: _reorder_op()(w, PACK_ROWS))
            out["packed_linear"] = lambda: _packed_gemm(x, packed(), b, act, grad)
        return out
    dy = torch.randn(*x.shape[:-1], w.size(0), generator=torch.Generator().manual_seed(1)).to(x.dtype)

    def step(forward):
        def run():  # identity saved-tensor hooks: a caller's (gradient checkpointing's) must not pack these tensors
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                leaves = [None if t is None else t.detach().requires_grad_() for t in (x, w, b)]
                out = identity(forward(*leaves))
                out.backward(dy)
            return out.detach()
        return run
    return {name: step(f) for name, f in forwards.items()}


def _packed_gemm(x, packed, b, act, grad: bool) -> torch.Tensor:  # act(x Wᵀ + b) on a packed W, the act inside
    if _fusable(act, grad, x.dtype):  # where it can be
        return _onednn_op()(x, packed, b, *_POST_OPS[type(act).__name__])
    y = _onednn_op()(x, packed, b, "none", [], "")
    return y if act is None else act(y)


def _fusable(act, grad: bool, dtype) -> bool:  # an unhooked GELU / ReLU after a float32 or bfloat16 GEMM in inference
    return (act is not None and not grad and dtype in (torch.float32, torch.bfloat16)
            and type(act).__name__ in _POST_OPS
            and not (act._forward_hooks or act._forward_pre_hooks))  # a hooked activation must run itself


def _in(t: torch.Tensor | None, dtype) -> torch.Tensor | None:  # t in `dtype` (a no-op `.to` costs a dispatch too)
    return t if t is None or t.dtype == dtype else t.to(dtype)


def linear_kernel(setting, layer, x: torch.Tensor, act=None, skip_zero_rows: bool = False,
                  frozen: bool = False) -> torch.Tensor | None:
    """Point "linear" (and "decoder" where `skip_zero_rows`): act(x Wᵀ + b) by a kernel, or None for the reference.
    Per call only what can change is looked at: dtype, device, plain tensors, grad mode, CPU autocast, hooks.
    `frozen` (kernelize's): "auto" may choose "packed_linear" for inference."""
    choice = parse_setting(setting)
    if choice != "reference" and torch.compiler.is_dynamo_compiling() and not torch.compiler.is_exporting():
        return _traced_linear(choice, layer, x, act, frozen)
    w, b = layer.weight, layer.bias
    if choice == "reference" or not _plain_cpu(x, w) or x.numel() == 0:  # compiling: numel() unknown until run
        return None
    autocast, grad = torch.is_autocast_enabled("cpu"), torch.is_grad_enabled()
    dtype = torch.get_autocast_dtype("cpu") if autocast else x.dtype  # the dtype the GEMM runs in
    if dtype not in TOLERANCE or not (x.dtype == w.dtype or autocast and {x.dtype, w.dtype} <= set(TOLERANCE)):
        return None
    xc, bc, rows = _in(x, dtype), _in(b, dtype), x.numel() // x.size(-1)
    fusable = _fusable(act, grad, dtype)
    if choice == "auto":
        pack = frozen and not grad
        key = _linear_key(dtype, tuple(w.shape), rows, "train" if grad else "infer-frozen" if pack else "infer",
                          type(act).__name__ if act is not None else "none")
        name = _CHOICES.get(key, lambda: _fastest(_linear_candidates(xc.detach(), w.detach().to(dtype), bc, act,
                                                                     grad, pack)))
    else:
        name = _forced_linear(choice)
    if name != "reference" and not _onednn_runs(dtype):  # forced where oneDNN cannot compute in this dtype
        name = "reference"
    if name == "packed_linear" and (grad or not _packs(dtype)):  # training (no backward on a packed weight), or no
        name = "onednn_linear"  # packing in this dtype here: the plain weight
    if name == "packed_linear":
        return _packed_gemm(xc, _packed_weight(layer, w, dtype), bc, act, grad)
    if name == "fused_activation" and not fusable:  # a hook added since, or grad mode: the activation after the GEMM
        name = "onednn_linear"
    cast_buffer = autocast and not grad and w.dtype != dtype  # autocast inference: the weight cast each call into a
    if cast_buffer:  # kept buffer (a fresh copy per call can cost more)
        buffers, shape = vars(_CAST_BUFFERS), (tuple(w.shape), dtype)
        wc = buffers[shape] if shape in buffers else buffers.setdefault(shape, w.new_empty(w.shape, dtype=dtype))
    wc = wc.copy_(w) if cast_buffer else _in(w, dtype)
    skip = skip_zero_rows and grad and (choice == "auto" or "skip_zero_rows" in choice)
    if name == "fused_activation":
        return _onednn_op()(xc, wc, bc, *_POST_OPS[type(act).__name__])
    if name == "reference" and not skip:
        return None
    if grad:
        y = _LinearFunction.apply(xc, wc, bc, name == "onednn_linear", skip)
    else:  # its forward, without autograd.Function's per-call cost (binding the arguments to its signature)
        y = _LinearFunction.forward(xc, wc, bc, name == "onednn_linear", False)
    return y if act is None else act(y)


# ----------------------------------------------------------------------------------------------
# dropout: masks from random bits


def bits_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted dropout in training: each element kept iff 32 random bits of torch's generator (as int32) are below
    (1 - p)·2^32 - 2^31 (p resolved to 2^-32), kept values scaled by 1/(1 - p). One draw of 64-bit words instead of
    torch's CPU bernoulli_, which draws element by element (2 Mersenne-twister draws and a double each), most CPUs."""
    words = torch.empty((x.numel() + 1) // 2, dtype=torch.int64, device=x.device)
    bits = words.random_(-2**63, None).view(torch.int32)
    return x * (bits[:x.numel()].view(x.shape) < min(round((1 - p) * 2**32), 2**32 - 1) - 2**31) * (1 / (1 - p))


def _dropout_statistics_hold(out: torch.Tensor, x: torch.Tensor, p: float) -> bool:
    """A random kernel agrees with F.dropout in distribution: kept values exactly x/(1-p), kept share within 6 sd."""
    kept = out.ne(0) & x.ne(0)
    n = int(x.ne(0).sum())
    exact = torch.equal(out[kept], (x * (1 / (1 - p)))[kept].to(out.dtype))
    return exact and abs(int(kept.sum()) - n * (1 - p)) <= 6 * (n * p * (1 - p)) ** 0.5 + 1


def dropout_choice(setting, x: torch.Tensor, p: float, training: bool, shape: torch.Size | None = None) -> str:
    """Point "dropout": "bits_dropout" or "reference" (F.dropout) for a training call on x (of `shape` if given)."""
    choice = parse_setting(setting)
    if not (training and 0 < p < 1) or choice == "reference" or not _plain_cpu(x):
        return "reference"
    if choice != "auto":
        return "bits_dropout" if "bits_dropout" in choice else "reference"
    shape = x.shape if shape is None else shape
    key = f"dropout|cpu|{str(x.dtype)[6:]}|numel<={_bucket(shape.numel())}"

    def measure():
        sample = torch.ones(shape, dtype=x.dtype)
        state = torch.get_rng_state()  # measuring draws numbers: the run's random stream stays as it was
        try:
            if not _dropout_statistics_hold(bits_dropout(sample, p), sample, p):
                return "reference"
            t_ref = _median_seconds(lambda: F.dropout(sample, p, True))
            return "bits_dropout" if _median_seconds(lambda: bits_dropout(sample, p)) < t_ref else "reference"
        finally:
            torch.set_rng_state(state)

    return _CHOICES.get(key, measure)


# ----------------------------------------------------------------------------------------------
# layout: the real tokens only, attention per sequence or on a compact grid


@dataclass
class TokenMap:
    """Where the real tokens of a padded or packed batch sit while the layers run on them alone, as (1, T, H) (or the
    whole batch, (b, s, H), when nothing is padded: `unpadded` is False).

    `indices` (T,): their places in the flattened (b*s) batch (None for a packed row: all are real). Attention sees
    per sequence (`seq_lengths`, one unmasked call each) or as `grid` (n, m): n sequences of m slots, `grid_index` (T,)
    each token's slot, `mask` the additive padding mask of the grid (None: every slot real). Flash attention takes them
    they are: cu_seqlens (n + 1,) and max_seqlen in `attention_kwargs`. In a torch.compile graph: `lengths` (n,), and
    the `layout` and `attention` settings that `varlen_attention` attends by."""

    batch_shape: tuple[int, int]
    grid: tuple[int, int]
    mask: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    grid_index: torch.Tensor | None = None
    seq_lengths: tuple[int, ...] | None = None
    attention_kwargs: dict = field(default_factory=dict)
    lengths: torch.Tensor | None = None
    layout: str = "auto"
    attention: str = "auto"

    @property
    def unpadded(self) -> bool:  # the layers run on fewer (or packed) tokens than the padded batch
        layout = (self.indices, self.seq_lengths, self.grid_index, self.lengths)
        return any(t is not None for t in layout) or bool(self.attention_kwargs) or self.grid != self.batch_shape

    def gather(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """An input (b, s[, H]) or (1, s[, H]) -> (1, T[, H])."""
        if t is None or self.indices is None:
            return t
        t = t.expand(*self.batch_shape, *t.shape[2:]).flatten(0, 1)  # (b*s[, H])
        return t.index_select(0, self.indices).unsqueeze(0)  # (1, T[, H])

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """(1, T, H) -> (b, s, H), zeros at padding."""
        if self.indices is None:
            return x
        b, s = self.batch_shape
        x = x.reshape(-1, x.size(-1))  # (T, H)
        return x.new_zeros(b * s, x.size(-1)).index_copy(0, self.indices, x).view(b, s, -1)


def _additive_mask(valid: torch.Tensor, dtype) -> torch.Tensor:  # (n, m) bool -> (n, 1, 1, m): 0 or the dtype's min
    return (~valid[:, None, None, :]).to(dtype) * torch.finfo(dtype).min


def _sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(1, s) position ids of a packed row -> (n,) each sequence's first index (position id 0, as the collator's)."""
    first = position_ids.view(-1).eq(0)
    first[0] = True
    return first.nonzero().squeeze(1)


def _grid_of(lengths_t: torch.Tensor, lengths: list[int], dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sequences of `lengths` (their tensor `lengths_t`, (n,)), one after another, as a grid of n rows of m = the
    longest: each token's slot in it, (T,), and the grid's additive padding mask (n, 1, 1, m) (None: no padding)."""
    n, total, m = len(lengths), sum(lengths), max(max(lengths), 1)
    device = lengths_t.device
    seq = torch.repeat_interleave(torch.arange(n, device=device), lengths_t, output_size=total)  # (T,) its sequence
    starts = F.pad(lengths_t.cumsum(0), (1, 0))  # (n + 1,)
    slot = torch.arange(total, device=device) - starts[seq]  # (T,) its place in that sequence
    valid = torch.arange(m, device=device)[None, :] < lengths_t[:, None]  # (n, m)
    return seq * m + slot, None if min(lengths) == m else _additive_mask(valid, dtype)


@torch.library.custom_op("hf_bert_impl::varlen_attention", mutates_args=())
def varlen_attention(qkv: torch.Tensor, lengths: torch.Tensor, heads: int, scaling: float, layout: str,
                     attention: str = "auto") -> torch.Tensor:
    """Attention of each sequence over its own tokens alone, softmax(QKᵀ·scaling) V by SDPA: qkv (1, T, 3H) of n
    sequences one after another, `lengths` (n,) theirs (summing to T) -> (1, T, h, d). Per sequence or as a masked
    grid, as `layout` says ("auto": the "layout" point's choice for these lengths, as in eager), by SDPA or
    `matmul_attention` as `attention` says ("auto": the "attention" point's choice, as in eager; "reference": SDPA).
    The attention of a torch.compile graph of the unpadded layout in inference: one op that reads the lengths when it
    runs, so no size of the graph depends on them."""
    d, total = qkv.size(-1) // (3 * heads), qkv.size(1)
    tokens = _sequence_layout(layout, (1, total), None, lengths, lengths.tolist(), heads, d, qkv.dtype)
    sdpa = lambda q, k, v, mask: (  # noqa: E731
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling).transpose(1, 2), None)
    choice = "auto" if attention == "auto" else frozenset({attention})
    out, _ = _laid_out_attention(qkv, tokens, *tokens.grid, tokens.mask, heads, d,
                                 _sdpa_or_matmul(choice, sdpa, scaling))
    return out.reshape(1, total, heads, d).contiguous()  # the layout its fake form promises, whatever ran


@varlen_attention.register_fake
def _(qkv, lengths, heads, scaling, layout, attention="auto"):
    return qkv.new_empty(1, qkv.size(1), heads, qkv.size(-1) // (3 * heads))


def _forced_attention(choice) -> str:  # a forced setting's attention: matmul_attention where named, else SDPA
    return "matmul_attention" if "matmul_attention" in choice else "reference"


def _forced_layout(choice) -> str:  # a forced setting's layout: the grid where it alone of the two is named
    grid = "grid_attention" in choice and "per_sequence_attention" not in choice
    return "grid_attention" if grid else "per_sequence_attention"


def _layout_kernel(choice, lengths: list[int], heads: int, head_dim: int, dtype) -> str:
    """"per_sequence_attention" or "grid_attention" for sequences of `lengths`: forced, or the faster of the two on
    random q, k, v of these shapes (both give the padded reference's numbers, tested)."""
    if choice != "auto":
        return _forced_layout(choice)
    n, m = len(lengths), max(lengths)
    key = f"layout|cpu|{str(dtype)[6:]}|n<={_bucket(n)}|m<={_bucket(m)}|{heads}x{head_dim}"

    def measure():
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, sum(lengths), head_dim, generator=g).to(dtype)
        per = lambda: [F.scaled_dot_product_attention(*(t,) * 3) for t in q.split(lengths, 2)]  # noqa: E731
        grid = torch.randn(n, heads, m, head_dim, generator=g).to(dtype)
        mask = _additive_mask(torch.arange(m)[None] < torch.tensor(lengths)[:, None], dtype)
        full = lambda: F.scaled_dot_product_attention(grid, grid, grid, mask)  # noqa: E731
        return "per_sequence_attention" if _median_seconds(per) <= _median_seconds(full) else "grid_attention"

    return _CHOICES.get(key, measure)


def token_map_kernel(setting, config, attention_mask, position_ids, batch_shape, dtype, kwargs,
                     training: bool = False) -> TokenMap | None:
    """Point "layout": the map of the real tokens of a padded batch or a packed row (b == 1, sequences restarting at
    position id 0, or DataCollatorWithFlattening's cu_seq_lens_q); a mask without padding gives the batch as its own
    unmasked grid (the mask read once); None: the padded batch, masked by the model (the reference)."""
    choice = parse_setting(setting)
    impl = config._attn_implementation
    flash = impl is not None and "flash" in impl and "paged" not in impl
    layouts = {"unpadded", "per_sequence_attention", "grid_attention"}
    if choice == "reference" or (choice != "auto" and not choice & layouts):
        return None
    if torch.compiler.is_compiling():
        if impl not in ("eager", "sdpa"):
            return None
        op = impl == "sdpa" and not training and not torch.is_grad_enabled() and not torch.compiler.is_exporting() \
            and attention_mask is not None and attention_mask.device.type == "cpu"
        layout = None if not op else "auto" if choice == "auto" else _forced_layout(choice)
        attention = "auto" if choice == "auto" else _forced_attention(choice)
        return _traced_token_map(attention_mask, batch_shape, dtype, layout, attention)
    if not (impl in ("eager", "sdpa") or flash):
        return None
    b, s = batch_shape
    if attention_mask is not None:
        keep = attention_mask.bool()
        lengths_t = keep.sum(1)
        lengths = lengths_t.tolist()  # the forward's one host read of the mask (a sync on an accelerator)
        if min(lengths) == s:  # nothing to unpad nor to mask: the batch as its own grid, unmasked (no second read)
            return TokenMap((b, s), (b, s))
        indices = keep.flatten().nonzero_static(size=sum(lengths)).squeeze(1)  # (T,) row-major: rows contiguous
    elif b == 1 and (kwargs.get("cu_seq_lens_q") is not None or position_ids is not None):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is not None:
            cu = cu.to(torch.long).view(-1)
            if cu[[0, -1]].tolist() != [0, s]:
                raise ValueError(f"cu_seq_lens_q {cu.tolist()} must run from 0 to the packed length {s}; pass the "
                                 "kwargs of DataCollatorWithFlattening(return_flash_attn_kwargs=True) unchanged")
            starts = cu[:-1]
        else:
            starts = _sequence_starts(position_ids)
        if starts.numel() < 2:
            return None
        lengths_t = torch.cat([starts.long(), torch.tensor([s], device=starts.device)]).diff()
        lengths, indices = lengths_t.tolist(), None
    else:
        return None
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    if flash:
        total, m = sum(lengths), max(max(lengths), 1)
        cu_seqlens = F.pad(lengths_t.cumsum(0), (1, 0)).int()  # (n + 1,)
        fkw = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": m, "max_length_k": m}
        return TokenMap((b, s), (1, total), indices=indices, attention_kwargs=fkw)
    heads = config.num_attention_heads
    return _sequence_layout(choice, (b, s), indices, lengths_t, lengths, heads, config.hidden_size // heads, dtype)


def _sequence_layout(choice, batch_shape, indices, lengths_t: torch.Tensor, lengths: list[int], heads: int,
                     head_dim: int, dtype) -> TokenMap:
    """Sequences of `lengths` (their tensor `lengths_t`), one after another, attended per sequence (on a CPU, where
    `_layout_kernel` picks it) or on their masked grid; sequences all of one length as their grid, unmasked and
    without a slot map (one call, as a batch without padding attends: nothing to choose)."""
    if lengths and lengths[0] > 0 and lengths.count(lengths[0]) == len(lengths):
        return TokenMap(batch_shape, (len(lengths), lengths[0]), indices=indices)
    real = [n for n in lengths if n]
    if real and lengths_t.device.type == "cpu" and \
            _layout_kernel(choice, real, heads, head_dim, dtype) == "per_sequence_attention":
        return TokenMap(batch_shape, (1, sum(real)), indices=indices, seq_lengths=tuple(real))
    grid_index, mask = _grid_of(lengths_t, lengths, dtype)
    return TokenMap(batch_shape, (len(lengths), max(max(lengths), 1)), mask, indices=indices, grid_index=grid_index)


@torch.compiler.assume_constant_result  # read once while tracing, a constant of the graph
def _captures_dynamic_shapes() -> bool:
    import torch._dynamo

    return bool(torch._dynamo.config.capture_dynamic_output_shape_ops)


def _traced_token_map(attention_mask, batch_shape, dtype, layout: str | None,
                      attention: str = "auto") -> TokenMap | None:
    """The "layout" point while torch.compile traces: the real tokens of a padded batch, their count a size of the
    graph known only when it runs, where dynamo is set to capture such ops
    (`torch._dynamo.config.capture_dynamic_output_shape_ops = True`). Attention as one op (`varlen_attention`, laid out
    by `layout`: "auto" or a forced layout; SDPA or `matmul_attention` as `attention` says) that reads the lengths when
    it runs; with no `layout` (training or gradients on: the op has no backward; export; the "eager" attention: the
    formula's own code), on the padded batch as the grid (n, m) = (b, s), masked. None otherwise: the padded batch (a
    data-dependent size would break the graph)."""
    if attention_mask is None or not _captures_dynamic_shapes():
        return None
    keep = attention_mask.bool()  # (b, s)
    indices = keep.flatten().nonzero().squeeze(1)  # (T,) row-major
    shape = tuple(batch_shape)
    if layout is not None:
        return TokenMap(shape, (1, indices.size(0)), indices=indices, lengths=keep.sum(1), layout=layout,
                        attention=attention)
    return TokenMap(shape, shape, _additive_mask(keep, dtype), indices=indices, grid_index=indices)


def _eager_bits_dropout(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, **kwargs):
    """modeling_bert_impl.eager_attention_forward (softmax(QKᵀ/√d_k + M) V, the formula) with "bits_dropout"
    masks on the probabilities in training; an additive mask (this module's layouts make no boolean one)."""
    scores = torch.matmul(query, key.transpose(-2, -1)) * scaling  # (b, h, s, s)
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # (b, h, s, s)
    probs = bits_dropout(probs, dropout) if module.training and dropout > 0 else probs
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs  # (b, s, h, d)


def matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float) -> torch.Tensor:
    """softmax(QKᵀ·scaling + M) V as modeling_bert_impl.eager_attention_forward writes it (M additive), on q, k, v (n,
    h, m, d) made contiguous (views of the fused projection make batched GEMMs copy per call): two batched GEMMs and a
    softmax in their dtype (a bfloat16 softmax computes in float32 and rounds once, as the formula's float32 softmax
    and its cast do). -> (n, m, h, d), contiguous (as SDPA's attention function returns it). At short sequences on a
    CPU this can beat SDPA's fused kernel, which tiles for long ones; "auto" measures which."""
    q, k, v = (t.contiguous() for t in (query, key, value))
    scores = torch.matmul(q, k.transpose(-2, -1)).mul_(scaling)  # (n, h, m, m)
    if mask is not None:
        scores = scores.add_(mask)
    return torch.matmul(scores.softmax(-1), v).transpose(1, 2).contiguous()


def _attention_choice(choice, q: torch.Tensor, mask: torch.Tensor | None, candidates) -> str:
    """Point "attention": "matmul_attention" or "reference" (SDPA) for inference attention on q (n, h, m, d) with
    `mask` (additive, or None): forced, or the faster of `candidates()` ({name: fn() -> out}) on this call's
    tensors, per (dtype, n, m, heads x head_dim, masked) class."""
    if choice != "auto":
        return _forced_attention(choice)
    n, h, m, d = q.shape
    key = (f"attention|cpu|{str(q.dtype)[6:]}|n<={_bucket(n)}|m<={_bucket(m)}|{h}x{d}|"
           f"{'unmasked' if mask is None else 'masked'}")
    return _CHOICES.get(key, lambda: _fastest(candidates()))


def _sdpa_or_matmul(choice, attend, scaling: float):
    """`attend(q, k, v, mask)` -> (out (n, m, h, d), probs), SDPA's, with the "attention" point in front of it: where
    it chooses "matmul_attention", that runs instead (probs None, as SDPA's)."""
    def attention(q, k, v, mask):
        candidates = lambda: {"reference": lambda: attend(q, k, v, mask)[0],  # noqa: E731
                              "matmul_attention": lambda: matmul_attention(q, k, v, mask, scaling)}
        if _attention_choice(choice, q, mask, candidates) == "matmul_attention":
            return matmul_attention(q, k, v, mask, scaling), None
        return attend(q, k, v, mask)
    return attention


def _matmul_applies(module, qkv: torch.Tensor, p: float, kwargs) -> bool:  # the "attention" point's conditions
    return (p == 0 and module.config._attn_implementation == "sdpa" and not torch.is_grad_enabled()
            and _plain_cpu(qkv) and not kwargs.get("output_attentions"))


def attention_kernel(setting, module, qkv: torch.Tensor, tokens: TokenMap | None, attention_fn, mask,
                     kwargs) -> tuple | None:
    """Point "attention": attention over `tokens` (the "layout" kernels), and training attention with "bits_dropout"
    masks, which runs the formula (`_eager_bits_dropout`: SDPA's CPU kernels draw no dropout of their own); with
    neither, `attention_fn` on the padded batch, as the plain model calls it. qkv: (b, s, 3H) or (1, T, 3H).
    In inference with SDPA, the "attention" point may run `matmul_attention` in its place. Returns (out (b, s, h, d)
    or (1, T, h, d), probs)."""
    p = module.attention_dropout if module.training else 0.0
    h, d = module.num_heads, module.head_dim
    if tokens is not None and tokens.lengths is not None:  # traced, in inference: one op
        return varlen_attention(qkv, tokens.lengths, h, module.scaling, tokens.layout, tokens.attention), None
    if tokens is None:
        n, m, extra = qkv.size(0), qkv.size(1), {}
    else:
        (n, m), mask, extra = tokens.grid, tokens.mask, tokens.attention_kwargs
    probs_shape = torch.Size((n, h, m, m)) if tokens is None or tokens.seq_lengths is None else \
        torch.Size((1, h, max(tokens.seq_lengths), max(tokens.seq_lengths)))
    varlen = tokens is not None and bool(tokens.attention_kwargs)  # flash's own layout: its function, its dropout
    if p > 0 and not varlen and dropout_choice(setting, qkv, p, True, probs_shape) == "bits_dropout":
        attention_fn = _eager_bits_dropout
    attend = lambda q, k, v, mask: attention_fn(  # noqa: E731
        module, q, k, v, mask, scaling=module.scaling, dropout=p, **extra, **kwargs)
    if tokens is not None and not varlen and _matmul_applies(module, qkv, p, kwargs):
        attend = _sdpa_or_matmul(parse_setting(setting), attend, module.scaling)
    return _laid_out_attention(qkv, tokens, n, m, mask, h, d, attend)


def _laid_out_attention(qkv: torch.Tensor, tokens: TokenMap | None, n: int, m: int, mask, h: int, d: int, attend):
    """`attend(q, k, v, mask)` -> (out (n, m, h, d), probs) on qkv (b, s, 3H) or (1, T, 3H) as `tokens` lays it out:
    the (n, m) grid (`mask` its padding mask), each sequence alone (`seq_lengths`), or as it is (None). Returns (out
    (b, s, h, d), (1, T, h, d) or (T, H), probs)."""
    if tokens is not None and tokens.grid_index is not None:  # each real token into its slot of the (n, m) grid
        qkv = qkv.new_zeros(n * m, 3 * h * d).index_copy(0, tokens.grid_index, qkv.view(-1, 3 * h * d))  # (n*m, 3H)
    parts = qkv.split(tokens.seq_lengths, dim=1) if tokens is not None and tokens.seq_lengths is not None else \
        (qkv.view(n, m, 3 * h * d),)
    outs = [attend(*part.unflatten(-1, (3, h, d)).permute(2, 0, 3, 1, 4), mask)
            for part in parts]  # q, k, v: (n, h, m, d) -> out (n, m, h, d), probs
    out, probs = outs[0] if len(outs) == 1 else (torch.cat([o for o, _ in outs], 1), None)
    if tokens is not None and tokens.grid_index is not None:  # from the grid's slots back to the real tokens
        out = out.reshape(n * m, h * d).index_select(0, tokens.grid_index)  # (T, H)
    return out, probs


# ----------------------------------------------------------------------------------------------
# kernelize: the kernels put on a model's module instances (their `forward`), and taken off again


def _own(module: nn.Module) -> bool:  # a standard nn.Linear that runs its own forward (no tool replaced or hooked it)
    return type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks)


def _linear_forward(self: nn.Linear, x: torch.Tensor, *, setting, skip_zero_rows: bool = False,
                    frozen: bool = False) -> torch.Tensor:
    y = linear_kernel(setting, self, x, None, skip_zero_rows, frozen)
    return F.linear(x, self.weight, self.bias) if y is None else y


def _act_linear(setting, linear: nn.Module, act: nn.Module, x: torch.Tensor, frozen: bool) -> torch.Tensor:
    """act(linear(x)), the activation inside the GEMM where a kernel does it; a replaced linear runs its forward."""
    if not _own(linear):
        return act(linear(x))
    y = linear_kernel(setting, linear, x, act, frozen=frozen)  # None: the reference, F.linear (not a second choice
    return act(F.linear(x, linear.weight, linear.bias)) if y is None else y  # without `act`)


def _mlp_forward(self, hidden_states, *, setting, frozen: bool = False):  # BertImplLayer.mlp: Wo(act(Wi x))
    return self.Wo(_act_linear(setting, self.Wi, self.act, hidden_states, frozen))


def _lm_head_forward(self, hidden_states, *, setting, frozen: bool = False):
    """The MLM heads' lm_head: decoder(LN(act(dense x)))."""
    return self.decoder(self.norm(_act_linear(setting, self.dense, self.act, hidden_states, frozen)))


def _dropout_forward(self: nn.Dropout, x: torch.Tensor, *, setting) -> torch.Tensor:
    if dropout_choice(setting, x, self.p, self.training) == "bits_dropout":
        return bits_dropout(x, self.p)
    return F.dropout(x, self.p, self.training, self.inplace)


def _attention_forward(self, hidden_states, attention_mask=None, *, setting, **kwargs):  # BertImplSelfAttention
    tokens = kwargs.pop("bert_impl_tokens", None)  # the encoder's map of the real tokens ("unpadded")
    p = self.attention_dropout if self.training else 0.0
    bits = p > 0 and _plain_cpu(hidden_states) and not kwargs.get("output_attentions")
    if tokens is None and not bits:
        return type(self).forward(self, hidden_states, attention_mask, **kwargs)
    qkv = self.Wqkv(hidden_states)  # (b, s, 3H) or (1, T, 3H)
    attend = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, plain.eager_attention_forward)
    out, probs = attention_kernel(setting, self, qkv, tokens, attend, attention_mask, kwargs)  # out: (b, s, h, d)
    return self.Wo(out.reshape(hidden_states.shape)), probs


def _encoder_forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                     inputs_embeds=None, *, setting, **kwargs):
    """BertImplModel on the real tokens only ("unpadded"): the inputs gathered to (1, T), the layers run on (1, T, H),
    the output scattered back to (b, s, H) with zeros at padding. Recorded outputs (hidden states, attentions) are the
    padded batch's: those calls, and any the layout does not take, run the plain forward."""
    recording = any(kwargs.get(f"output_{n}") or getattr(self.config, f"output_{n}", False)
                    for n in ("attentions", "hidden_states"))
    args = (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
    if recording:
        return type(self).forward(self, *args, **kwargs)
    plain._check_inputs(self.config, *args)
    shape = tuple(input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1])
    dtype = self.embeddings.word_embeddings.weight.dtype if inputs_embeds is None else inputs_embeds.dtype
    tokens = token_map_kernel(setting, self.config, attention_mask, position_ids, shape, dtype, kwargs, self.training)
    if tokens is None:
        return type(self).forward(self, *args, **kwargs)
    return_dict = kwargs.pop("return_dict", None)
    if torch.compiler.is_compiling():  # the padded batch embedded, then its real tokens: no positions to read
        hidden_states = tokens.gather(self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds))
    else:
        if position_ids is None:  # real tokens keep their places in their rows
            device = (input_ids if input_ids is not None else inputs_embeds).device
            position_ids = torch.arange(shape[1], device=device)[None]
        hidden_states = self.embeddings(*map(tokens.gather, (input_ids, token_type_ids, position_ids, inputs_embeds)))
    for layer in self.layers:
        hidden_states = layer(hidden_states, None, bert_impl_tokens=tokens, **kwargs)
    hidden_states = tokens.scatter(hidden_states)  # (b, s, H), zeros at padding
    pooled = self.pooler(hidden_states[:, 0]) if self.pooler is not None else None  # (b, H)
    out = BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=pooled)
    return out.to_tuple() if return_dict is False else out


def _labelled(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (b, s) -> the n labelled rows, labels
    keep = labels.reshape(-1).ne(plain.IGNORE_INDEX).nonzero().squeeze(1)
    return keep, labels.reshape(-1).index_select(0, keep)


def _sparse_mlm_logits_and_loss(self, sequence_output, labels, num_items_in_batch):
    """The MLM heads' logits and loss with the decoder on the n labelled positions only: logits (n, V), the same loss
    (unlabelled positions add 0 to it)."""
    if labels is None or torch.compiler.is_compiling() or tuple(labels.shape) != tuple(sequence_output.shape[:-1]):
        return type(self)._mlm_logits_and_loss(self, sequence_output, labels, num_items_in_batch)
    keep, labelled = _labelled(labels)  # (n,), (n,)
    logits = self.lm_head(sequence_output.reshape(-1, sequence_output.size(-1)).index_select(0, keep))  # (n, V)
    return logits, plain.masked_lm_loss(logits, labelled, num_items_in_batch)


def _dense_mlm_logits_and_loss(self, sequence_output, labels, num_items_in_batch):
    """The MLM heads' full logits (b, s, V), with the loss taken from the labelled rows only (the others add 0 to it,
    and their zero gradient lets the decoder's backward skip them). CPU, outside compilation (a host read)."""
    if labels is None or torch.compiler.is_compiling() or labels.device.type != "cpu" or \
            tuple(labels.shape) != tuple(sequence_output.shape[:-1]):
        return type(self)._mlm_logits_and_loss(self, sequence_output, labels, num_items_in_batch)
    logits = self.lm_head(sequence_output)  # (b, s, V)
    keep, labelled = _labelled(labels)  # (n,), (n,)
    rows = logits.reshape(-1, logits.size(-1)).index_select(0, keep)  # (n, V)
    return logits, plain.masked_lm_loss(rows, labelled, num_items_in_batch)


_FORWARDS = {"BertImplModel": _encoder_forward, "BertImplSelfAttention": _attention_forward}  # by class name:
_CHILD_FORWARDS = {"mlp": _mlp_forward, "lm_head": _lm_head_forward}  # by name in a bert_impl parent (remote too)


def _put(module: nn.Module, fn, attribute: str = "forward", **options) -> None:
    @functools.wraps(fn)  # a real function, not a partial: torch.compile(module) needs its source file
    def kernel(self, *args, **kwargs):
        return fn(self, *args, **kwargs, **options)

    kernel.bert_impl_kernel = fn
    setattr(module, attribute, types.MethodType(kernel, module))


def _ours(module: nn.Module, attribute: str = "forward"):  # the kernel function put on `module`, or None
    bound = module.__dict__.get(attribute)
    fn = getattr(getattr(bound, "__func__", None), "bert_impl_kernel", None)
    ours = (_linear_forward, _dropout_forward, _sparse_mlm_logits_and_loss, _dense_mlm_logits_and_loss)
    ours += (*_FORWARDS.values(), *_CHILD_FORWARDS.values())
    return fn if fn in ours else None


def kernelize(model: nn.Module, kernels="auto", sparse_prediction: bool = False, frozen: bool = False) -> nn.Module:
    """Put the speed layer on `model` (any bert_impl model or head, loaded by the package or by trust_remote_code) and
    return it. `kernels`: "auto" (each kernel measured here, kept where it agrees with the plain model and is faster),
    "reference" (take every kernel off: the plain model), or kernel names to force (`KERNELS`, comma-separated).
    `sparse_prediction`: the MLM heads' decoder runs on labelled positions only when labels are given (logits (n, V));
    not with "reference", which is the plain model exactly. `frozen`: a served model whose weights stay as they are
    (as in an exported or compiled graph): "auto" may then run inference on weights packed once ("packed_linear": a
    second copy of each such weight, kept beside the model, made again when a weight changes in place, by a new
    Parameter or by `.to()`; a write through `.data`, as peft's merge does, is not seen: call kernelize again after
    one). Forcing "packed_linear" by name packs whatever `frozen` says.
    Parameters, buffers, config and saved files do not change; calling it again replaces the previous kernels."""
    setting = parse_setting(kernels)
    for module in model.modules():
        _PACKED.pop(module, None)  # packed weights are made again by the new kernels, if they pack
        for attribute in ("forward", "_mlm_logits_and_loss"):
            if _ours(module, attribute) is not None:
                delattr(module, attribute)
    if setting == "reference":
        return model
    decoders = {id(m.lm_head.decoder) for m in model.modules() if hasattr(m, "lm_head")}
    for module in model.modules():
        name = type(module).__name__
        if _own(module):
            _KERNELIZED_LINEARS[id(module)] = module
            _put(module, _linear_forward, setting=setting, skip_zero_rows=id(module) in decoders, frozen=frozen)
        elif type(module) is nn.Dropout:
            _put(module, _dropout_forward, setting=setting)
        elif name in _FORWARDS:
            _put(module, _FORWARDS[name], setting=setting)
        for child, fn in _CHILD_FORWARDS.items():  # the FFN of a layer, the MLM heads' prediction head
            if name.startswith("BertImpl") and type(getattr(module, child, None)) is nn.Sequential:
                _put(getattr(module, child), fn, setting=setting, frozen=frozen)
        if hasattr(type(module), "_mlm_logits_and_loss"):  # the MLM heads' loss on the labelled rows
            _put(module, _sparse_mlm_logits_and_loss if sparse_prediction else _dense_mlm_logits_and_loss,
                 "_mlm_logits_and_loss")
    logger.info("kernelize(%s, kernels=%r, sparse_prediction=%s, frozen=%s): %d modules", type(model).__name__,
                kernels, sparse_prediction, frozen, len(kernelized(model)))
    return model


def kernelized(model: nn.Module) -> dict[str, str]:
    """{module name: the kernel function put on it} for every module `kernelize` changed ("" is the model itself)."""
    return {name + ("" if attribute == "forward" else f".{attribute}"): fn.__name__
            for name, module in model.named_modules() for attribute in ("forward", "_mlm_logits_and_loss")
            if (fn := _ours(module, attribute)) is not None}
