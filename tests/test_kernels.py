"""The speed layer (hf_bert_impl/kernels_bert_impl.py) against the plain model.

"unpadded" (BertImplEncoder.forward on the real tokens as one packed row; BertImplSelfAttention.attention_function
attending per sequence of that row) runs against `kernelize(copy, "reference")` (the plain model, same weights), under
eager and sdpa attention, on a padded batch of mixed lengths with rows of one token, for every head: float32 outputs
within 1e-5 on the real tokens (the encoder's output exactly zero at padding), the loss and every parameter's gradient
within 1e-5; bfloat16 within 3x the error transformers' BERT has against a float32 reference, where the CPU has bf16
units. Also: the table and the names `kernels=` takes; kernelize is deterministic and leaves no trace (two processes
give the same bits and the same `kernelized` map, no file written, no environment variable read); idempotent,
deep-copy safe; recorded outputs, save_pretrained, peft and hooks as on the plain model; torch.compile runs the plain
path and warns once.

Run: pytest tests/test_kernels.py -q
"""

import ast
import copy
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import hf_bert_impl
from hf_bert_impl import HEAD_TABLE, BertImplForMaskedLM, BertImplForPreTraining, BertImplModel, kernelize, kernelized
from hf_bert_impl import kernels_bert_impl as K
from hf_bert_impl.convert import from_hf_bert
from hf_bert_impl.modeling_bert_impl import BertImplEncoder

from .conftest import BATCH, REPO_ROOT, SEQ, VOCAB
from .test_convert import LABELS, hf_model, inputs_for


ATOL = 1e-5  # float32, unit-scale activations (design: tolerances)
LENGTHS = [7, 1, 4, 6, 2, 7, 3, 5, 1, 7, 6, 2, 4]  # one per row of the batch: mixed, two rows of one token
HEADS = [pytest.param(head, id=head.name) for head in HEAD_TABLE]


@pytest.fixture
def mixed():
    """A padded batch (input_ids, attention_mask, token_type_ids), each (13, 7), row i holding LENGTHS[i] tokens; the
    first 12 rows are multiple choice's (4, 3, 7) (tests/test_convert.py's `inputs_for`)."""
    g = torch.Generator().manual_seed(4321)
    mask = (torch.arange(SEQ)[None] < torch.tensor(LENGTHS)[:, None]).long()
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g) * mask
    types = (torch.arange(SEQ)[None] >= 3).long() * mask
    return ids, mask, types


@pytest.fixture
def encoder_calls(monkeypatch):
    """The shape of hidden_states each call of the plain BertImplEncoder.forward gets: (1, T, H) where "unpadded" ran
    (it calls the class's forward on the packed row), (b, s, H) where the plain model ran."""
    calls, forward = [], BertImplEncoder.forward

    def spy(self, hidden_states, *args, **kwargs):
        calls.append(tuple(hidden_states.shape))
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(BertImplEncoder, "forward", spy)
    return calls


def head_model(head, debug_config, **overrides):
    """`head`'s class on the debug config (dropout off; 3 labels, QA's 2 outputs), seeded."""
    kw = (
        {}
        if head.hf_class == "BertForQuestionAnswering"
        else {"id2label": LABELS, "label2id": {v: k for k, v in LABELS.items()}}
    )
    if head.hf_class == "BertForSequenceClassification":
        kw["problem_type"] = "single_label_classification"
    torch.manual_seed(0)
    return getattr(hf_bert_impl, head.name)(debug_config(**kw, **overrides))


def plain_copy(model):
    """The same weights on the plain model: the reference every kernel must match."""
    plain = kernelize(copy.deepcopy(model), "reference")
    assert kernelized(plain) == {}
    return plain


def loss_of(out, mask):
    """The head's loss; the bare encoder's: a fixed random projection of its outputs (gradients of unit scale)."""
    if "loss" in out:
        return out.loss
    g = torch.Generator().manual_seed(5)
    w = torch.randn(out.last_hidden_state.shape, generator=g)
    return (out.last_hidden_state * w).sum() / mask.sum() + out.pooler_output.sum() / len(mask)


