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
  4. 4.57.6 and 5.0.0 only (PACKAGE_PART, in the same subprocess, after the checks above): the package
     itself (pyproject: transformers>=4.57,<6) with the huggingface_hub, tokenizers and datasets of that
     release, now importable. scripts/pretrain_mlm.py, scripts/finetune.py and scripts/convert_checkpoint.py
     run through their main(argv), then the model-card rendering and the push's dry run (hf_bert_impl.hub)
     and the whole-word-masking collator (hf_bert_impl.compat); this process checks what they wrote.
An older transformers (4.56.2) must get one ImportError naming the version needed.
"""

import functools
import json
import math
import os
import time

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
from hf_bert_impl.hub import CODE_FILES

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
        verbose = flat(model(**x, output_attentions=True, output_hidden_states=True))
        got = {{**flat(model(**x)), **{{"att:" + k: v for k, v in verbose.items()}}}}
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
        pytest.fail(
            f"{path} is missing: run `bash scripts/test.sh` (or `WITH_COMPAT=1 bash scripts/setup_env.sh`): "
            "it makes the side installs"
        )
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
        rows.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("version", list(VERSIONS))
def test_remote_code_under_transformers_version(version, debug_config, batch, minilm_dir, tmp_path):
    env = _side_install(version)
    input_ids, attention_mask, token_type_ids = batch
    plain = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
    mc = {k: v[:12].reshape(4, 3, -1) for k, v in plain.items()}  # (b, c, s) for multiple choice
    torch.save({"plain": plain, "mc": mc}, tmp_path / "inputs.pt")
    torch.manual_seed(0)
    models, heads = {}, []
    for cls, auto in HEADS:
        model = cls(debug_config(num_labels=2 if cls is BertImplForQuestionAnswering else 3)).eval()
        model.save_pretrained(tmp_path / cls.__name__)
        assert sorted(p.name for p in (tmp_path / cls.__name__).glob("*.py")) == sorted(CODE_FILES)  # the Hub files
        models[auto] = model
        heads.append([auto, str(tmp_path / cls.__name__)])
    rows = _mlm_rows(debug_config().vocab_size)
    torch.save(rows, tmp_path / "mlm.pt")
    torch.save([dict(r, labels=torch.tensor(i % 3)) for i, r in enumerate(rows)], tmp_path / "cls.pt")
    train = [
        ["AutoModelForMaskedLM", str(tmp_path / "BertImplForMaskedLM"), str(tmp_path / "mlm.pt")],
        [
            "AutoModelForSequenceClassification",
            str(tmp_path / "BertImplForSequenceClassification"),
            str(tmp_path / "cls.pt"),
        ],
    ]
    (tmp_path / "out").mkdir()
    job = {"inputs": str(tmp_path / "inputs.pt"), "heads": heads, "train": train, "out": str(tmp_path / "out")}
    code = CHILD.format(job=str(tmp_path / "job.json"))
    if version in PACKAGE_VERSIONS:  # part 2: the package's scripts, in the same interpreter
        (tmp_path / "pkg").mkdir()
        job["package"] = {
            "out": str(tmp_path / "pkg"),
            "repo": str(REPO_ROOT),
            "minilm": str(minilm_dir),
            "texts": PROBE_TEXTS,
        }
        code += PACKAGE_PART
    (tmp_path / "job.json").write_text(json.dumps(job))
    started = time.time()
    proc = run_without_package(
        code,
        cwd=tmp_path,
        timeout=600,
        env_extra={
            "HF_HOME": str(tmp_path / "hf_home"),
            "OMP_NUM_THREADS": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
            **env,
        },
    )
    wall = time.time() - started
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
    for cls, auto in (
        (BertImplForMaskedLM, "AutoModelForMaskedLM"),
        (BertImplForSequenceClassification, "AutoModelForSequenceClassification"),
    ):
        saved = tmp_path / "out" / f"saved-{auto}"
        assert json.loads((saved / "config.json").read_text())["model_type"] == "bert_impl"
        model = cls.from_pretrained(saved).eval()
        assert type(model).__module__ == "hf_bert_impl.modeling_bert_impl"
        with torch.no_grad():
            now = _flat(model(**plain))
        then = torch.load(saved / "outputs.pt")
        for key in then:
            assert (now[key] - then[key]).abs().max().item() <= TOL, (auto, key)

    # 4. the package itself under that version (part 2)
    if version in PACKAGE_VERSIONS:
        _check_package_run(version, env, tmp_path / "pkg", wall)
    else:
        print(f"  subprocess {wall:.1f} s")


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


# ----------------------------------------------------------------------------------------------
# The package (scripts, conversion, Hub helpers) under 4.57.6 and 5.0.0: part 2 of the same subprocess

PACKAGE_VERSIONS = ["4.57.6", "5.0.0"]  # this venv's 5.x: tests/test_scripts.py, test_convert.py, test_hub.py
CONVERT_TOL = 1e-5  # the conversion's float32 tolerance (tests/test_convert.py)
PROBE_TEXTS = [
    "The with statement is used to wrap the execution of a block.",
    "An assignment statement evaluates the expression list and assigns the single resulting object.",
]

# Appended to CHILD for the PACKAGE_VERSIONS, so that a version costs one interpreter start. It unblocks
# hf_bert_impl and puts the repository first on sys.path, then runs the scripts through their main(argv).
# Everything it finds goes into job["package"]["out"]/report.json; tensors into *.pt files beside it.
PACKAGE_PART = r"""
# ---- part 2: the package itself, importable from here on (part 1 above ran with hf_bert_impl blocked)
import importlib.util, math, time
from pathlib import Path
start = time.time()
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_Block"]  # conftest.run_without_package's blocker
sys.path.insert(0, job["package"]["repo"])
sys.stdout = sys.stderr  # the scripts print their metrics; the last line of stdout stays part 1's report
job = job["package"]
out, repo = Path(job["out"]), Path(job["repo"])
import datasets, huggingface_hub, tokenizers
mods = (transformers, huggingface_hub, tokenizers, datasets)
report = {"versions": {m.__name__: m.__version__ for m in mods}, "files": {m.__name__: m.__file__ for m in mods}}
import hf_bert_impl
from hf_bert_impl import BertImplModel, compat, hub
report["package"] = hf_bert_impl.__file__
from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer, BertModel

