"""The Hub: the model card, the push script's upload folder, and loading back by repo id.

- Card: rendered from a saved debug model plus a `training_facts.json` as the training scripts
  write it, read back with `huggingface_hub.ModelCard`; absent facts read "not recorded".
- Upload half: `scripts/push_to_hub.py` against fakes of the Hub's endpoints only (`FakeHub`);
  the files handed to `HfApi.upload_folder` must be the `--dry-run` folder, byte for byte.
- Download half: olah (a Hub-compatible server, in `.venv-olah`) serves the `--dry-run` folders and
  Trainer's push on 127.0.0.1; a process that cannot import hf_bert_impl loads them by repo id.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path

import pytest
import torch

from hf_bert_impl import pretraining
from hf_bert_impl.hub import CODE_FILES, NOT_RECORDED, build_model_card, save_model_card, validate_model_card

from .conftest import REPO_ROOT, load_script, run_without_package


FACTS = {
    "task": "fill-mask",
    "dataset": "wikitext",
    "dataset_config": "wikitext-2-raw-v1",
    "base_model": "sentence-transformers/all-MiniLM-L6-v2",
    "hyperparameters": {"learning_rate": 0.0005, "num_train_epochs": 3, "per_device_train_batch_size": 16},
    "metrics": {"eval_loss": 4.123456789, "perplexity": 61.7618, "eval_runtime": 1.5, "epoch": 3.0},
    "loss_curve": "loss_curve.png",
}


@pytest.fixture
def saved_mlm(tmp_path, debug_config):
    from hf_bert_impl import BertImplForMaskedLM

    model_dir = tmp_path / "mlm"
    BertImplForMaskedLM(debug_config()).save_pretrained(model_dir)
    return model_dir


def test_card_without_facts_says_not_recorded_and_invents_nothing(saved_mlm):
    from huggingface_hub import ModelCard

    path = save_model_card(saved_mlm)
    assert path == saved_mlm / "README.md"
    card = ModelCard.load(path)
    validate_model_card(card, saved_mlm)
    data = card.data.to_dict()
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "fill-mask"
    assert "custom_code" in data["tags"]
    assert data["license"] == "apache-2.0"
    # No recorded evaluation -> no model-index, no dataset, no base model in the metadata.
    assert "model-index" not in data and "datasets" not in data and "base_model" not in data
    for section in ("## Training", "## Results", "## Loss curve"):
        body = card.text.split(section, 1)[1].split("\n## ", 1)[0]
        assert NOT_RECORDED in body, f"{section} should say {NOT_RECORDED!r}:\n{body}"
    assert "| metric | value |" not in card.text and "![" not in card.text
    assert "trust_remote_code=True" in card.text and "to_hf_bert" in card.text
    assert "Attention Is All You Need" in card.text and "Pre-training of Deep Bidirectional" in card.text


def test_card_results_match_recorded_metrics(saved_mlm):
    from huggingface_hub import ModelCard

    (saved_mlm / "training_facts.json").write_text(json.dumps(FACTS))
    (saved_mlm / "loss_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    card = ModelCard.load(save_model_card(saved_mlm, repo_id="someone/bert-impl-mlm"))
    validate_model_card(card, saved_mlm)
    data = card.data
    assert data.base_model == FACTS["base_model"]
    assert data.datasets == ["wikitext"]
    assert data.model_name == "bert-impl-mlm"
    recorded = {r.metric_name: r.metric_value for r in data.eval_results}
    # Exactly the quality metrics, bit for bit; Trainer's bookkeeping stays out of the model-index.
    assert recorded == {"eval_loss": FACTS["metrics"]["eval_loss"], "perplexity": FACTS["metrics"]["perplexity"]}
    assert {r.metric_type for r in data.eval_results} == {"loss", "perplexity"}
    assert {(r.task_type, r.dataset_type, r.dataset_config) for r in data.eval_results} == {
        ("fill-mask", "wikitext", "wikitext-2-raw-v1")
    }
    for name, value in FACTS["metrics"].items():
        assert f"| {name} | {value:.6g} |" in card.text
    for name in FACTS["hyperparameters"]:
        assert f"| {name} |" in card.text
    assert "![training loss curve](loss_curve.png)" in card.text
    assert 'from_pretrained("someone/bert-impl-mlm", trust_remote_code=True)' in card.text


def test_card_from_a_fine_tuning_run_on_local_data(tmp_path, debug_config):
    """Facts as `hf_bert_impl.cli.write_training_facts` writes them after a fine-tuning run on a
    local file, initialised from a local checkpoint: nothing local is passed off as a Hub id, and
    training loss stays out of the evaluation results."""
    from huggingface_hub import ModelCard

    from hf_bert_impl import BertImplForTokenClassification
    from hf_bert_impl.cli import write_training_facts

    model_dir = tmp_path / "ner"
    BertImplForTokenClassification(debug_config(num_labels=3)).save_pretrained(model_dir)
    write_training_facts(
        model_dir,
        task="token-classification",
        dataset="ner.jsonl",
        base_model=str(tmp_path / "mlm-pretrained"),
        hyperparameters={"learning_rate": 3e-5, "num_train_epochs": None, "max_steps": 40},
        metrics={"eval_f1": 0.8125, "eval_accuracy": 0.9, "train_loss": 0.31, "eval_bad": float("inf")},
        loss_curve=None,
        labels=["O", "B-PER", "I-PER"],
        dataset_split="validation",
    )
    card = ModelCard.load(save_model_card(model_dir))
    validate_model_card(card, model_dir)
    data = card.data
    assert data.pipeline_tag == "token-classification"
    assert "base_model" not in data.to_dict() and "datasets" not in data.to_dict()
    assert {r.metric_name: r.metric_value for r in data.eval_results} == {"eval_f1": 0.8125, "eval_accuracy": 0.9}
    assert {(r.dataset_type, r.dataset_name, r.dataset_split) for r in data.eval_results} == {
        ("local", "ner.jsonl", "validation")
    }
    assert "| train_loss | 0.31 |" in card.text and "eval_bad" not in card.text
    assert "| num_train_epochs |" not in card.text and "| max_steps | 40 |" in card.text
    assert "- Labels: O, B-PER, I-PER" in card.text and "(a local checkpoint)" in card.text
    assert "## Loss curve\n\nnot recorded" in card.text


@pytest.mark.parametrize(
    "facts, message",
    [
        ({"metrics": {"eval_loss": float("nan")}}, "metric 'eval_loss' must be a finite number"),
        ({"metrics": {"accuracy": "high"}}, "metric 'accuracy' must be a finite number, got 'high'"),
        ({"hyperparameters": [1, 2]}, "'hyperparameters' must be an object"),
        ({"loss_curve": "missing.png"}, "names loss_curve 'missing.png'"),
    ],
)
def test_bad_training_facts_are_named(saved_mlm, facts, message):
    (saved_mlm / "training_facts.json").write_text(json.dumps(facts))
    with pytest.raises(ValueError, match=re.escape(message)):
        build_model_card(saved_mlm)


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("value: 4.123456789", "value: 4.12345679", "model-index metrics"),  # a rounded metric
        ("      name: perplexity\n", "      name: eval_perplexity\n", "model-index metrics"),
        (
            "      name: wikitext\n",
            "      name: wikitext-103\n",
            "model-index result 'eval_loss' is for task 'fill-mask' on 'wikitext-103'",
        ),
        ("      type: fill-mask\n", "      type: text-classification\n", "is for task 'text-classification'"),
        ("pipeline_tag: fill-mask", "pipeline_tag: text-classification", "pipeline_tag is 'text-classification'"),
        ("| Head | `BertImplForMaskedLM`", "| Head | `BertImplModel`", "the head row does not name"),
        # the second snippet (the plain-BERT export) loads another head than the first
        (
            "to_hf_bert\n\nmodel = AutoModelForMaskedLM.",
            "to_hf_bert\n\nmodel = AutoModel.",
            "the usage snippets load the model with ['AutoModel', 'AutoModelForMaskedLM']",
        ),
        ("2 layers, hidden 32, 4 heads", "2 layers, hidden 4, 32 heads", "the size row states"),
        ("vocabulary 99 |", "vocabulary 98 |", "the size row states"),
    ],
)
def test_card_that_disagrees_with_the_model_fails_validation(saved_mlm, old, new, message):
    """validate_model_card reads the rendered card back and compares it with config.json and
    training_facts.json: each edit below (a number off, a name swapped) makes it fail."""
    from huggingface_hub import ModelCard

    (saved_mlm / "training_facts.json").write_text(json.dumps(FACTS))
    (saved_mlm / "loss_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    text = str(build_model_card(saved_mlm, repo_id="someone/bert-impl-mlm"))
    validate_model_card(ModelCard(text), saved_mlm)
    assert text.count(old) == 1
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_model_card(ModelCard(text.replace(old, new)), saved_mlm)


def test_card_validation_reads_the_current_facts_and_config(saved_mlm):
    """A card rendered before the facts or the config changed no longer validates; a run whose
    facts name another task than its head's cannot get a card at all."""
    facts = dict(FACTS)
    (saved_mlm / "training_facts.json").write_text(json.dumps(facts))
    (saved_mlm / "loss_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    card = build_model_card(saved_mlm)
    (saved_mlm / "training_facts.json").write_text(json.dumps({**facts, "metrics": {"eval_loss": 4.0}}))
    with pytest.raises(ValueError, match=re.escape("are not the run's quality metrics {'eval_loss': 4.0}")):
        validate_model_card(card, saved_mlm)
    (saved_mlm / "training_facts.json").write_text(json.dumps(facts))
    config = json.loads((saved_mlm / "config.json").read_text())
    (saved_mlm / "config.json").write_text(
        json.dumps({**config, "architectures": ["BertImplForSequenceClassification"]})
    )
    with pytest.raises(
        ValueError, match="pipeline_tag is 'fill-mask', but config.json's head BertImplForSequenceClassification"
    ):
        validate_model_card(card, saved_mlm)
    (saved_mlm / "config.json").write_text(json.dumps(config))
    (saved_mlm / "training_facts.json").write_text(json.dumps({**facts, "task": "token-classification"}))
    with pytest.raises(
        ValueError, match="pipeline_tag is 'token-classification', but config.json's head BertImplForMaskedLM"
    ):
        save_model_card(saved_mlm)


def test_card_refuses_a_directory_that_is_not_bert_impl(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert', not 'bert_impl'"):
        build_model_card(tmp_path)
    with pytest.raises(ValueError, match="has no config.json"):
        build_model_card(tmp_path / "nowhere")


# ============================================================================================
# Push: the --dry-run folder, the upload half (fake Hub endpoints), Trainer's push, and the
# download half through a real Hub-compatible server (olah) in a process without hf_bert_impl.

OLAH_CLI = Path(os.environ.get("OLAH_VENV", REPO_ROOT / ".venv-olah")) / "bin" / "olah-cli"  # scripts/setup_env.sh
OWNER = "owner"
ID2LABEL = {
    "cls": {0: "negative", 1: "neutral", 2: "positive"},
    "tok": {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"},
}
HEADS = {
    "mlm": "BertImplForMaskedLM",
    "pt": "BertImplForPreTraining",
    "cls": "BertImplForSequenceClassification",
    "tok": "BertImplForTokenClassification",
    "qa": "BertImplForQuestionAnswering",
    "base": "BertImplModel",
}
TEXT = "The quick brown fox jumps over the lazy dog in Paris."
MASKED = "The quick brown [MASK] jumps over the lazy dog."
QUESTION, CONTEXT = "Where does the fox live?", "The fox lives in a small den near Paris with its family."
UPLOAD = [
    "README.md",
    "config.json",
    "configuration_bert_impl.py",
    "loss_curve.png",
    "model.safetensors",
    "modeling_bert_impl.py",
    "tokenizer.json",
    "tokenizer_config.json",
]


def _push_script():
    return load_script("push_to_hub")


def _files(folder: Path) -> dict:
    """relative path -> sha256 of every file under `folder`."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


class FakeHub:
    """Stands in for the Hub's network endpoints, and nothing else: `HfApi.whoami`, `create_repo`,
    `create_branch`, `upload_folder` and `ModelCard.validate` (the Hub's YAML check). `upload_folder`
    selects files with huggingface_hub's own pattern filter and the defaults it adds, records the
    call and copies exactly those files to `received/<repo_id>`, as the Hub would store them."""

    def __init__(self, root: Path):
        self.root, self.calls, self.uploads = root, [], {}

    def install(self, mp):
        from huggingface_hub import HfApi, ModelCard
        from huggingface_hub.hf_api import DEFAULT_IGNORE_PATTERNS, RepoUrl
        from huggingface_hub.utils import filter_repo_objects

        hub = self

        def whoami(api, token=None, **kwargs):
            hub.calls.append(("whoami",))
            return {"name": OWNER, "orgs": [{"name": "some-org"}]}

        def create_repo(api, repo_id, **kwargs):
            hub.calls.append(("create_repo", repo_id, kwargs.get("private")))
            return RepoUrl(f"https://huggingface.co/{repo_id}", endpoint="https://huggingface.co")

        def create_branch(api, repo_id, *, branch, **kwargs):
            hub.calls.append(("create_branch", repo_id, branch))

        def upload_folder(
            api,
            *,
            repo_id,
            folder_path,
            path_in_repo=None,
            allow_patterns=None,
            ignore_patterns=None,
            revision=None,
            commit_message=None,
            **kwargs,
        ):
            folder = Path(folder_path)
            ignore = [ignore_patterns] if isinstance(ignore_patterns, str) else list(ignore_patterns or [])
            names = [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*")) if p.is_file()]
            names = list(
                filter_repo_objects(
                    names, allow_patterns=allow_patterns, ignore_patterns=ignore + DEFAULT_IGNORE_PATTERNS
                )
            )
            dest = hub.root / repo_id
            shutil.rmtree(dest, ignore_errors=True)
            for name in names:
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(folder / name, dest / name)
            hub.calls.append(("upload_folder", repo_id, revision, commit_message, path_in_repo))
            hub.uploads[repo_id] = dest
            return types.SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0000000")

        def validate(card, repo_type=None):
            hub.calls.append(("validate_card",))

        mp.setattr(HfApi, "whoami", whoami)
        mp.setattr(HfApi, "create_repo", create_repo)
        mp.setattr(HfApi, "create_branch", create_branch)
        mp.setattr(HfApi, "upload_folder", upload_folder)
        mp.setattr(ModelCard, "validate", validate)
        return self


@pytest.fixture(scope="module")
def hub_setup(tmp_path_factory, minilm_dir):
    """Five tiny heads (debug sizes, MiniLM's WordPiece vocabulary so that pipelines run), each
    saved with the tokenizer, plus each one's --dry-run folder. The MLM directory also carries the
    training facts and a loss curve, as the training scripts leave them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from transformers import AutoTokenizer

    import hf_bert_impl

    root = tmp_path_factory.mktemp("hub")
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    models, dirs, uploads = {}, {}, {}
    push = _push_script()
    for i, (name, cls_name) in enumerate(HEADS.items()):
        torch.manual_seed(i)
        extra = (
            {"id2label": ID2LABEL[name], "label2id": {v: k for k, v in ID2LABEL[name].items()}}
            if name in ID2LABEL
            else {}
        )
        config = hf_bert_impl.BertImplConfig.from_preset(
            "debug",
            vocab_size=tokenizer.vocab_size,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **extra,
        )
        model = getattr(hf_bert_impl, cls_name)(config).eval()
        dirs[name] = root / "models" / name
        model.save_pretrained(dirs[name])
        tokenizer.save_pretrained(dirs[name])
        models[name] = model
        if name == "mlm":
            (dirs[name] / "training_facts.json").write_text(json.dumps(FACTS))
            fig, ax = plt.subplots(figsize=(2, 2))
            ax.plot([5.0, 4.6, 4.1])
            fig.savefig(dirs[name] / "loss_curve.png")
            plt.close(fig)
        uploads[name] = root / "upload" / name
        assert (
            push.main(
                ["--model-dir", str(dirs[name]), "--repo-id", f"{OWNER}/{name}", "--dry-run", str(uploads[name])]
            )
            == 0
        )
    return types.SimpleNamespace(root=root, tokenizer=tokenizer, models=models, dirs=dirs, uploads=uploads, push=push)


def test_dry_run_folder_is_exactly_the_hub_repository(hub_setup):
    from huggingface_hub import ModelCard
    from safetensors.torch import load_file

    from hf_bert_impl import AUTO_MAP

    folder = hub_setup.uploads["mlm"]
    assert sorted(_files(folder)) == UPLOAD
    # the other heads have no loss curve recorded, so no image travels
    assert sorted(_files(hub_setup.uploads["cls"])) == [n for n in UPLOAD if n != "loss_curve.png"]
    local, pushed = load_file(hub_setup.dirs["mlm"] / "model.safetensors"), load_file(folder / "model.safetensors")
    assert sorted(local) == sorted(pushed) and all(torch.equal(local[k], pushed[k]) for k in local)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "bert_impl" and config["auto_map"] == AUTO_MAP
    assert config["architectures"] == ["BertImplForMaskedLM"]
    for name in CODE_FILES:
        assert (folder / name).read_bytes() == (REPO_ROOT / "hf_bert_impl" / name).read_bytes()
    card = ModelCard.load(folder / "README.md")
    validate_model_card(card, hub_setup.dirs["mlm"])
    assert {r.metric_name: r.metric_value for r in card.data.eval_results} == {
        "eval_loss": FACTS["metrics"]["eval_loss"],
        "perplexity": FACTS["metrics"]["perplexity"],
    }
    assert 'AutoModelForMaskedLM.from_pretrained("owner/mlm", trust_remote_code=True)' in card.text


@pytest.mark.parametrize("name", ["mlm", "cls"])
def test_card_export_block_gives_a_plain_transformers_bert(hub_setup, name, tmp_path, monkeypatch):
    """The card's "Without remote code" block, run as written on the upload folder, writes a
    model_type "bert" checkpoint that stock transformers loads and that matches our model
    (float32, 1e-5 absolute, the design's tolerance)."""
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoModelForSequenceClassification

    folder = hub_setup.uploads[name]
    card = (folder / "README.md").read_text()
    code = card.split("```python\n")[2].split("```", 1)[0]
    assert 'to_hf_bert(model).save_pretrained("plain-bert")' in code and f'"owner/{name}"' in code
    monkeypatch.chdir(tmp_path)
    exec(code.replace(f'"owner/{name}"', repr(str(folder))), {})
    assert AutoConfig.from_pretrained(tmp_path / "plain-bert").model_type == "bert"
    auto = AutoModelForMaskedLM if name == "mlm" else AutoModelForSequenceClassification
    plain = auto.from_pretrained(tmp_path / "plain-bert").eval()
    assert type(plain).__module__.startswith("transformers.models.bert.")
    batch = hub_setup.tokenizer([TEXT, MASKED], padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs, ours = plain(**batch).logits, hub_setup.models[name](**batch).logits
    if name == "mlm":  # per token: compare real tokens only (what a padded position predicts is unspecified)
        real = batch["attention_mask"].bool()
        theirs, ours = theirs[real], ours[real]
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


def test_upload_half_hands_huggingface_hub_exactly_the_dry_run_folder(hub_setup, tmp_path, monkeypatch, capsys):
    hub = FakeHub(tmp_path / "received").install(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_the_faked_endpoints")
    argv = [
        "--model-dir",
        str(hub_setup.dirs["mlm"]),
        "--repo-id",
        f"{OWNER}/mlm",
        "--private",
        "--revision",
        "v1",
        "--commit-message",
        "tiny MLM",
    ]
    assert hub_setup.push.main(argv) == 0
    assert "pushed to https://huggingface.co/owner/mlm/commit/" in capsys.readouterr().out
    # login checked first, the Hub's card check before the repository is touched, one upload
    assert hub.calls == [
        ("whoami",),
        ("validate_card",),
        ("create_repo", "owner/mlm", True),
        ("create_branch", "owner/mlm", "v1"),
        ("upload_folder", "owner/mlm", "v1", "tiny MLM", None),
    ]
    assert _files(hub.uploads["owner/mlm"]) == _files(hub_setup.uploads["mlm"])  # same names, same bytes


def test_rejected_token_or_foreign_owner_stops_before_upload(hub_setup, tmp_path, monkeypatch, capsys):
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    hub = FakeHub(tmp_path / "received").install(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_the_faked_endpoints")
    argv = ["--model-dir", str(hub_setup.dirs["cls"]), "--repo-id"]
    assert hub_setup.push.main(argv + ["stranger/cls"]) == 2
    assert capsys.readouterr().err == (
        "push_to_hub.py: error: logged in as 'owner', who cannot write to 'stranger'; "
        "pushable owners: ['owner', 'some-org']\n"
    )

    def rejected(api, token=None, **kwargs):
        request = httpx2.Request("GET", "https://huggingface.co/api/whoami-v2")
        raise HfHubHTTPError("Invalid credentials", response=httpx2.Response(401, request=request))

    monkeypatch.setattr(HfApi, "whoami", rejected)
    assert hub_setup.push.main(argv + ["owner/cls"]) == 2
    assert "the Hugging Face token was rejected (401): log in with `hf auth login`" in capsys.readouterr().err
    assert hub.calls == [("whoami",)] and not hub.uploads

    def forbidden(api, repo_id, **kwargs):  # e.g. a token without write access to the organisation
        request = httpx2.Request("POST", "https://huggingface.co/api/repos/create")
        raise HfHubHTTPError(
            "403 Forbidden: you don't have the rights to create a model under this namespace",
            response=httpx2.Response(403, request=request),
        )

    hub = FakeHub(tmp_path / "received").install(monkeypatch)
    monkeypatch.setattr(HfApi, "create_repo", forbidden)
    assert hub_setup.push.main(argv + ["some-org/cls"]) == 1
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith("push_to_hub.py: error: the Hub refused the push: 403 Forbidden")
    )
    assert [c[0] for c in hub.calls] == ["whoami", "validate_card"] and not hub.uploads


@pytest.mark.parametrize(
    "repo_id", ["bert-impl-mlm", "owner/name/extra", "owner/bad name", "owner/-name", "owner/na--me", "/name"]
)
def test_malformed_repo_id_is_refused_before_anything(hub_setup, repo_id, tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        hub_setup.push.main(["--model-dir", str(hub_setup.dirs["cls"]), "--repo-id", repo_id, "--dry-run", str(out)])
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("push_to_hub.py: error: repo id ") and repr(repo_id) in err and "malformed" in err
    assert not out.exists()


def test_bad_model_dirs_are_refused_with_the_reason(hub_setup, tmp_path, capsys):
    import torch

    src = hub_setup.dirs["cls"]

    def variant(name, drop=(), add=None):
        d = tmp_path / name
        shutil.copytree(src, d)
        for f in drop:
            (d / f).unlink()
        if add:
            add(d)
        return d

    cases = {
        "no config": (variant("a", drop=["config.json"]), "has no config.json"),
        "pickled weights": (
            variant("b", drop=["model.safetensors"], add=lambda d: torch.save({}, d / "pytorch_model.bin")),
            "holds weights in 'pytorch_model.bin', which is not safetensors",
        ),
        "no weights": (variant("c", drop=["model.safetensors"]), "has no model.safetensors"),
        "no tokenizer": (variant("d", drop=["tokenizer.json", "tokenizer_config.json"]), "has no tokenizer"),
        "missing dir": (tmp_path / "nowhere", "is not a directory"),
    }
    for case, (model_dir, message) in cases.items():
        code = hub_setup.push.main(
            ["--model-dir", str(model_dir), "--repo-id", "owner/x", "--dry-run", str(tmp_path / "o")]
        )
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, f"{case}: {err!r}"
    assert not (tmp_path / "o").exists()
    # the dry-run folder must hold exactly the upload, so a non-empty one is refused
    assert hub_setup.push.main(["--model-dir", str(src), "--repo-id", "owner/x", "--dry-run", str(src)]) == 2
    assert f"output folder {str(src)!r} is not empty" in capsys.readouterr().err


def test_not_logged_in_says_how_to_log_in(hub_setup, tmp_path):
    """A fresh process with an empty HF_HOME and no HF_TOKEN: the token check fails before any
    request (HF_HUB_OFFLINE=1 stays set, so a request would fail loudly instead)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "push_to_hub.py"),
            "--model-dir",
            str(hub_setup.dirs["cls"]),
            "--repo-id",
            "owner/x",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "push_to_hub.py: error: not logged in to the Hugging Face Hub: log in with `hf auth login` (or set HF_TOKEN "
        "to a write token from https://huggingface.co/settings/tokens); --dry-run OUT needs no token"
    )


@pytest.fixture(scope="module")
def trainer_upload(hub_setup, tmp_path_factory):
    """`Trainer(push_to_hub=True, hub_model_id=...)` on our sequence classifier: two training
    steps, then `trainer.push_to_hub()`, against the same fake endpoints."""
    import torch
    from transformers import Trainer, TrainingArguments

    import hf_bert_impl

    root = tmp_path_factory.mktemp("trainer")
    model = hf_bert_impl.BertImplForSequenceClassification.from_pretrained(hub_setup.dirs["cls"])
    enc = hub_setup.tokenizer(
        [TEXT, MASKED, QUESTION, CONTEXT] * 2, padding="max_length", max_length=16, truncation=True
    )
    data = [
        {
            "input_ids": torch.tensor(enc["input_ids"][i]),
            "attention_mask": torch.tensor(enc["attention_mask"][i]),
            "labels": torch.tensor(i % 3),
        }
        for i in range(8)
    ]
    args = TrainingArguments(
        output_dir=str(root / "out"),
        push_to_hub=True,
        hub_model_id=f"{OWNER}/trainer-cls",
        max_steps=2,
        per_device_train_batch_size=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        learning_rate=1e-3,
    )
    with pytest.MonkeyPatch.context() as mp:
        hub = FakeHub(root / "received").install(mp)
        trainer = Trainer(model=model, args=args, train_dataset=data, processing_class=hub_setup.tokenizer)
        trainer.train()
        trainer.push_to_hub()
    return types.SimpleNamespace(hub=hub, folder=hub.uploads[f"{OWNER}/trainer-cls"], model=trainer.model.eval())


def test_trainer_push_to_hub_uploads_a_loadable_remote_code_repository(trainer_upload):
    from hf_bert_impl import AUTO_MAP

    # Trainer's own card (README.md) and its pickled TrainingArguments travel too; the weights are
    # safetensors and nothing else is pickled.
    assert sorted(_files(trainer_upload.folder)) == [
        "README.md",
        "config.json",
        "configuration_bert_impl.py",
        "model.safetensors",
        "modeling_bert_impl.py",
        "tokenizer.json",
        "tokenizer_config.json",
        "training_args.bin",
    ]
    config = json.loads((trainer_upload.folder / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["architectures"] == ["BertImplForSequenceClassification"]
    assert [c[0] for c in trainer_upload.hub.calls] == ["create_repo", "upload_folder"]
    from huggingface_hub import ModelCard

    card = ModelCard((trainer_upload.folder / "README.md").read_text())
    assert {"bert_impl", "custom_code"} <= set(card.data.tags or []), card.data.tags  # listed as remote code
    # the loading itself is checked through the Hub server in test_load_back_through_a_hub_server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _git_commit(folder: Path):
    git = ["git", "-c", "user.name=hub-test", "-c", "user.email=hub-test@localhost", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "upload"]):
        subprocess.run(git + cmd, cwd=folder, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def hub_server(hub_setup, trainer_upload, tmp_path_factory):
    """olah, a Hub-compatible server, on 127.0.0.1 in offline mode, serving every --dry-run folder
    and Trainer's upload from its local git mirror directory (`<mirrors>/models/<owner>/<name>`,
    read from olah's `server_mirror.py`); stopped by its PID at teardown."""
    if not OLAH_CLI.is_file():
        pytest.fail(f"{OLAH_CLI} is missing: run `bash scripts/setup_env.sh`, which installs olah into .venv-olah")
    root = tmp_path_factory.mktemp("olah")
    repos = {f"{OWNER}/{name}": folder for name, folder in hub_setup.uploads.items()}
    repos[f"{OWNER}/trainer-cls"] = trainer_upload.folder
    for repo_id, folder in repos.items():
        shutil.copytree(folder, root / "mirrors" / "models" / repo_id)
        _git_commit(root / "mirrors" / "models" / repo_id)
    port = _free_port()
    (root / "olah.toml").write_text(
        "[basic]\n"
        f'host = "127.0.0.1"\nport = {port}\n'
        f'repos-path = "{root / "cache"}"\nmirrors-path = ["{root / "mirrors"}"]\n'
        f'mirror-netloc = "127.0.0.1:{port}"\nmirror-lfs-netloc = "127.0.0.1:{port}"\n'
        "[accessibility]\noffline = true\n"
    )
    log = open(root / "olah.log", "wb")
    server = subprocess.Popen(
        [str(OLAH_CLI), "-c", str(root / "olah.toml"), "--log-path", str(root / "logs")],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, never a proxy
        deadline = time.monotonic() + 60
        while True:
            if server.poll() is not None:
                pytest.fail(f"olah exited with {server.returncode}:\n{(root / 'olah.log').read_text()[-3000:]}")
            try:
                with opener.open(f"{url}/api/models/{OWNER}/mlm/revision/main", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"olah did not answer within 60 s:\n{(root / 'olah.log').read_text()[-3000:]}")
            time.sleep(0.3)
        yield types.SimpleNamespace(url=url, root=root)
    finally:
        os.kill(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(server.pid, signal.SIGKILL)
            server.wait(timeout=15)
        log.close()


LOAD_HEADS = {
    "mlm": "AutoModelForMaskedLM",
    "pt": "AutoModelForPreTraining",
    "cls": "AutoModelForSequenceClassification",
    "trainer-cls": "AutoModelForSequenceClassification",
    "tok": "AutoModelForTokenClassification",
    "qa": "AutoModelForQuestionAnswering",
    "base": "AutoModel",
}

CLIENT = r"""
import sys
# A user without peft: with peft installed, transformers first asks for the repository's adapter_config.json, which
# olah answers with 401 where the Hub answers 404 (a file the repository lacks), and takes that for a missing repo.
sys.modules["peft"] = None
import json, torch, transformers
from pathlib import Path
from huggingface_hub import snapshot_download
from safetensors.torch import save_file
from transformers import AutoTokenizer

OUT = Path(%(out)r)
models = {}
for name, auto in %(heads)r.items():
    models[name] = getattr(transformers, auto).from_pretrained("owner/" + name, trust_remote_code=True).eval()
# By repo id, AutoTokenizer lists the repository's optional chat-template folder, which olah answers
# with 401 instead of 404; the tokenizer therefore comes from a snapshot downloaded from the server.
tokenizer = AutoTokenizer.from_pretrained(snapshot_download("owner/mlm"), trust_remote_code=True)
%(run)s
modules = {n: type(m).__module__ + "." + type(m).__name__ for n, m in models.items()}
(OUT / "modules.json").write_text(json.dumps(modules))
save_file(run_heads(models, tokenizer), OUT / "outputs.safetensors")
(OUT / "pipelines.json").write_text(json.dumps(run_pipelines(models, tokenizer)))

# The model card's "How to use" block, run as written on the downloaded repository (the repo id
# becomes the snapshot path, for the AutoTokenizer reason above).
snippets = {}
for name, call in %(snippet_calls)r.items():
    path = snapshot_download("owner/" + name)
    card = (Path(path) / "README.md").read_text()
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    assert '"owner/%%s"' %% name in code, code
    namespace = {}
    exec(code.replace('"owner/%%s"' %% name, repr(path)), namespace)
    snippets[name] = namespace["answer"] if call is None else namespace["pipe"](*call[0], **call[1])
(OUT / "snippets.json").write_text(json.dumps(snippets, default=lambda numpy_scalar: numpy_scalar.item()))
"""
# name -> (args, kwargs) of the card's `pipe(...)`; None: the QA card decodes `answer` itself
SNIPPET_CALLS = {
    "mlm": ((MASKED,), {"top_k": 3}),
    "pt": ((MASKED,), {"top_k": 3}),
    "cls": ((TEXT,), {"top_k": None}),
    "tok": ((TEXT,), {}),
    "base": ((TEXT,), {}),
    "qa": None,
}

# Runs identically in the package-free client and in this process, on the Hub copies and on the
# local models respectively.
RUN = r"""
def run_heads(models, tokenizer):
    import torch
    batch = tokenizer([%(text)r, %(masked)r], padding=True, return_tensors="pt")
    out = {}
    with torch.no_grad():
        for name, model in models.items():
            o = model(**batch)
            if name == "base":
                out[name] = o.last_hidden_state
            elif name == "qa":
                out[name] = torch.stack([o.start_logits, o.end_logits])
            elif name == "pt":
                out[name] = o.prediction_logits
            else:
                out[name] = o.logits
    return {k: v.contiguous() for k, v in out.items()}


def answer_span(model, tokenizer):
    import torch
    inputs = tokenizer(%(question)r, %(context)r, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    start, end = out.start_logits.argmax(-1).item(), out.end_logits.argmax(-1).item()
    return {"start": start, "end": end, "answer": tokenizer.decode(inputs["input_ids"][0, start : end + 1]),
            "start_logits": out.start_logits[0].tolist()}


def run_pipelines(models, tokenizer):
    from transformers import pipeline
    def pipe(task, name):
        return pipeline(task, model=models[name], tokenizer=tokenizer, device="cpu")
    results = {
        "fill-mask": pipe("fill-mask", "mlm")(%(masked)r, top_k=3),
        "text-classification": pipe("text-classification", "cls")(%(text)r, top_k=None),
        "trainer-text-classification": pipe("text-classification", "trainer-cls")(%(text)r, top_k=None),
        "token-classification": pipe("token-classification", "tok")(%(text)r),
        # transformers 5 has no question-answering pipeline (pipelines.REMOVED_TASKS); the span the
        # card's snippet decodes stands in for it
        "question-answering": answer_span(models["qa"], tokenizer),
        "feature-extraction": pipe("feature-extraction", "base")(%(text)r),
    }
    import json
    return json.loads(json.dumps(results, default=lambda numpy_scalar: numpy_scalar.item()))
""" % {"text": TEXT, "masked": MASKED, "question": QUESTION, "context": CONTEXT}


def _assert_same(hub, local, where="output"):
    """Equal structure and values; floats (pipeline scores) within 1e-6 absolute."""
    if isinstance(local, float):
        assert hub == pytest.approx(local, abs=1e-6, rel=0), f"{where}: {hub} != {local}"
    elif isinstance(local, dict):
        assert sorted(hub) == sorted(local), f"{where}: keys {sorted(hub)} != {sorted(local)}"
        for key in local:
            _assert_same(hub[key], local[key], f"{where}.{key}")
    elif isinstance(local, (list, tuple)):
        assert len(hub) == len(local), f"{where}: length {len(hub)} != {len(local)}"
        for i, (h, l) in enumerate(zip(hub, local)):
            _assert_same(h, l, f"{where}[{i}]")
    else:
        assert hub == local, f"{where}: {hub!r} != {local!r}"


@pytest.mark.slow
def test_load_back_through_a_hub_server(hub_setup, trainer_upload, hub_server, tmp_path):
    """By repo id through olah, with an empty HF_HOME, in a process that cannot import hf_bert_impl:
    every pushed head (and Trainer's push) loads with trust_remote_code=True and gives outputs
    bit-identical to the local model; the five pipelines give the local pipelines' results."""
    from safetensors.torch import load_file

    code = CLIENT % {"out": str(tmp_path), "heads": LOAD_HEADS, "run": RUN, "snippet_calls": SNIPPET_CALLS}
    proc = run_without_package(
        code,
        cwd=tmp_path,
        timeout=300,
        env_extra={
            "HF_ENDPOINT": hub_server.url,
            "HF_HOME": str(tmp_path / "empty_hf_home"),
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        },
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    modules = json.loads((tmp_path / "modules.json").read_text())
    for name in LOAD_HEADS.keys():
        # the class came from the repository's code (transformers_modules.owner.<name>.<commit>...)
        assert modules[name].startswith(f"transformers_modules.{OWNER}.") and modules[name].endswith(
            HEADS.get(name, "BertImplForSequenceClassification")
        ), modules[name]

    namespace = {}
    exec(RUN, namespace)
    local_models = {**hub_setup.models, "trainer-cls": trainer_upload.model}
    local_models = {name: local_models[name] for name in LOAD_HEADS}
    hub_out, local_out = (
        load_file(tmp_path / "outputs.safetensors"),
        namespace["run_heads"](local_models, hub_setup.tokenizer),
    )
    assert sorted(hub_out) == sorted(local_out)
    for name in local_out:
        assert torch.equal(hub_out[name], local_out[name]), (
            f"{name}: max |diff| {(hub_out[name] - local_out[name]).abs().max()}"
        )

    hub_pipes = json.loads((tmp_path / "pipelines.json").read_text())
    local_pipes = namespace["run_pipelines"](local_models, hub_setup.tokenizer)
    _assert_same(hub_pipes, local_pipes, "pipelines")
    assert len(hub_pipes["fill-mask"]) == 3 and all("[MASK]" not in r["sequence"] for r in hub_pipes["fill-mask"])
    assert {r["label"] for r in hub_pipes["text-classification"]} == set(ID2LABEL["cls"].values())
    assert torch.equal(
        torch.tensor(hub_pipes["feature-extraction"][0]),
        local_out["base"][0, : len(hub_pipes["feature-extraction"][0])],
    )

    # the cards' usage code runs as written and gives the same results
    from transformers import pipeline

    import hf_bert_impl

    snippets = json.loads((tmp_path / "snippets.json").read_text())
    for name, key in (
        ("mlm", "fill-mask"),
        ("cls", "text-classification"),
        ("tok", "token-classification"),
        ("base", "feature-extraction"),
    ):
        _assert_same(snippets[name], local_pipes[key], f"card snippet of {name}")
    pt_mlm = hf_bert_impl.BertImplForMaskedLM.from_pretrained(hub_setup.dirs["pt"]).eval()
    local_pt = json.loads(
        json.dumps(pipeline("fill-mask", model=pt_mlm, tokenizer=hub_setup.tokenizer)(MASKED, top_k=3))
    )
    _assert_same(snippets["pt"], local_pt, "card snippet of pt")
    assert isinstance(snippets["qa"], str)


def test_pretraining_run_to_upload_folder(tmp_path):
    """scripts/pretrain_mlm.py (3 steps, debug size, embedded corpus) then push_to_hub.py --dry-run:
    the folder holds the Hub files and none of Trainer's run files, and the card's evaluation
    results are, bit for bit, the ones Trainer wrote to eval_results.json."""
    from huggingface_hub import ModelCard

    run = tmp_path / "run"
    pretraining.main(
        [
            "--output_dir",
            str(run),
            "--model_size",
            "debug",
            "--max_steps",
            "3",
            "--per_device_train_batch_size",
            "8",
            "--max_seq_length",
            "32",
            "--use_cpu",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
        ]
    )
    upload = tmp_path / "upload"
    assert _push_script().main(["--model-dir", str(run), "--repo-id", "owner/mlm-run", "--dry-run", str(upload)]) == 0
    assert sorted(_files(upload)) == UPLOAD  # no checkpoint-*, training_args.bin, trainer_state.json, *_results.json
    card = ModelCard.load(upload / "README.md")
    validate_model_card(card, run)
    recorded = json.loads((run / "eval_results.json").read_text())
    results = {r.metric_name: r.metric_value for r in card.data.eval_results}
    assert results == {k: recorded[k] for k in ("eval_loss", "eval_masked_accuracy", "perplexity")}
    assert {r.dataset_type for r in card.data.eval_results} == {"local"}  # the embedded corpus is not on the Hub
    assert card.data.pipeline_tag == "fill-mask" and "![training loss curve](loss_curve.png)" in card.text


def test_converted_checkpoint_to_upload_folder(minilm_dir, tmp_path):
    """scripts/convert_checkpoint.py on the real all-MiniLM-L6-v2 weights, then push_to_hub.py
    --dry-run: the card names the source as the base model and describes the converted size."""
    from huggingface_hub import ModelCard

    converted, upload = tmp_path / "converted", tmp_path / "upload"
    assert load_script("convert_checkpoint").main(["--from-hf", str(minilm_dir), "--out", str(converted)]) == 0
    assert (
        _push_script().main(
            ["--model-dir", str(converted), "--repo-id", "owner/minilm-impl", "--dry-run", str(upload)]
        )
        == 0
    )
    assert sorted(_files(upload)) == [
        "README.md",
        "config.json",
        "configuration_bert_impl.py",
        "model.safetensors",
        "modeling_bert_impl.py",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
    ]
    card = ModelCard.load(upload / "README.md")
    validate_model_card(card, converted)
    # a local directory is not a Hub id, so it is named in the text and kept out of the metadata
    assert "base_model" not in card.data.to_dict()
    assert f"| Base model | `{minilm_dir}` (a local checkpoint) |" in card.text
    assert "| Size | 6 layers, hidden 384, 12 heads, feed-forward 1536, vocabulary 30522 |" in card.text
    assert "| Position encoding | learned |" in card.text and card.data.pipeline_tag == "feature-extraction"