def assert_outputs_match(got, want, mask, atol=ATOL):
    """Every tensor field within atol; per-token fields ((b, s, ...) with the mask's (b, s)) on the real tokens,
    and the encoder's output exactly zero at padding in both."""
    real = mask.reshape(-1, mask.shape[-1]).bool()  # (b, s); multiple choice: (b*c, s)
    for key, w in want.items():
        g = got[key]
        assert g.shape == w.shape, (key, g.shape, w.shape)
        per_token = tuple(w.shape[:2]) == tuple(real.shape)
        diff = ((g - w)[real] if per_token else g - w).abs().max().item()
        assert diff <= atol, f"{key}: max |Δ| {diff:.2e}"
        if key == "last_hidden_state":
            assert g[~real].abs().max().item() == 0.0 and w[~real].abs().max().item() == 0.0


def assert_gradients_match(model, plain, atol=ATOL):
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient reaches {missing}"
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= atol, name


# ---------------------------------------------------------------------------------------------------------------------
# "unpadded": every head, eager and sdpa, float32


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("head", HEADS)
def test_unpadded_matches_the_plain_model_on_every_head(debug_config, mixed, encoder_calls, head, backend):
    """A training step (dropout off) and inference: outputs, loss and every gradient of the kernelized head against
    the plain one; the kernelized encoder ran once, on the T real tokens only."""
    model = kernelize(head_model(head, debug_config, attn_implementation=backend).train(), "unpadded")
    assert model.config._attn_implementation == backend
    plain = plain_copy(model)
    x = inputs_for(head.hf_class, mixed)
    mask = x["attention_mask"]
    got = model(**x)
    assert encoder_calls == [(1, int(mask.sum()), model.config.hidden_size)]
    want = plain(**x)
    assert encoder_calls[1:] == [(*mask.reshape(-1, SEQ).shape, model.config.hidden_size)]
    assert_outputs_match(got, want, mask)
    loss, ref = loss_of(got, mask), loss_of(want, mask)
    assert abs(loss.item() - ref.item()) <= ATOL
    loss.backward()
    ref.backward()
    assert_gradients_match(model, plain)
    with torch.no_grad():
        assert_outputs_match(model.eval()(**x), plain.eval()(**x), mask)


@pytest.mark.parametrize("setting", ["auto", "unpadded", " unpadded ", ["unpadded"], ("unpadded",)])
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_the_table_and_forced_names_unpad_the_mlm_head(debug_config, mixed, encoder_calls, setting, training):
    """ "auto" (KERNEL_TABLE: CPU float32 unpads in training and inference) and the names forced: the MLM logits on
    the real tokens and the loss within 1e-5 of the plain model's."""
    torch.manual_seed(0)
    model = kernelize(BertImplForMaskedLM(debug_config()).train(training), setting)
    plain = plain_copy(model)
    x = inputs_for("BertForMaskedLM", mixed)
    with torch.no_grad():
        got, want = model(**x), plain(**x)
    assert encoder_calls[0][0] == 1 and encoder_calls[1][0] == BATCH
    assert_outputs_match(got, want, x["attention_mask"])


@pytest.mark.parametrize("pattern", ["left", "holes", "empty_row"])
def test_unpadded_any_padding_pattern(debug_config, mixed, encoder_calls, pattern):
    """Left padding, holes inside rows, and a row without tokens: the real tokens as the plain model has them, zeros
    at padding (the row without tokens: zeros, finite pooled output)."""
    torch.manual_seed(0)
    model = kernelize(BertImplModel(debug_config()).eval(), "unpadded")
    ids, mask, _ = mixed
    mask = {
        "left": mask.flip(1),
        "holes": mask * (torch.arange(SEQ) != 2),
        "empty_row": mask * (torch.arange(BATCH) != 3)[:, None],
    }[pattern]
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask), plain_copy(model)(ids, attention_mask=mask)
    assert encoder_calls[0] == (1, int(mask.sum()), model.config.hidden_size)
    assert torch.isfinite(got.pooler_output).all()
    assert_outputs_match(
        {"last_hidden_state": got.last_hidden_state}, {"last_hidden_state": want.last_hidden_state}, mask
    )
    rows = mask.any(1)
    assert (got.pooler_output - want.pooler_output)[rows].abs().max().item() <= ATOL