def script(name):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", repo / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

pretrain, finetune, convert = script("pretrain_mlm"), script("finetune"), script("convert_checkpoint")
FAST = ["--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--logging_steps", "1", "--seed", "5",
        "--save_strategy", "no"]
report["import_s"] = time.time() - start  # the package and the scripts; torch and transformers came in part 1

def losses(run_dir):
    state = json.loads((run_dir / "trainer_state.json").read_text())
    return state["global_step"], [h["loss"] for h in state["log_history"] if "loss" in h]

# 1. pretraining: the embedded corpus, a WordPiece tokenizer trained on it, debug size, whole-word masking, a time
#    budget (its schedule and callback; --max_steps 3 ends the run first), evaluation
t = time.time()
metrics = pretrain.main(["--output_dir", str(out / "mlm"), "--model_size", "debug", "--tokenizer_vocab_size", "300",
                         "--max_seq_length", "32", "--max_steps", "3", "--per_device_train_batch_size", "4",
                         "--max_eval_samples", "8", "--whole_word_mask", "--time_budget", "5", *FAST])
steps, train_losses = losses(out / "mlm")
report["pretrain"] = {"metrics": metrics, "steps": steps, "losses": train_losses, "s": time.time() - t}
tokenizer = AutoTokenizer.from_pretrained(out / "mlm")
model = AutoModelForMaskedLM.from_pretrained(out / "mlm").eval()
enc = tokenizer(job["texts"], padding=True, return_tensors="pt")
with torch.no_grad():
    torch.save({"input_ids": enc["input_ids"], "logits": model(**enc).logits}, out / "mlm_reloaded.pt")
report["mlm_class"] = type(model).__module__ + "." + type(model).__name__

# 2. whole-word masking (compat.language_modeling_collator), seeded, on the trained tokenizer
enc = tokenizer(job["texts"][0], return_offsets_mapping=True, return_special_tokens_mask=True)
collator = compat.language_modeling_collator(tokenizer, mlm_probability=0.5, whole_word_mask=True, seed=3)
batch = collator([dict(enc)])
report["wwm"] = {"input_ids": batch["input_ids"][0].tolist(), "labels": batch["labels"][0].tolist(),
                 "offsets": [list(o) for o in enc["offset_mapping"]], "original": enc["input_ids"],
                 "mask_id": tokenizer.mask_token_id}

# 3. fine-tuning the pretrained model on the embedded statement-topic task, 2 steps, validation + test
t = time.time()
metrics = finetune.main(["--model_name_or_path", str(out / "mlm"), "--output_dir", str(out / "cls"),
                         "--max_steps", "2", "--max_train_samples", "32", "--per_device_train_batch_size", "8",
                         "--per_device_eval_batch_size", "64", "--max_seq_length", "32", *FAST])
steps, train_losses = losses(out / "cls")
report["finetune"] = {"metrics": metrics, "steps": steps, "losses": train_losses, "s": time.time() - t}
tokenizer = AutoTokenizer.from_pretrained(out / "cls")
model = AutoModelForSequenceClassification.from_pretrained(out / "cls").eval()
rows = [json.loads(line) for line in (out / "cls" / "predictions.jsonl").read_text().splitlines()[:8]]
enc = tokenizer([r["sentence"] for r in rows], padding=True, truncation=True, return_tensors="pt")
with torch.no_grad():
    torch.save({"sentences": [r["sentence"] for r in rows], "logits": model(**enc).logits}, out / "cls_reloaded.pt")
