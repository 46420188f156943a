"""The Hub files under other transformers releases: 4.57.6 (the last v4), 5.0.0 (the first v5)
and this venv's own 5.x.

Each version is a side install (`bash scripts/test.sh` puts it under `.venv-compat/`) used through
PYTHONPATH in a fresh Python where `import hf_bert_impl` is impossible, with this venv's torch. One
subprocess per version does every check (start-up dominates):
  1. every head saved by the package loads by trust_remote_code and gives the package's outputs
     (<= 1e-6) on a padded batch, with and without output_attentions;
  2. Trainer runs a few steps, and 4 accumulated micro-batches of 2 give the weights of batches of 8
     (masked LM, whose loss takes num_items_in_batch, and sequence classification, a mean loss);
  3. the trained model saved under that version loads in the package (this venv's transformers) and
     gives the outputs that version computed.
An older transformers (4.56.2) must get one ImportError naming the version needed.
"""

import json
import os

import pytest
import torch

from hf_bert_impl import HEADS as AUTO_HEADS
from hf_bert_impl import (
    BertImplForMaskedLM,
    BertImplForMultipleChoice,
    BertImplForQuestionAnswering,
    BertImplForSequenceClassification,
    BertImplModel,
)

from .conftest import REPO_ROOT, run_without_package

COMPAT_DIR = REPO_ROOT / ".venv-compat"
# version -> the side-install folder (scripts/setup_env.sh); None: this venv's own transformers.
VERSIONS = {"4.57.6": "transformers-4.57.6", "5.0.0": "transformers-5.0.0", "venv": None}
HEADS = [(cls, auto.__name__) for auto, cls in AUTO_HEADS.items()]  # every head, with the Auto class that loads it
TOL = 1e-6

CHILD = r"""
import json, sys, torch, transformers
from transformers import Trainer, TrainingArguments
torch.set_num_threads(1)
job = json.load(open({job!r}))
report = {{"transformers": transformers.__version__, "file": transformers.__file__}}

def flat(out):  # ModelOutput -> {{name: tensor}}, tuples (hidden_states, attentions) numbered
    res = {{}}
    for k, v in out.items():
        if torch.is_tensor(v):
            res[k] = v
        elif isinstance(v, tuple):
            res.update({{f"{{k}}.{{i}}": t for i, t in enumerate(v)}})
    return res

inputs = torch.load(job["inputs"])
for auto, path in job["heads"]:
    model = getattr(transformers, auto).from_pretrained(path, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    x = inputs["mc"] if auto == "AutoModelForMultipleChoice" else inputs["plain"]
    with torch.no_grad():
        got = {{**flat(model(**x)), **{{"att:" + k: v for k, v in flat(model(**x, output_attentions=True, output_hidden_states=True)).items()}}}}
    torch.save(got, job["out"] + f"/{{auto}}.pt")

class ListData(torch.utils.data.Dataset):
    def __init__(self, rows): self.rows = rows
    def __len__(self): return len(self.rows)
    def __getitem__(self, i): return self.rows[i]

def train(auto, path, rows, batch, accum, out_dir):
    torch.manual_seed(0)
    model = getattr(transformers, auto).from_pretrained(path, trust_remote_code=True)
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=accum, max_steps=2,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, report_to=[],
        save_strategy="no", logging_steps=1, use_cpu=True, seed=0, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=ListData(rows))
    trainer.train()
    return trainer.model

for auto, path, rows_file in job["train"]:
    rows = torch.load(rows_file)
    big = train(auto, path, rows, 8, 1, job["out"] + "/t1")
    small = train(auto, path, rows, 2, 4, job["out"] + "/t2")
    start = getattr(transformers, auto).from_pretrained(path, trust_remote_code=True).state_dict()
    moved = max((big.state_dict()[k] - start[k]).abs().max().item() for k in start)
    diff = max((big.state_dict()[k] - small.state_dict()[k]).abs().max().item() for k in start)
    report[auto + ":accum_diff"], report[auto + ":moved"] = diff, moved
    saved = job["out"] + f"/saved-{{auto}}"
    small.save_pretrained(saved)
    small.eval()
    with torch.no_grad():
        torch.save(flat(small(**inputs["plain"])), saved + "/outputs.pt")
print(json.dumps(report))
"""


def _side_install(version):
    folder = VERSIONS[version]
    if folder is None:
        return {}
    path = COMPAT_DIR / folder
    if not (path / "transformers" / "__init__.py").is_file():
        pytest.fail(f"{path} is missing: run `bash scripts/test.sh` (or `WITH_COMPAT=1 bash scripts/setup_env.sh`): it makes the side installs")
    return {"PYTHONPATH": str(path)}


def _mlm_rows(vocab, n=16, seq=7):
    g = torch.Generator().manual_seed(7)
    rows = []
    for i in range(n):
        length = seq - i % 3
        ids = torch.randint(1, vocab, (seq,), generator=g)
        mask = (torch.arange(seq) < length).long()
        labels = torch.full((seq,), -100)
        k = 1 + i % 3  # micro-batches hold different numbers of masked tokens: the case that needs num_items_in_batch
        labels[:k] = ids[:k]
        rows.append(dict(input_ids=ids * mask, attention_mask=mask, labels=labels))
    return rows


