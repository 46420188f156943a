"""save_pretrained -> a fresh Python in which `import hf_bert_impl` is impossible ->
AutoModelFor*.from_pretrained(dir, trust_remote_code=True) -> identical outputs.

This is what a Hub user without our package gets: the two code files (configuration_bert_impl.py,
modeling_bert_impl.py) copied beside the weights, found through config.json's auto_map: the plain
model, which does no work beyond its arithmetic and whose linears are torch.nn.Linear. One
subprocess per test loads every head it needs (start-up dominates)."""

import json

import torch

from hf_bert_impl import BertImplForMaskedLM, BertImplForSequenceClassification, BertImplModel

from .conftest import run_without_package


CASES = [  # (our class, the Auto class a user calls, the output compared)
    (BertImplModel, "AutoModel", "last_hidden_state"),
    (BertImplForMaskedLM, "AutoModelForMaskedLM", "logits"),
    (BertImplForSequenceClassification, "AutoModelForSequenceClassification", "logits"),
]

LOADER = r"""
import json, sys, torch
import transformers
cases = {cases}
inputs = torch.load({inputs!r})
report = {{}}
for auto, path, out_path in cases:
    model = getattr(transformers, auto).from_pretrained(path, trust_remote_code=True).eval()
    module = type(model).__module__
    assert module.startswith("transformers_modules"), module   # the copied file, not a package
    with torch.no_grad():
        out = model(**inputs)
    torch.save({{k: v for k, v in out.items()}}, out_path)
    report[auto] = type(model).__name__
print(json.dumps(report))
"""


