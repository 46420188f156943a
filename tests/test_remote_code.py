"""save_pretrained -> a fresh Python in which `import hf_bert_impl` is impossible ->
AutoModelFor*.from_pretrained(dir, trust_remote_code=True) -> identical outputs.

This is what a Hub user without our package gets: the code files copied beside the weights,
found through config.json's auto_map. One subprocess loads all three heads (start-up dominates)."""

import json

import torch

from hf_bert_impl import BertImplForMaskedLM, BertImplForSequenceClassification, BertImplModel

from .conftest import REPO_ROOT, run_without_package

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
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
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


IMPORT_AUDIT = r"""
import importlib, json, sys, torch, transformers
from torch.utils._python_dispatch import TorchDispatchMode
for name in ("modeling_utils", "masking_utils", "activations", "modeling_layers", "modeling_outputs", "initialization",
             "models.bert.modeling_bert", "utils.output_capturing", "utils.generic"):  # transformers' own imports first
    try:
        importlib.import_module("transformers." + name)
    except ImportError:
        pass

opened, ops = [], []
class Ops(TorchDispatchMode):  # every aten / mkldnn op that runs
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ops.append(str(func))
        return func(*args, **(kwargs or {}))

def audit(event, args):
    if event == "open" and args[0] is not None:
        opened.append(str(args[0]))
sys.addaudithook(audit)
with Ops():
    import hubfiles.modeling_bert_impl as m
code = [p for p in opened if not p.endswith((".py", ".pyc", ".so")) and p not in sys.path]  # but module loading
print(json.dumps({"ops": ops, "other_files": code, "classes": len(m.__all__)}))
"""


def test_importing_the_hub_files_does_no_work(tmp_path):
    """The four files a checkpoint carries, imported as a package of their own (no hf_bert_impl): no tensor operation
    (no GEMM, no probe) and no file opened but the modules themselves."""
    from hf_bert_impl.hub import CODE_FILES

    package = tmp_path / "hubfiles"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in CODE_FILES:
        (package / name).write_text((REPO_ROOT / "hf_bert_impl" / name).read_text())
    proc = run_without_package(f"sys.path.insert(0, {str(tmp_path)!r})\n" + IMPORT_AUDIT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ops"] == [] and report["other_files"] == [], report
    sources = "\n".join((package / name).read_text() for name in CODE_FILES)
    for flagged in ("ctypes", "/proc", "subprocess", "socket", "urllib", "cpuinfo"):
        assert flagged not in sources, flagged