FALLBACKS = {  # case: (kernels, model dtype, forward keyword arguments (None: the batch's mask))
    "reference": ("reference", torch.float32, {}),
    "no mask": ("auto", torch.float32, {"attention_mask": "none"}),
    "no padding": ("auto", torch.float32, {"attention_mask": "ones"}),
    "output_hidden_states": ("auto", torch.float32, {"output_hidden_states": True}),
    "output_attentions": ("auto", torch.float32, {"output_attentions": True}),
    "float64: not in the table": ("auto", torch.float64, {}),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_where_unpadded_does_not_run_the_plain_model_runs(debug_config, mixed, encoder_calls, case):
    """The plain forward on the padded batch, bit for bit the plain model's, where the setting or the table names no
    "unpadded", where nothing is padded, and where hidden states or attentions are recorded."""
    setting, dtype, kw = FALLBACKS[case]
    torch.manual_seed(0)
    model = kernelize(BertImplModel(debug_config(attn_implementation="eager")).to(dtype).eval(), setting)
    ids, mask, _ = mixed
    kw = dict(kw, attention_mask={"none": None, "ones": torch.ones_like(mask)}.get(kw.get("attention_mask"), mask))
    with torch.no_grad():
        got, want = model(ids, **kw), plain_copy(model)(ids, **kw)
    assert encoder_calls == [(BATCH, SEQ, model.config.hidden_size)] * 2
    for key in want:
        pairs = zip(got[key], want[key]) if isinstance(want[key], tuple) else [(got[key], want[key])]
        assert all(torch.equal(g, w) for g, w in pairs), key


def test_forced_unpadded_runs_outside_the_table(debug_config, mixed, encoder_calls):
    """Forced by name, "unpadded" runs where the table has no entry (float64): within 1e-12 of the plain model."""
    torch.manual_seed(0)
    model = kernelize(BertImplModel(debug_config()).double().eval(), "unpadded")
    ids, mask, _ = mixed
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask), plain_copy(model)(ids, attention_mask=mask)
    assert encoder_calls[0][0] == 1
    assert_outputs_match(got, want, mask, atol=1e-12)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_a_layer_without_the_attention_kernel_attends_by_the_block_mask(debug_config, mixed, encoder_calls, backend):
    """One attention's `attention_function` kernel taken off (as a tool replacing it would): the packed row's
    sequences are kept apart by the plain model's block mask (position ids restarting at each sequence) instead;
    outputs within 1e-5 of the plain model's."""
    torch.manual_seed(0)
    model = kernelize(BertImplModel(debug_config(attn_implementation=backend)).eval(), "unpadded")
    del model.layers[1].attn.attention_function
    assert "layers.1.attn.attention_function" not in kernelized(model)
    ids, mask, _ = mixed
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask), plain_copy(model)(ids, attention_mask=mask)
    assert encoder_calls[0] == (1, int(mask.sum()), model.config.hidden_size)
    assert_outputs_match(got, want, mask)