def test_trust_remote_code_load_without_package(debug_config, batch, tmp_path):
    input_ids, attention_mask, token_type_ids = batch
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
    torch.save(inputs, tmp_path / "inputs.pt")
    torch.manual_seed(0)
    models, cases = {}, []
    for cls, auto, _ in CASES:
        model = cls(debug_config(num_labels=3)).eval()
        save_dir = tmp_path / cls.__name__
        model.save_pretrained(save_dir)
        config = json.loads((save_dir / "config.json").read_text())
        assert config["model_type"] == "bert_impl"
        assert config["auto_map"][auto] == f"modeling_bert_impl.{cls.__name__}"
        models[auto] = model
        cases.append([auto, str(save_dir), str(tmp_path / f"{auto}.pt")])
    code = LOADER.format(cases=json.dumps(cases), inputs=str(tmp_path / "inputs.pt"))
    proc = run_without_package(code, cwd=tmp_path, env_extra={"HF_HOME": str(tmp_path / "hf_home")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for cls, auto, key in CASES:
        assert report[auto] == cls.__name__
        with torch.no_grad():
            want = models[auto](**inputs)
        got = torch.load(tmp_path / f"{auto}.pt")
        assert torch.equal(got[key], want[key]), auto  # same code, weights and machine: bit-identical


def test_package_is_really_blocked_in_subprocess(tmp_path):
    proc = run_without_package("import hf_bert_impl", cwd=tmp_path)
    assert proc.returncode != 0 and "hf_bert_impl is blocked" in proc.stderr


# ----------------------------------------------------------------------------------------------
# The Hub files do no work beyond the model's arithmetic: no file I/O, locks, environment reads, process probes or
# imports beyond torch / transformers / each other, at import, at load and in forward (design: "Remote code").

AUDIT = r"""
import json, os, sys, sysconfig
import torch, transformers

HUB_FILES = {hub_files}
STDLIB = tuple({{sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}})
# What a remote-code reviewer flags, as audit events (docs.python.org/3/library/audit_events.html); "import" is checked
# apart (the Hub files may import torch, transformers and each other).
WATCHED = ("open", "os.listdir", "os.scandir", "os.mkdir", "os.remove", "os.rename", "os.rmdir", "os.chmod",
           "os.truncate", "os.link", "os.symlink", "os.utime", "os.putenv", "os.unsetenv", "os.system",
           "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.kill", "shutil.", "fcntl.", "subprocess.",
           "socket.", "ctypes.", "urllib.", "tempfile.", "glob.", "import")
records, phase, busy = [], ["load"], [False]


def is_hub(filename):  # the copies transformers made of the Hub files (HF_MODULES_CACHE/transformers_modules/...)
    return "transformers_modules" in filename and os.path.basename(filename) in HUB_FILES


def culprit(frame):
    # Who asked: the first frame that is neither the standard library nor this script. `importing`: the import system
    # ran in between (it lists folders and reads a module's .py / .pyc: loading code, not work done by that code).
    importing = False
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith("<frozen importlib"):
            importing = True
        elif filename != "<string>" and not filename.startswith("<frozen") and \
                not (filename.startswith(STDLIB) and "-packages" not in filename):
            return filename, importing
        frame = frame.f_back
    return None, importing


def note(event, detail, frame):
    if busy[0]:
        return
    busy[0] = True
    try:
        by, importing = culprit(frame)
        if not (event in ("open", "os.listdir", "os.scandir") and importing):
            records.append(dict(phase=phase[0], event=event, detail=str(detail)[:200], hub=bool(by and is_hub(by)),
                                by=by))
    finally:
        busy[0] = False


def audit(event, args):
    if event.startswith(WATCHED):
        note(event, args[0] if args else "", sys._getframe(1))


class Environ(type(os.environ)):  # os.environ that records each read (os.getenv reads through it too)
    def __getitem__(self, key):
        note("os.environ", key, sys._getframe(1))
        return super().__getitem__(key)

    def __iter__(self):
        note("os.environ", "*", sys._getframe(1))
        return super().__iter__()


env = os.environ
os.environ = Environ(env._data, env.encodekey, env.decodekey, env.encodevalue, env.decodevalue)
sys.addaudithook(audit)

job = json.loads({job!r})
os.getenv("HF_BERT_IMPL_AUDIT_PROBE")  # controls: an environment read and a file opened (by torch) are recorded
inputs = torch.load(job["inputs"])
models = {{}}
for auto, path in job["models"]:  # config + model classes imported from the copied files, built, weights loaded
    models[auto] = getattr(transformers, auto).from_pretrained(path, trust_remote_code=True)
    assert type(models[auto]).__module__.startswith("transformers_modules"), type(models[auto]).__module__


def set_mode(model, training):  # train() / eval() as phase "mode": transformers >= 5.25 reads USE_HUB_KERNELS there
    current, phase[0] = phase[0], "mode"
    model.train(training)
    phase[0] = current


def forwards():  # inference (sdpa; output_attentions: eager), then training with dropout: loss and backward
    for auto, model in models.items():
        x = {{k: v for k, v in inputs.items() if k != "labels" or auto == "AutoModelForMaskedLM"}}
        set_mode(model, False)
        with torch.no_grad():
            model(**x)
            model(**x, output_attentions=True, output_hidden_states=True)
        set_mode(model, True)
        out = model(**x)
        (out.loss if out.get("loss") is not None else out[0].float().square().mean()).backward()
        model.zero_grad(set_to_none=True)


for phase[0] in ("forward", "forward_again"):
    forwards()
sys.stdout.write(json.dumps(records) + "\n")
"""


def test_the_hub_files_do_no_work_at_import_load_or_forward(debug_config, batch, tmp_path):
    """Models saved by the package, loaded by trust_remote_code in a Python without it, under an audit hook
    (sys.addaudithook) and an os.environ that records reads: importing the two Hub files, building the models, loading
    their weights, and forwards (inference on SDPA and eager, training with dropout and backward) trigger no file
    access, lock, environment read, process, socket or import of anything but torch / transformers / each other from
    a line of those files (the first frame outside the standard library decides). A second round of the same
    forwards triggers none of these events from anyone (torch and transformers included); the train() / eval()
    switches between them are their own phase (transformers' own, which from 5.25 on reads USE_HUB_KERNELS there,
    for BertModel as for ours), still held to the rule for the Hub files' lines. (tests/test_lint.py reads
    the sources: it also catches a `from os import environ`, which the spy cannot see.)"""
    from hf_bert_impl.hub import CODE_FILES

    assert CODE_FILES == ("configuration_bert_impl.py", "modeling_bert_impl.py")
    input_ids, attention_mask, token_type_ids = batch
    labels = torch.where(attention_mask.bool() & (torch.arange(input_ids.size(1)) % 3 == 0), input_ids, -100)
    torch.save(
        {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids, "labels": labels},
        tmp_path / "inputs.pt",
    )
    torch.manual_seed(0)
    saved = []
    for cls, auto, _ in CASES:
        model = cls(debug_config(num_labels=3, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))
        model.save_pretrained(tmp_path / cls.__name__)
        assert sorted(p.name for p in (tmp_path / cls.__name__).glob("*.py")) == sorted(CODE_FILES)
        saved.append([auto, str(tmp_path / cls.__name__)])
    job = json.dumps({"inputs": str(tmp_path / "inputs.pt"), "models": saved})
    code = AUDIT.format(hub_files=repr(set(CODE_FILES)), job=job)
    proc = run_without_package(code, cwd=tmp_path, env_extra={"HF_HOME": str(tmp_path / "hf_home")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout.strip().splitlines()[-1])

    hub = [r for r in records if r["hub"]]
    imports = [r for r in hub if r["event"] == "import"]
    allowed = ("torch", "transformers", "typing", "re", "transformers_modules")
    assert all(r["phase"] == "load" and r["detail"].split(".")[0] in allowed for r in imports), imports
    assert any(r["detail"].endswith(".configuration_bert_impl") for r in imports), "control: the audit sees imports"
    work = [r for r in hub if r["event"] != "import"]
    assert work == [], work
    again = [r for r in records if r["phase"] == "forward_again"]
    assert again == [], again
    # controls: the spy and the hook record what they should (the child's own probes), with the culprit's file
    assert any(r["event"] == "os.environ" and r["detail"] == "HF_BERT_IMPL_AUDIT_PROBE" for r in records), records[:9]
    opened = [r for r in records if r["event"] == "open" and r["detail"] == str(tmp_path / "inputs.pt")]
    assert opened and opened[0]["by"].endswith("serialization.py"), opened
    print(f"\n{len(records)} audited events, {len(imports)} imports by the Hub files, none of the rest from them")


PLAIN = r"""
import json, sys, torch, transformers
from torch import nn
job = json.loads({job!r})
inputs = torch.load(job["inputs"])
report = {{}}
for auto, path in job["models"]:
    model = getattr(transformers, auto).from_pretrained(path, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    linears = {{n: type(m).__module__ + "." + type(m).__qualname__ for n, m in model.named_modules()
               if isinstance(m, nn.Linear)}}
    # any module holding a matrix: a linear (exactly nn.Linear) or an embedding table, nothing home-made
    matrices = {{n: type(m).__module__ + "." + type(m).__qualname__ for n, m in model.named_modules()
                if any(p.dim() == 2 for p in m.parameters(recurse=False)) and not isinstance(m, nn.Embedding)}}
    quantized = torch.ao.quantization.quantize_dynamic(model, {{nn.Linear}}, dtype=torch.qint8)
    qlinear = torch.ao.nn.quantized.dynamic.Linear
    done = sorted(n for n, m in quantized.named_modules() if type(m) is qlinear)
    left = sorted(n for n, m in quantized.named_modules() if isinstance(m, nn.Linear))
    entry = dict(linears=linears, matrices=matrices, quantized=done, left=left)
    x = inputs["mc" if auto == "AutoModelForMultipleChoice" else "plain"]
    with torch.no_grad():  # the first output: hidden states, logits, prediction or start logits
        entry["float_vs_quantized"] = (model(**x)[0] - quantized(**x)[0]).abs().max().item()
    report[auto] = entry
print(json.dumps(report))
"""


def test_remote_code_model_is_the_plain_model_and_quantizes(debug_config, batch, tmp_path):
    """Every head saved by the package and loaded by trust_remote_code without it: each module that holds a matrix
        (embedding tables aside) is exactly torch.nn.Linear, the linears are the package model's, and
        torch.ao.quantization.quantize_dynamic({nn.Linear}) replaces every one of them by its dynamic int8 Linear (none
        left in float); the quantized model runs, and differs from the float one (the int8 GEMMs ran) by less than 1 (a
    sanity bound: a wrongly quantized layer is far off). Control:
        transformers' BertModel at the same weights (to_hf_bert) has the same number of linear weight elements."""
    from torch import nn

    from hf_bert_impl import HEADS, BertImplForQuestionAnswering
    from hf_bert_impl.convert import to_hf_bert

    input_ids, attention_mask, token_type_ids = batch
    plain = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
    mc = {k: v[:12].reshape(4, 3, -1) for k, v in plain.items()}  # (b, c, s) for multiple choice
    torch.save({"plain": plain, "mc": mc}, tmp_path / "inputs.pt")
    torch.manual_seed(0)
    saved, ours = [], {}
    for auto, cls in HEADS.items():
        model = cls(debug_config(num_labels=2 if cls is BertImplForQuestionAnswering else 3))
        model.save_pretrained(tmp_path / cls.__name__)
        saved.append([auto.__name__, str(tmp_path / cls.__name__)])
        ours[auto.__name__] = model
    job = json.dumps({"inputs": str(tmp_path / "inputs.pt"), "models": saved})
    proc = run_without_package(PLAIN.format(job=job), cwd=tmp_path, env_extra={"HF_HOME": str(tmp_path / "hf_home")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(report) == sorted(ours)
    for auto, r in report.items():
        want = sorted(n for n, m in ours[auto].named_modules() if type(m) is nn.Linear)
        assert len(want) >= 2 * 4, (auto, want)  # 2 layers x (Wqkv, Wo, Wi, Wo) at least
        assert sorted(r["linears"]) == want, auto
        assert set(r["linears"].values()) == {"torch.nn.modules.linear.Linear"}, (auto, r["linears"])
        assert r["matrices"] == r["linears"], (auto, r["matrices"])
        assert r["quantized"] == want and r["left"] == [], (auto, r["quantized"], r["left"])
        assert 0 < r["float_vs_quantized"] < 1.0, (auto, r["float_vs_quantized"])
    print(
        "\nquantized linears per head (max |float - int8| of the first output): "
        + ", ".join(f"{a}: {len(r['quantized'])} ({r['float_vs_quantized']:.1e})" for a, r in report.items())
    )

    base = ours["AutoModel"]  # control: transformers' BertModel, the same weights, the same linear weights in total
    hf = to_hf_bert(base)
    elements = lambda m: sum(x.weight.numel() for x in m.modules() if type(x) is nn.Linear)  # noqa: E731
    assert elements(hf) == elements(base) > 0