report["predictions"] = [r["prediction"] for r in rows]

# 4. the model card (rendered by finish_run above), rendered and checked again; the push's dry run and its offline
# refusal
card = hub.build_model_card(out / "cls")
hub.validate_model_card(card, out / "cls")
report["card_same_as_saved"] = str(card) == (out / "cls" / "README.md").read_text(encoding="utf-8")
report["upload"] = hub.push_model_dir(out / "cls", "alice/bert-impl-cls", dry_run=out / "upload")
try:
    hub.push_model_dir(out / "cls", "alice/bert-impl-cls", token="hf_not_a_token")
    report["offline_push"] = "no error"
except ValueError as err:
    report["offline_push"] = str(err)

# 5. conversion both ways through the script: all-MiniLM-L6-v2 -> bert_impl -> transformers BERT
t = time.time()
report["convert_rc"] = [convert.main(["--from-hf", job["minilm"], "--out", str(out / "impl")]),
                        convert.main(["--to-hf", str(out / "impl"), "--out", str(out / "back")])]
tokenizer = AutoTokenizer.from_pretrained(job["minilm"])
enc = tokenizer(job["texts"], padding=True, return_tensors="pt")
keep = enc["attention_mask"].bool()
original = BertModel.from_pretrained(job["minilm"]).eval()
models = {"impl": BertImplModel.from_pretrained(out / "impl").eval(),
          "back": BertModel.from_pretrained(out / "back").eval()}
with torch.no_grad():
    want = original(**enc)
    report["convert"] = {}
    for name, m in models.items():
        got = m(**enc)
        report["convert"][name] = {
            "last_hidden_state": (got.last_hidden_state - want.last_hidden_state)[keep].abs().max().item(),
            "pooler_output": (got.pooler_output - want.pooler_output).abs().max().item(),
        }