@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_recorded_outputs_asked_for_in_the_config_are_the_plain_models(debug_config, mixed, flag):
    """output_hidden_states / output_attentions set in the config (as `from_pretrained(..., output_hidden_states=True)`
    sets them) rather than passed to forward: the kernelized model records what the plain model records."""
    torch.manual_seed(0)
    model = kernelize(BertImplModel(debug_config(attn_implementation="eager", **{flag: True})).eval())
    ids, mask, _ = mixed
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask), plain_copy(model)(ids, attention_mask=mask)
    key = flag.removeprefix("output_")
    assert [t.shape for t in got[key]] == [t.shape for t in want[key]]
    for g, w in zip(got[key], want[key]):  # the plain model's run: equal everywhere
        assert (g - w).abs().max().item() <= ATOL


# ---------------------------------------------------------------------------------------------------------------------
# bfloat16: within 3x transformers' error against float32, where the CPU has bf16 units


def cpu_has_bf16_units() -> bool:
    """AVX512-BF16 or AMX (torch.cpu's probes, x86); elsewhere no claim is made and the bf16 tests skip."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


@pytest.mark.skipif(
    not cpu_has_bf16_units(),
    reason="no bf16 units on this CPU "
    f"(torch.backends.cpu.get_cpu_capability() = {torch.backends.cpu.get_cpu_capability()})",
)
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_unpadded_bf16_within_3x_transformers_error(mixed, encoder_calls, backend):
    """An MLM training step (dropout off) in bfloat16, kernelized by the table: ours' logits on the real tokens, loss
    and gradient (relative, over all parameters) against float32 transformers within 3x the error transformers' own
    BertForMaskedLM has in bfloat16 against the same float32 reference."""
    hf32 = hf_model("BertForMaskedLM", attn_implementation=backend).train()
    ours32 = from_hf_bert(hf32, BertImplForMaskedLM).train()
    ours32.set_attn_implementation(backend)
    models = {
        "hf32": hf32,
        "hf16": copy.deepcopy(hf32).to(torch.bfloat16),
        "ours32": ours32,
        "ours16": kernelize(copy.deepcopy(ours32).to(torch.bfloat16)),
    }
    x = inputs_for("BertForMaskedLM", mixed)
    real = x["attention_mask"].bool()
    logits, loss, grads = {}, {}, {}
    for name, model in models.items():
        out = model(**x)
        out.loss.backward()
        logits[name], loss[name] = out.logits.float()[real], out.loss.float()
        grads[name] = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    assert (1, int(real.sum()), 32) in encoder_calls  # ours in bf16 ran unpadded (the table's CPU bf16 entries)
    errors = {  # name: (transformers' bf16 error, ours'), both against float32
        "logits": [(logits[m] - logits["hf32"]).abs().max() for m in ("hf16", "ours16")],
        "loss": [(loss[m] - loss["hf32"]).abs() for m in ("hf16", "ours16")],
        "gradient": [
            (grads[m] - grads[ref]).norm() / grads[ref].norm() for m, ref in (("hf16", "hf32"), ("ours16", "ours32"))
        ],
    }
    for name, (theirs, mine) in errors.items():
        print(f"bf16 {backend} {name}: transformers {theirs.item():.2e}, ours {mine.item():.2e}")
        assert torch.isfinite(mine) and mine <= 3 * theirs + 1e-6, (name, mine.item(), theirs.item())


# ---------------------------------------------------------------------------------------------------------------------
# Dropout on: a kernelized training step repeats under its seed


def test_a_dropout_training_step_repeats_under_its_seed(debug_config, mixed):
    """An MLM step with dropout 0.1 (hidden and attention) kernelized by the table: the same seed gives the same loss
    and gradients bit for bit, another seed another loss."""
    torch.manual_seed(0)
    config = debug_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = kernelize(BertImplForMaskedLM(config).train())
    x = inputs_for("BertForMaskedLM", mixed)
    runs = []
    for seed in (1, 1, 2):
        model.zero_grad()
        torch.manual_seed(seed)
        loss = model(**x).loss
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(runs[0][0], runs[1][0]) and all(map(torch.equal, runs[0][1], runs[1][1]))
    assert not torch.equal(runs[0][0], runs[2][0])


# ---------------------------------------------------------------------------------------------------------------------
# The table and the names


def test_table_entries_and_lookups():
    """`table_kernels` answers KERNEL_TABLE's entry for each (device type, mode, dtype) and none where it has no entry;
    every entry names known kernels; the CPU's float32 and bfloat16 entries (which the tests above rely on) unpad."""
    for (device, mode, dtype), kernels in K.KERNEL_TABLE.items():
        assert device in ("cpu", "cuda") and mode in ("training", "inference") and isinstance(dtype, torch.dtype)
        assert kernels and set(kernels) <= set(K.KERNELS)
        assert K.table_kernels(device, mode == "training", dtype) == kernels
    for missing in (("cpu", True, torch.float64), ("cpu", False, torch.float16), ("mps", False, torch.float32)):
        assert missing[:1] + ("training" if missing[1] else "inference",) + missing[2:] not in K.KERNEL_TABLE
        assert K.table_kernels(*missing) == ()
    for training in (True, False):
        for dtype in (torch.float32, torch.bfloat16):
            assert K.table_kernels("cpu", training, dtype) == ("unpadded",)
    assert set(K.KERNELS) == {"unpadded"}