@pytest.mark.parametrize("version", list(VERSIONS))
def test_remote_code_under_transformers_version(version, debug_config, batch, tmp_path):
    env = _side_install(version)
    input_ids, attention_mask, token_type_ids = batch
    plain = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    mc = {k: v[:12].reshape(4, 3, -1) for k, v in plain.items()}  # (b, c, s) for multiple choice
    torch.save({"plain": plain, "mc": mc}, tmp_path / "inputs.pt")
    torch.manual_seed(0)
    models, heads = {}, []
    for cls, auto in HEADS:
        model = cls(debug_config(num_labels=2 if cls is BertImplForQuestionAnswering else 3)).eval()
        model.save_pretrained(tmp_path / cls.__name__)
        models[auto] = model
        heads.append([auto, str(tmp_path / cls.__name__)])
    rows = _mlm_rows(debug_config().vocab_size)
    torch.save(rows, tmp_path / "mlm.pt")
    torch.save([dict(r, labels=torch.tensor(i % 3)) for i, r in enumerate(rows)], tmp_path / "cls.pt")
    train = [
        ["AutoModelForMaskedLM", str(tmp_path / "BertImplForMaskedLM"), str(tmp_path / "mlm.pt")],
        ["AutoModelForSequenceClassification", str(tmp_path / "BertImplForSequenceClassification"), str(tmp_path / "cls.pt")],
    ]
    (tmp_path / "out").mkdir()
    job = dict(inputs=str(tmp_path / "inputs.pt"), heads=heads, train=train, out=str(tmp_path / "out"))
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = run_without_package(
        CHILD.format(job=str(tmp_path / "job.json")), cwd=tmp_path, timeout=600,
        env_extra={"HF_HOME": str(tmp_path / "hf_home"), "OMP_NUM_THREADS": "1", **env},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    import transformers

    expected = transformers.__version__ if version == "venv" else version
    assert report["transformers"] == expected, report
    if env:
        assert report["file"].startswith(env["PYTHONPATH"]), report["file"]

    # 1. every head, both attention paths, equals the package
    worst = 0.0
    for cls, auto in HEADS:
        x = mc if cls is BertImplForMultipleChoice else plain
        got = torch.load(tmp_path / "out" / f"{auto}.pt")
        with torch.no_grad():
            want = models[auto](**x)
            want_att = models[auto](**x, output_attentions=True, output_hidden_states=True)
        want = {**_flat(want), **{"att:" + k: v for k, v in _flat(want_att).items()}}
        assert sorted(got) == sorted(want), (auto, sorted(got), sorted(want))
        assert any(k.startswith("att:attentions.") for k in want)
        for key in want:
            diff = (got[key] - want[key]).abs().max().item()
            worst = max(worst, diff)
            assert diff <= TOL, f"{auto} {key}: max|Δ| {diff:.2e} under transformers {version}"
    print(f"\ntransformers {report['transformers']}: 8 heads, max|Δ| vs package {worst:.2e}")

    # 2. Trainer: gradient accumulation exact, and the weights really moved
    for auto, *_ in train:
        assert report[auto + ":moved"] > 1e-3, report
        assert report[auto + ":accum_diff"] <= TOL, (auto, report)
        print(f"  {auto}: 2 steps, 8x1 vs 2x4 accumulated max|Δw| {report[auto + ':accum_diff']:.2e}")

    # 3. saved under that version -> loads in the package (this venv's transformers), same outputs
    for cls, auto in ((BertImplForMaskedLM, "AutoModelForMaskedLM"), (BertImplForSequenceClassification, "AutoModelForSequenceClassification")):
        saved = tmp_path / "out" / f"saved-{auto}"
        assert json.loads((saved / "config.json").read_text())["model_type"] == "bert_impl"
        model = cls.from_pretrained(saved).eval()
        assert type(model).__module__ == "hf_bert_impl.modeling_bert_impl"
        with torch.no_grad():
            now = _flat(model(**plain))
        then = torch.load(saved / "outputs.pt")
        for key in then:
            assert (now[key] - then[key]).abs().max().item() <= TOL, (auto, key)


def _flat(out):
    res = {}
    for k, v in out.items():
        if torch.is_tensor(v):
            res[k] = v
        elif isinstance(v, tuple):
            res.update({f"{k}.{i}": t for i, t in enumerate(v)})
    return res


def test_too_old_transformers_gets_one_clear_error(debug_config, tmp_path):
    """transformers 4.56.2 (side install, with 4.57.6's huggingface_hub / tokenizers behind it) loading
    our checkpoint: one ImportError that names the version needed."""
    old = COMPAT_DIR / "transformers-4.56.2"
    if not (old / "transformers" / "__init__.py").is_file():
        pytest.fail(f"{old} is missing: run `bash scripts/test.sh` (or `WITH_COMPAT=1 bash scripts/setup_env.sh`)")
    env = {"PYTHONPATH": os.pathsep.join([str(old), str(COMPAT_DIR / "transformers-4.57.6")])}
    BertImplModel(debug_config()).save_pretrained(tmp_path / "model")
    code = (
        "import transformers\n"
        "print(transformers.__version__)\n"
        f"transformers.AutoModel.from_pretrained({str(tmp_path / 'model')!r}, trust_remote_code=True)\n"
    )
    proc = run_without_package(code, cwd=tmp_path, env_extra={"HF_HOME": str(tmp_path / "hf_home"), **env})
    assert proc.stdout.strip() == "4.56.2", proc.stdout + proc.stderr[-2000:]
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: this bert_impl model needs transformers>=4.57.0"), proc.stderr[-2000:]
    assert "transformers 4.56.2 is installed" in last


def test_package_checks_the_same_floor():
    from hf_bert_impl.configuration_bert_impl import MIN_TRANSFORMERS, require_transformers

    assert MIN_TRANSFORMERS == (4, 57, 0)
    require_transformers("4.57.0")
    require_transformers("5.0.0rc1")
    with pytest.raises(ImportError, match=r"needs transformers>=4\.57\.0 .* transformers 4\.56\.2 is installed"):
        require_transformers("4.56.2")