state, back = original.state_dict(), models["back"].state_dict()
report["convert_back_exact"] = sorted(k for k in state if k not in back or not torch.equal(state[k], back[k]))
report["convert_s"] = time.time() - t
report["total_s"] = time.time() - start
(out / "report.json").write_text(json.dumps(report))
"""


@functools.lru_cache(maxsize=1)
def _embedded_corpus_tokenizer():
    """The WordPiece tokenizer pretrain_mlm.py trains on the embedded corpus (vocab 300), trained here by
    this venv's transformers (5.x builds it from the vocabulary dict; 4.57 through compat's vocab.txt)."""
    from hf_bert_impl.data import default_corpus_dataset, train_wordpiece_tokenizer

    return train_wordpiece_tokenizer(default_corpus_dataset()["train"]["text"], vocab_size=300)


def _words(offsets):
    """Token positions grouped into words: a token that starts where the previous one ended continues its word."""
    words, end = [], None
    for i, (a, b) in enumerate(offsets):
        if a == b:  # a special token
            end = None
            continue
        if end is not None and a == end:
            words[-1].append(i)
        else:
            words.append([i])
        end = b
    return words


def _check_package_run(version, env, out, wall):
    """pyproject.toml promises transformers>=4.57,<6. Under 4.57.6 (huggingface_hub 0.36) and 5.0.0
    (huggingface_hub 1.3), PACKAGE_PART pretrained and fine-tuned through the scripts: the saved models
    reload here with the outputs that version computed; the card rendered the same twice and parses here;
    the dry-run push wrote the Hub folder; MiniLM converted both ways within 1e-5; whole-word masking
    drew this venv's masks."""
    from huggingface_hub import ModelCard
    from transformers import AutoTokenizer

    from hf_bert_impl import BertImplForMaskedLM, BertImplForSequenceClassification
    from hf_bert_impl.compat import language_modeling_collator

    report = json.loads((out / "report.json").read_text())

    # the versions promised, from the side install; the package from this repository
    hub_version = {"4.57.6": "0.36.0", "5.0.0": "1.3.0"}[version]
    assert report["versions"]["transformers"] == version and report["versions"]["huggingface_hub"] == hub_version, (
        report
    )
    for name, path in report["files"].items():
        assert path.startswith(env["PYTHONPATH"]), (name, path)
    assert report["package"].startswith(str(REPO_ROOT / "hf_bert_impl")), report["package"]

    # 1. pretraining: 3 finite training losses, a finite evaluation; the tokenizer is the one this venv trains
    pre = report["pretrain"]
    assert pre["steps"] == 3 and len(pre["losses"]) == 3 and all(math.isfinite(x) for x in pre["losses"]), pre
    assert math.isfinite(pre["metrics"]["eval_loss"]) and 0.0 <= pre["metrics"]["eval_masked_accuracy"] <= 1.0, pre
    assert math.isclose(pre["metrics"]["perplexity"], math.exp(pre["metrics"]["eval_loss"]), rel_tol=1e-9)
    assert report["mlm_class"] == "hf_bert_impl.modeling_bert_impl.BertImplForMaskedLM"
    tokenizer = AutoTokenizer.from_pretrained(out / "mlm")
    assert tokenizer.get_vocab() == _embedded_corpus_tokenizer().get_vocab()
    then = torch.load(out / "mlm_reloaded.pt")
    enc = tokenizer(PROBE_TEXTS, padding=True, return_tensors="pt")
    assert torch.equal(enc["input_ids"], then["input_ids"])
    with torch.no_grad():
        now = BertImplForMaskedLM.from_pretrained(out / "mlm").eval()(**enc).logits
    assert torch.isfinite(now).all() and (now - then["logits"]).abs().max().item() <= TOL

    # 2. whole-word masking: only [MASK], whole words, and the masks this venv draws from the same seed
    wwm = report["wwm"]
    masked = [i for i, label in enumerate(wwm["labels"]) if label != -100]
    assert masked, wwm
    assert all(wwm["input_ids"][i] == wwm["mask_id"] and wwm["labels"][i] == wwm["original"][i] for i in masked)
    words = _words(wwm["offsets"])
    assert any(len(w) > 1 for w in words)
    assert all(all(i in masked for i in w) or not any(i in masked for i in w) for w in words), (words, masked)
    here = language_modeling_collator(tokenizer, mlm_probability=0.5, whole_word_mask=True, seed=3)(
        [dict(tokenizer(PROBE_TEXTS[0], return_offsets_mapping=True, return_special_tokens_mask=True))]
    )
    assert here["labels"][0].tolist() == wwm["labels"] and here["input_ids"][0].tolist() == wwm["input_ids"]

    # 3. fine-tuning: finite losses and metrics; the saved classifier reloads here with that version's
    #    logits, whose argmax is the prediction the script wrote
    ft = report["finetune"]
    assert ft["steps"] == 2 and len(ft["losses"]) == 2 and all(math.isfinite(x) for x in ft["losses"]), ft
    for key in ("eval_accuracy", "test_accuracy"):
        assert 0.0 <= ft["metrics"][key] <= 1.0, ft
    then = torch.load(out / "cls_reloaded.pt")
    tokenizer = AutoTokenizer.from_pretrained(out / "cls")
    model = BertImplForSequenceClassification.from_pretrained(out / "cls").eval()
    with torch.no_grad():
        now = model(**tokenizer(then["sentences"], padding=True, truncation=True, return_tensors="pt")).logits
    assert (now - then["logits"]).abs().max().item() <= TOL
    assert [model.config.id2label[i] for i in now.argmax(-1).tolist()] == report["predictions"]

    # 4. the card: rendered the same twice, parses here, and its model-index holds the run's metrics
    assert report["card_same_as_saved"]
    card = ModelCard.load(out / "cls" / "README.md")
    facts = json.loads((out / "cls" / "training_facts.json").read_text())
    assert card.data.pipeline_tag == "text-classification"
    indexed = {r.metric_name: r.metric_value for r in card.data.eval_results}
    assert "eval_accuracy" in indexed and indexed == facts["metrics"], (indexed, facts["metrics"])
    assert {
        "model.safetensors",
        "config.json",
        "modeling_bert_impl.py",
        "configuration_bert_impl.py",
        "README.md",
        "tokenizer.json",
        "loss_curve.png",
    } <= set(report["upload"]), report["upload"]
    assert sorted(f for f in report["upload"] if f.endswith(".py")) == sorted(CODE_FILES), report["upload"]  # no more
    assert report["offline_push"].startswith("HF_HUB_OFFLINE is set"), report["offline_push"]

    # 5. conversion both ways: within the conversion tolerance of the original, and back to it exactly
    assert report["convert_rc"] == [0, 0]
    for name, diffs in report["convert"].items():
        assert max(diffs.values()) <= CONVERT_TOL, (name, diffs)
    assert report["convert_back_exact"] == [], report["convert_back_exact"]

    print(
        f"  the package under {version} (huggingface_hub {hub_version}): subprocess {wall:.1f} s, of which part 2 "
        f"{report['total_s']:.1f} s (imports {report['import_s']:.1f}, pretrain {pre['s']:.1f}, "
        f"finetune {ft['s']:.1f}, "
        f"convert {report['convert_s']:.1f}); "
        f"conversion max|Δ| {max(max(d.values()) for d in report['convert'].values()):.1e}"
    )