def test_kernel_names():
    assert K.kernel_names("auto") == "auto" and K.kernel_names("reference") == "reference"
    assert K.kernel_names(" unpadded") == K.kernel_names("unpadded,unpadded") == frozenset({"unpadded"})
    assert K.kernel_names(["unpadded"]) == K.kernel_names(("unpadded",)) == frozenset({"unpadded"})


@pytest.mark.parametrize(
    "bad",
    ["fast", "", "unpadded,nope", "unpadded,", "onednn_linear", "bits_dropout", [], ["unpadded", 3], None, 0, True],
)
def test_a_bad_name_is_a_value_error_naming_the_value(debug_config, bad):
    """The message names the value and the kernels there are; the model keeps the kernels it had."""
    model = kernelize(BertImplModel(debug_config()), "unpadded")
    before = kernelized(model)
    with pytest.raises(ValueError, match=re.escape(f"got {bad!r}")) as raised:
        kernelize(model, bad)
    assert "('unpadded',)" in str(raised.value)  # the kernels there are
    assert kernelized(model) == before


def test_what_kernelize_puts_on_and_reference_takes_off(debug_config, mixed):
    """A non-reference setting replaces the encoder seam's forward and each attention's `attention_function` (the
    seams the model declares by `kernel_seam`), nothing else; "reference" takes every one off (no instance method
    left), and the outputs are a never-kernelized model's bit for bit."""
    torch.manual_seed(0)
    untouched = BertImplForMaskedLM(debug_config()).eval()
    model = kernelize(copy.deepcopy(untouched), "auto")
    layers = range(model.config.num_hidden_layers)
    assert kernelized(model) == {
        "bert.layers": "unpadded_encoder_forward",
        **{f"bert.layers.{i}.attn.attention_function": "attention_function" for i in layers},
    }
    assert kernelize(model, "reference") is model and kernelized(model) == {}
    assert not any({"forward", "attention_function"} & set(m.__dict__) for m in model.modules())
    ids, mask, _ = mixed
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, untouched(ids, attention_mask=mask).logits)


def test_kernelize_is_idempotent_and_replaces_rather_than_stacks(debug_config, mixed, encoder_calls):
    torch.manual_seed(0)
    model = kernelize(BertImplModel(debug_config()).eval(), "unpadded")
    ids, mask, _ = mixed
    with torch.no_grad():
        once = model(ids, attention_mask=mask).last_hidden_state
        first = kernelized(model)
        assert kernelize(kernelize(model, "unpadded"), "unpadded") is model and kernelized(model) == first
        assert torch.equal(model(ids, attention_mask=mask).last_hidden_state, once)
        assert encoder_calls == [encoder_calls[0]] * 2 and encoder_calls[0][0] == 1  # one encoder pass per call
        kernelize(model, "reference")
        model(ids, attention_mask=mask)
        kernelize(model, "unpadded")  # on again: one encoder pass per call still
        model(ids, attention_mask=mask)
    assert encoder_calls[2:] == [(BATCH, SEQ, model.config.hidden_size), encoder_calls[0]]


def test_a_deep_copy_of_a_kernelized_model_runs_its_own_weights(debug_config, mixed):
    """The copy's kernel forwards are bound to the copy: changing its weights changes its outputs, not the
    original's, and the copy matches the plain model with its weights."""
    torch.manual_seed(0)
    model = kernelize(BertImplModel(debug_config()).eval(), "unpadded")
    twin = copy.deepcopy(model)
    assert kernelized(twin) == kernelized(model) and twin.layers.forward.__self__ is twin.layers
    assert all(layer.attn.attention_function.__self__ is layer.attn for layer in twin.layers)
    ids, mask, _ = mixed
    with torch.no_grad():
        before = model(ids, attention_mask=mask).last_hidden_state
        for p in twin.layers.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        mine, theirs = twin(ids, attention_mask=mask), plain_copy(twin)(ids, attention_mask=mask)
        assert torch.equal(model(ids, attention_mask=mask).last_hidden_state, before)
    assert (mine.last_hidden_state - before).abs().max().item() > 1e-2
    assert_outputs_match(mine, theirs, mask)


# ---------------------------------------------------------------------------------------------------------------------
# Deterministic, no trace: no file, no environment, the same bits in every process


CHILD = r"""
import hashlib, json, torch
torch.set_num_threads(1)
from hf_bert_impl import BertImplConfig, BertImplForMaskedLM, kernelize, kernelized
config = BertImplConfig.from_preset("debug", vocab_size=99, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0)
torch.manual_seed(0)
model = kernelize(BertImplForMaskedLM(config).train())
g = torch.Generator().manual_seed(1)
mask = (torch.arange(7)[None] < torch.tensor([7, 1, 4, 6, 2])[:, None]).long()
ids = torch.randint(1, 99, (5, 7), generator=g) * mask
labels = torch.where(torch.rand(5, 7, generator=g) < 0.4, ids, -100)
torch.manual_seed(2)
out = model(ids, attention_mask=mask, labels=labels)
out.loss.backward()
digest = hashlib.sha256()
for t in (out.logits, out.loss, *(p.grad for p in model.parameters())):
    digest.update(t.detach().contiguous().numpy().tobytes())
print(json.dumps({"digest": digest.hexdigest(), "kernelized": kernelized(model)}))
"""


def run_child(root, tag, extra_env=None):
    """CHILD in a fresh interpreter whose HF_HOME, HOME, XDG cache, TMPDIR and working directory are empty folders
    under `root`; returns its JSON line and the folders."""
    folders = {name: root / f"{tag}-{name}" for name in ("hf_home", "home", "xdg", "tmp", "cwd")}
    for folder in folders.values():
        folder.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_", "TRANSFORMERS_"))}
    env.update(
        HF_HOME=str(folders["hf_home"]),
        HOME=str(folders["home"]),
        XDG_CACHE_HOME=str(folders["xdg"]),
        TMPDIR=str(folders["tmp"]),
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(REPO_ROOT),
        PYTHONDONTWRITEBYTECODE="1",
        **(extra_env or {}),
    )
    done = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=folders["cwd"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), folders


@pytest.mark.slow  # two interpreters: about 11 s on two cores
def test_two_processes_give_the_same_bits_and_write_no_file(tmp_path):
    """Two interpreters kernelize the same seeded model ("auto") and run the same seeded training step with dropout:
    the same kernelized map, logits, loss and gradients bit for bit; the second one with variables that a speed layer
    reading the environment would obey. Neither writes a file (HF_HOME, HOME, caches, TMPDIR, the working directory
    stay empty)."""
    first, folders = run_child(tmp_path, "a")
    noise = {"HF_BERT_IMPL_KERNELS": "reference", "HF_BERT_IMPL_KERNEL_CACHE": str(tmp_path / "cache.json")}
    second, more = run_child(tmp_path, "b", noise)
    assert first == second
    assert set(first["kernelized"].values()) == {"unpadded_encoder_forward", "attention_function"}
    written = {
        name: sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
        for name, folder in {**folders, **{f"b-{k}": v for k, v in more.items()}}.items()
    }
    assert not any(written.values()), written
    assert not (tmp_path / "cache.json").exists()


def test_kernelize_and_its_forwards_read_no_environment_variable(debug_config, mixed, monkeypatch):
    """os.environ replaced by a recording copy: kernelize reads nothing, and a kernelized training step reads no
    variable the plain model's step does not read."""

    class Recording(dict):
        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            read.add(key)
            return super().get(key, default)

        def __contains__(self, key):
            read.add(key)
            return super().__contains__(key)

    torch.manual_seed(0)
    plain = BertImplForMaskedLM(debug_config(hidden_dropout_prob=0.1)).train()
    model = copy.deepcopy(plain)
    x = inputs_for("BertForMaskedLM", mixed)
    read = set()
    monkeypatch.setattr(os, "environ", Recording(os.environ))
    kernelize(model)
    assert read == set()
    steps = {}
    for name, m in (("plain", plain), ("plain", plain), ("kernelized", model)):  # the plain's first step: a warm-up
        read.clear()
        m(**x).loss.backward()
        steps[name] = set(read)
    assert steps["kernelized"] <= steps["plain"], steps["kernelized"] - steps["plain"]


def test_the_kernel_module_opens_no_file_reads_no_environment_and_times_nothing():
    """The source, as a syntax tree: imports torch, functools, types and warnings only; no open / os / environ / time
    / json."""
    tree = ast.parse((REPO_ROOT / "hf_bert_impl" / "kernels_bert_impl.py").read_text(encoding="utf-8"))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    assert imported <= {"torch", "functools", "types", "warnings"}, imported
    forbidden = {
        "open",
        "os",
        "environ",
        "getenv",
        "time",
        "perf_counter",
        "monotonic",
        "json",
        "Path",
        "pickle",
        "tempfile",
        "filelock",
    }
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not names & forbidden, names & forbidden


# ---------------------------------------------------------------------------------------------------------------------
# What kernelize leaves as it is: saved files, peft, hooks


def test_a_kernelized_model_saves_exactly_what_the_plain_model_saves(debug_config, tmp_path):
    """save_pretrained of a kernelized model writes the plain model's files byte for byte (config.json without a speed
    field, the safetensors, the code files); the state dicts are equal; it loads as the plain model."""
    torch.manual_seed(0)
    plain = BertImplForPreTraining(debug_config())
    fast = kernelize(copy.deepcopy(plain), "unpadded")
    assert fast.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(t, plain.state_dict()[k]) for k, t in fast.state_dict().items())
    plain.save_pretrained(tmp_path / "plain")
    fast.save_pretrained(tmp_path / "fast")
    files = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "fast").iterdir())
    assert {"config.json", "model.safetensors", "modeling_bert_impl.py", "configuration_bert_impl.py"} <= set(files)
    assert "kernels_bert_impl.py" not in files
    for name in files:
        assert (tmp_path / "fast" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
    assert not {"kernels", "unpad_inputs"} & set(json.loads((tmp_path / "fast" / "config.json").read_text()))
    assert kernelized(BertImplForPreTraining.from_pretrained(tmp_path / "fast")) == {}


def test_peft_lora_layers_keep_their_forward_under_kernelize(debug_config, mixed):
    """LoRA on Wqkv and attention's Wo (peft), kernelized after: the LoRA layers are not kernelized and run their
    own forward; logits, loss and the LoRA gradients are those of the plain peft model within 1e-5."""
    import peft

    head = next(h for h in HEAD_TABLE if h.name == "BertImplForSequenceClassification")
    lora = peft.LoraConfig(target_modules=["Wqkv", "attn.Wo"], r=2, lora_dropout=0.0, init_lora_weights=False)
    plain = peft.get_peft_model(head_model(head, debug_config), lora)
    model = kernelize(copy.deepcopy(plain), "unpadded")
    lora_layers = [n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(lora_layers) == 4 and not set(lora_layers) & set(kernelized(model))
    ran = []
    for m in (m for name, m in model.named_modules() if name in lora_layers):
        m.register_forward_hook(lambda *a: ran.append(a[2].shape[0]))
    x = inputs_for(head.hf_class, mixed)
    got, want = model(**x), plain(**x)
    assert ran == [1] * 4  # each LoRA layer ran once, on the packed row
    assert_outputs_match(got, want, x["attention_mask"])
    got.loss.backward()
    want.loss.backward()
    grads = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), plain.parameters()) if p.requires_grad]
    assert grads and all("lora_" in n or "classifier" in n for n, _, _ in grads)
    for name, g, h in grads:
        assert (g - h).abs().max().item() <= ATOL, name


def test_hooks_run_on_a_kernelized_model(debug_config, mixed):
    """A forward hook on a layer's Wi (scaling its output) and on the embeddings' nn.Dropout: both run, and the outputs
    are those of the plain model with the same hooks within 1e-5 (the control: without the hook they differ)."""
    torch.manual_seed(0)
    untouched = BertImplModel(debug_config()).eval()
    plain, model = copy.deepcopy(untouched), kernelize(copy.deepcopy(untouched), "unpadded")
    seen = []
    for m in (plain, model):
        m.layers[0].mlp.Wi.register_forward_hook(lambda module, args, out: out * 1.5)
        m.embeddings.dropout.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    ids, mask, _ = mixed
    with torch.no_grad():
        got, want, other = (m(ids, attention_mask=mask) for m in (model, plain, untouched))
    assert seen == [(BATCH, SEQ, 32)] * 2
    assert_outputs_match(got, want, mask)
    assert (other.last_hidden_state - want.last_hidden_state).abs().max().item() > 1e-3


# ---------------------------------------------------------------------------------------------------------------------
# torch.compile


def test_torch_compile_runs_the_plain_path_and_warns_once(debug_config, mixed):
    """torch.compile (eager backend: the capture is what matters) of a kernelized model: the plain model's outputs on
    the padded batch within 1e-5, and one UserWarning naming torch.compile over two calls."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = kernelize(BertImplModel(debug_config()).eval(), "unpadded")
    compiled = torch.compile(model, backend="eager")
    ids, mask, _ = mixed
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("default")
        got = [compiled(ids, attention_mask=mask) for _ in range(2)]
        want = plain_copy(model)(ids, attention_mask=mask)
    torch._dynamo.reset()
    ours = [w for w in caught if issubclass(w.category, UserWarning) and "hf_bert_impl" in str(w.message)]
    assert len(ours) == 1 and "torch.compile" in str(ours[0].message), [str(w.message) for w in caught]
    for out in got:
        assert_outputs_match(out, want, mask)


@pytest.mark.parametrize("speed", ["plain", "kernelized"])
def test_torch_compile_fullgraph(debug_config, mixed, speed):
    """fullgraph=True (a graph break is an error), as tests/test_cuda.py compiles the scripts' model: the kernelized
    model compiles as the plain one does (the control) and gives the plain model's outputs."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BertImplForMaskedLM(debug_config()).eval()
    if speed == "kernelized":
        kernelize(model)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    ids, mask, _ = mixed
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got, want = compiled(ids, attention_mask=mask), plain_copy(model)(ids, attention_mask=mask)
    torch._dynamo.reset()
    assert_outputs_match(got, want, mask)
