"""The Hub: model-card rendering and the push of a saved model directory.

- `save_model_card(model_dir)` renders `README.md` (the model card) inside a saved model directory
  from its `config.json` plus the optional `training_facts.json` that the training scripts write
  (keys: task, dataset, base_model, hyperparameters, metrics, loss_curve). A fact that is absent is
  rendered as "not recorded"; nothing is invented.
- `build_upload_folder(model_dir, repo_id, out)` writes exactly what `push_model_dir` uploads: the
  weights (safetensors only), `config.json` with `auto_map` for every head, the code files,
  the tokenizer, the loss-curve image and the card.
- `push_model_dir(...)` checks everything a user can get wrong (repo id, files, token) before the
  first byte goes out, then uploads that folder with `huggingface_hub`.

The card template lives in `model_cards/model_card.md` (Jinja, rendered by
`huggingface_hub.ModelCard.from_template`).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .configuration_bert_impl import AUTO_MAP, SAVED_BEFORE, word_embedding_scale
from .heads import HEAD_TABLE


NOT_RECORDED = "not recorded"
FACTS_FILE = "training_facts.json"
CARD_FILE = "README.md"
# A wheel install ships the template inside the package (pyproject's package-dir mapping); a source
# checkout or editable install has it at the repository root.
TEMPLATE_PATH = next(
    (
        p
        for p in (
            Path(__file__).resolve().parent / "model_cards" / "model_card.md",
            Path(__file__).resolve().parent.parent / "model_cards" / "model_card.md",
        )
        if p.is_file()
    ),
    Path(__file__).resolve().parent.parent / "model_cards" / "model_card.md",
)
CODE_FILES = ("configuration_bert_impl.py", "modeling_bert_impl.py")  # the Hub files
# Tokenizer files copied verbatim when present: a fast tokenizer (tokenizer.json) or a WordPiece
# vocabulary (vocab.txt) is required, the rest describes special tokens and the tokenizer class.
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)
LICENSE = "apache-2.0"
TAGS = ["bert", "bert_impl", "hf-bert-impl", "custom_code"]

# Head -> (Auto class that loads it, task), read off the head table. The task doubles as the Hub
# `pipeline_tag` where the Hub has one; NSP and multiple choice have no pipeline, so their cards
# carry no pipeline_tag. PreTraining's output has no `logits`, so the fill-mask pipeline runs on
# the MLM head loaded from its checkpoint (PIPELINE_HEAD).
HEAD_INFO = {head.name: (head.auto_class, head.task) for head in HEAD_TABLE}
PIPELINE_HEAD = {"BertImplForPreTraining": "AutoModelForMaskedLM"}
PIPELINE_TAGS = (
    "feature-extraction",
    "fill-mask",
    "text-classification",
    "token-classification",
    "question-answering",
)
LOCAL_FILE_SUFFIXES = (".txt", ".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow", ".safetensors", ".bin")
# Trainer bookkeeping that is not a quality measurement (metric-name suffixes): kept out of the
# model-index (the Hub's leaderboards read the model-index) and out of fine-tuning's split metrics.
BOOKKEEPING_SUFFIXES = (
    "runtime",
    "samples_per_second",
    "steps_per_second",
    "epoch",
    "total_flos",
    "step",
    "training_seconds",
)
# Baselines a run reports beside its own metrics (pretrain_mlm.py's perplexity of a model blind to context):
# shown in the card's table, kept out of the model-index, which holds the model's own results.
BASELINE_PREFIXES = ("unigram_",)


# --------------------------------------------------------------------------------------------
# facts


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} must hold a JSON object, got {type(data).__name__}")
    return data


def load_config_dict(model_dir: str | os.PathLike) -> dict:
    """`config.json` of a saved bert_impl model, as a dict; ValueError when it is missing or not ours."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{model_dir} has no config.json; save the model there with model.save_pretrained({str(model_dir)!r})"
        )
    config = _read_json(path, "config")
    if config.get("model_type") != "bert_impl":
        raise ValueError(
            f"{path} has model_type {config.get('model_type')!r}, not 'bert_impl'; convert a transformers "
            f"BERT first with hf_bert_impl.convert.from_hf_bert and save the result"
        )
    return config


def load_training_facts(model_dir: str | os.PathLike) -> dict:
    """The training run's `training_facts.json` (empty dict when there is none), type-checked."""
    path = Path(model_dir) / FACTS_FILE
    if not path.is_file():
        return {}
    facts = _read_json(path, "training facts")
    for key in ("hyperparameters", "metrics"):
        if facts.get(key) is not None and not isinstance(facts[key], dict):
            raise ValueError(f"{path}: {key!r} must be an object of name -> value, got {facts[key]!r}")
    for name, value in (facts.get("metrics") or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{path}: metric {name!r} must be a finite number, got {value!r}")
    for key in ("task", "dataset", "base_model", "loss_curve"):
        if facts.get(key) is not None and not isinstance(facts[key], str):
            raise ValueError(f"{path}: {key!r} must be a string or null, got {facts[key]!r}")
    return facts


def copy_tokenizer_files(source_dir: str | os.PathLike, out: str | os.PathLike) -> list[str]:
    """Copy the TOKENIZER_FILES that `source_dir` has into `out`; returns their names."""
    source_dir, out = Path(source_dir), Path(out)
    copied = [name for name in TOKENIZER_FILES if (source_dir / name).is_file()]
    for name in copied:
        shutil.copy2(source_dir / name, out / name)
    return copied


def _is_hub_id(value: str) -> bool:
    """True for a Hub repository id ("name" or "owner/name"), False for a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.isabs(value) or value.startswith(".") or os.path.exists(value) or value.count("/") > 1:
        return False
    if value.lower().endswith(LOCAL_FILE_SUFFIXES):  # "ner.jsonl" is a valid repo name but a local file
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def _num_parameters(model_dir: Path) -> str:
    """Parameter count read from the safetensors headers (tied weights are stored once)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        return NOT_RECORDED
    total = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                total += math.prod(f.get_slice(key).get_shape())
    return f"{total:,}"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


# --------------------------------------------------------------------------------------------
# the card


def build_model_card(model_dir: str | os.PathLike, repo_id: str | None = None) -> ModelCard:
    """Render the model card of `model_dir` (not written to disk; see `save_model_card`).

    `repo_id` goes into the usage snippets; without it they load from the local directory.
    """
    model_dir = Path(model_dir)
    config = load_config_dict(model_dir)
    facts = load_training_facts(model_dir)

    architectures = config.get("architectures") or ["BertImplModel"]
    architecture = architectures[0]
    if architecture not in HEAD_INFO:
        raise ValueError(
            f"{model_dir / 'config.json'}: unknown architecture {architecture!r}; expected one of {sorted(HEAD_INFO)}"
        )
    auto_class, head_task = HEAD_INFO[architecture]
    task = facts.get("task") or head_task
    pipeline_tag = task if task in PIPELINE_TAGS else None

    dataset = facts.get("dataset")
    base_model = facts.get("base_model")
    base_model_id = base_model if base_model and _is_hub_id(base_model) else None
    if base_model is None:
        base_model_text = "none (trained from scratch)" if "base_model" in facts else NOT_RECORDED
    else:
        base_model_text = f"`{base_model}`" + (" (on the Hub)" if base_model_id else " (a local checkpoint)")
    metrics = facts.get("metrics") or {}
    loss_curve = facts.get("loss_curve")
    if loss_curve and not (model_dir / loss_curve).is_file():
        raise ValueError(
            f"{model_dir / FACTS_FILE} names loss_curve {loss_curve!r}, but {model_dir / loss_curve} does not exist"
        )

    model_name = repo_id.split("/")[-1] if repo_id else model_dir.resolve().name
    eval_results = None
    if dataset and metrics:
        # model-index wants a dataset id as the type; data that is not on the Hub is typed "local"
        dataset_type = dataset if _is_hub_id(dataset) else "local"
        eval_results = [
            EvalResult(
                task_type=task,
                dataset_type=dataset_type,
                dataset_name=dataset,
                metric_type=_metric_id(name),
                metric_name=name,
                metric_value=value,
                dataset_config=facts.get("dataset_config"),
                dataset_split=facts.get("dataset_split"),
            )
            for name, value in metrics.items()
            if _is_quality_metric(name)
        ] or None

    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=TAGS + ([task] if task and task != pipeline_tag else []),
        license=facts.get("license") or LICENSE,
        language=facts.get("language"),
        datasets=[dataset] if dataset and _is_hub_id(dataset) else None,
        base_model=base_model_id,
        model_name=model_name if eval_results else None,
        eval_results=eval_results,
    )
    if not TEMPLATE_PATH.is_file():
        raise FileNotFoundError(
            f"model-card template {TEMPLATE_PATH} is missing; reinstall hf-bert-impl from its repository"
        )
    return ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE_PATH),
        model_name=model_name,
        repo_id=repo_id or f"./{model_dir.resolve().name}",
        architecture=architecture,
        auto_class=auto_class,
        pipeline_auto_class=PIPELINE_HEAD.get(architecture, auto_class),
        task=task or NOT_RECORDED,
        pipeline_tag=pipeline_tag,
        pipeline_available=pipeline_tag in _transformers_pipelines(),
        num_parameters=_num_parameters(model_dir),
        base_model_text=base_model_text,
        dataset_text=_dataset_text(facts),
        # a None hyperparameter was not used by that run (e.g. epochs when max_steps ruled)
        hyperparameters=sorted((k, _fmt(v)) for k, v in (facts.get("hyperparameters") or {}).items() if v is not None),
        labels=", ".join(map(str, facts["labels"])) if isinstance(facts.get("labels"), list) else None,
        metrics=[(k, _fmt(v)) for k, v in metrics.items()],
        # e.g. MNLI's validation_mismatched, scored beside the evaluation split
        other_split_metrics=[(k, _fmt(v)) for k, v in (facts.get("other_split_metrics") or {}).items()],
        # splits whose labels were placeholders (GLUE test: -1): predicted, never scored
        unlabeled_splits=sorted((facts.get("unlabeled_splits") or {}).items()),
        loss_curve=loss_curve,
        **{
            k: config.get(k, NOT_RECORDED)
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
                "vocab_size",
                "max_position_embeddings",
                "position_embedding_type",
            )
        },
        word_embedding_scale=round(
            word_embedding_scale(
                config.get("scale_word_embeddings", SAVED_BEFORE["scale_word_embeddings"]),
                config.get("position_embedding_type"),
                config["hidden_size"],
            ),
            4,
        )
        if "hidden_size" in config
        else None,
    )


def _transformers_pipelines() -> list[str]:
    """Tasks this transformers has a pipeline for (5.x dropped question-answering, for one)."""
    from transformers.pipelines import get_supported_tasks

    return get_supported_tasks()


def _dataset_text(facts: dict) -> str:
    if not facts.get("dataset"):
        return NOT_RECORDED
    parts = [f"`{facts['dataset']}`"]
    if facts.get("dataset_config"):
        parts.append(f"(configuration `{facts['dataset_config']}`)")
    if facts.get("dataset_split"):
        parts.append(f"split `{facts['dataset_split']}`")
    return " ".join(parts)


def _metric_id(name: str) -> str:
    """Trainer's `eval_accuracy` -> the metric id `accuracy`."""
    return name.removeprefix("eval_")


# The card's size row, as model_cards/model_card.md renders it.
_SIZE_ROW = re.compile(
    r"^\| Size \| (\d+) layers, hidden (\d+), (\d+) heads, feed-forward (\d+), vocabulary (\d+) \|$", re.MULTILINE
)
_SNIPPET_LOADER = re.compile(r"^model = (\w+)\.from_pretrained\(", re.MULTILINE)
_SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def _is_quality_metric(name: str) -> bool:
    """A metric that belongs in the model-index: not Trainer's bookkeeping, not a training-set number, not a
    baseline."""
    return not name.endswith(BOOKKEEPING_SUFFIXES) and not name.startswith(("train_", *BASELINE_PREFIXES))


def validate_model_card(card: ModelCard, model_dir: str | os.PathLike) -> None:
    """Check a rendered card against the model it describes, offline; ValueError listing each problem.

    The text must re-parse with `huggingface_hub` (which rejects a malformed model-index), and what
    it states must agree with `model_dir`'s `config.json` and `training_facts.json`: the task it
    advertises (pipeline_tag, model-index task) is the one the saved head performs, the usage snippet
    loads that head, the size row is the config's, and the model-index holds exactly the run's
    quality metrics, bit for bit. `ModelCard.validate()` (the Hub's own YAML check, a network call)
    runs as well in `push_model_dir` before an upload."""
    model_dir = Path(model_dir)
    config, facts = load_config_dict(model_dir), load_training_facts(model_dir)
    parsed = ModelCard(str(card), ignore_metadata_errors=False)
    data, problems = parsed.data, []

    architecture = (config.get("architectures") or ["BertImplModel"])[0]
    if architecture not in HEAD_INFO:
        raise ValueError(
            f"{model_dir / 'config.json'}: unknown architecture {architecture!r}; expected one of {sorted(HEAD_INFO)}"
        )
    auto_class, head_task = HEAD_INFO[architecture]
    expected_tag = head_task if head_task in PIPELINE_TAGS else None
    if data.get("pipeline_tag") != expected_tag:
        problems.append(
            f"pipeline_tag is {data.get('pipeline_tag')!r}, but config.json's head {architecture} "
            f"does {head_task!r} (pipeline_tag {expected_tag!r})"
        )
    if f"| Head | `{architecture}` (load with `{auto_class}`) |" not in parsed.text:
        problems.append(
            f"the head row does not name config.json's head {architecture} and its Auto class {auto_class}"
        )
    loaders = set(_SNIPPET_LOADER.findall(parsed.text))
    if loaders != {auto_class}:
        problems.append(
            f"the usage snippets load the model with {sorted(loaders)}, not with {auto_class}, "
            f"the Auto class of {architecture}"
        )

    size = _SIZE_ROW.search(parsed.text)
    stated = dict(zip(_SIZE_FIELDS, map(int, size.groups()))) if size else None
    wanted = {k: config.get(k) for k in _SIZE_FIELDS}
    if stated != wanted:
        problems.append(f"the size row states {stated}, but config.json has {wanted}")

    results = data.eval_results or []
    indexed = {r.metric_name: r.metric_value for r in results}
    recorded = (
        {k: v for k, v in (facts.get("metrics") or {}).items() if _is_quality_metric(k)}
        if facts.get("dataset")
        else {}
    )
    if indexed != recorded or len(results) != len(indexed):
        problems.append(
            f"model-index metrics {indexed} are not the run's quality metrics {recorded} (training_facts.json)"
        )
    for result in results:
        if result.task_type != head_task or result.dataset_name != facts.get("dataset"):
            problems.append(
                f"model-index result {result.metric_name!r} is for task {result.task_type!r} on "
                f"{result.dataset_name!r}, but the run trained {architecture} ({head_task!r}) "
                f"on {facts.get('dataset')!r}"
            )
    if problems:
        raise ValueError(f"model card of {model_dir} disagrees with the model: " + "; ".join(problems))


def save_model_card(model_dir: str | os.PathLike, repo_id: str | None = None) -> Path:
    """Render the model card of `model_dir` into `model_dir/README.md` and return that path."""
    card = build_model_card(model_dir, repo_id=repo_id)
    validate_model_card(card, model_dir)
    path = Path(model_dir) / CARD_FILE
    card.save(path)
    return path


# --------------------------------------------------------------------------------------------
# the push


def check_repo_id(repo_id) -> str:
    """`repo_id` if it is a well-formed OWNER/NAME Hub model id; ValueError saying why otherwise."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(repo_id, str) or repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"repo id {repo_id!r} is malformed: expected OWNER/NAME, e.g. alice/bert-impl-mlm")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"repo id {repo_id!r} is malformed: {err}") from None
    return repo_id


def check_model_dir(model_dir: str | os.PathLike) -> dict:
    """Everything a push needs from `model_dir`, checked before any work; returns its config dict.

    Needs config.json (model_type bert_impl), safetensors weights and a tokenizer; refuses pickled
    weights (`.bin`, `.pt`, ...) because the Hub copy must load without unpickling.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"--model-dir {str(model_dir)!r} is not a directory")
    config = load_config_dict(model_dir)
    if not (model_dir / "model.safetensors").is_file() and not (model_dir / "model.safetensors.index.json").is_file():
        pickled = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"))
        if pickled:
            raise ValueError(
                f"{model_dir} holds weights in {pickled[0]!r}, which is not safetensors; load the model and save it "
                f"again with model.save_pretrained(dir) (which writes model.safetensors), then push that"
            )
        raise ValueError(f"{model_dir} has no model.safetensors; save the model there with model.save_pretrained(dir)")
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "vocab.txt")):
        raise ValueError(
            f"{model_dir} has no tokenizer (tokenizer.json or vocab.txt); save the tokenizer used in training "
            f"there with tokenizer.save_pretrained(dir)"
        )
    architectures = config.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in HEAD_INFO:
        raise ValueError(
            f"{model_dir / 'config.json'}: architectures {architectures!r} must name one of {sorted(HEAD_INFO)}"
        )
    return config


def build_upload_folder(model_dir: str | os.PathLike, repo_id: str, out: str | os.PathLike) -> list[str]:
    """Write into `out` exactly the files a push of `model_dir` to `repo_id` uploads; returns their
    relative paths, sorted.

    The model is loaded with its own class and saved again with `save_pretrained`, so the weights
    are safetensors, `config.json` carries `auto_map` for every head and the code files are this
    package's (the one copy of the model) rather than whatever sat in the directory.
    """
    import hf_bert_impl

    model_dir, out = Path(model_dir), Path(out)
    check_repo_id(repo_id)
    config = check_model_dir(model_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(
            f"output folder {str(out)!r} is not empty; pick a new folder so that it holds exactly the upload"
        )
    out.mkdir(parents=True, exist_ok=True)

    model_cls = getattr(hf_bert_impl, config["architectures"][0])
    model = model_cls.from_pretrained(model_dir)
    model.save_pretrained(out)
    copy_tokenizer_files(model_dir, out)
    loss_curve = load_training_facts(model_dir).get("loss_curve")
    if loss_curve:
        shutil.copy2(model_dir / loss_curve, out / loss_curve)
    card = build_model_card(model_dir, repo_id=repo_id)
    validate_model_card(card, model_dir)
    card.save(out / CARD_FILE)

    saved = load_config_dict(out)
    missing = {k: v for k, v in AUTO_MAP.items() if saved.get("auto_map", {}).get(k) != v}
    if missing or not all((out / name).is_file() for name in CODE_FILES):
        raise RuntimeError(f"save_pretrained wrote an incomplete Hub folder in {out}: auto_map lacks {missing}")
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())


def _login_hint() -> str:
    return "log in with `hf auth login` (or set HF_TOKEN to a write token from https://huggingface.co/settings/tokens)"


def push_model_dir(
    model_dir: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: str | os.PathLike | None = None,
    token: str | None = None,
):
    """Push a saved bert_impl model directory to the Hub as `repo_id`.

    Checks the repo id, the directory and (unless `dry_run`) the login before building anything.
    With `dry_run=OUT` it writes the upload folder to OUT and returns OUT's file list, uploading
    nothing; otherwise it returns the `CommitInfo` of the upload.
    """
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    check_repo_id(repo_id)
    check_model_dir(model_dir)
    if dry_run is not None:
        return build_upload_folder(model_dir, repo_id, dry_run)

    token = token or get_token()
    if not token:
        raise ValueError(f"not logged in to the Hugging Face Hub: {_login_hint()}; --dry-run OUT needs no token")
    api = HfApi(token=token)
    try:
        user = api.whoami()
    except OfflineModeIsEnabled:
        raise ValueError("HF_HUB_OFFLINE is set, so nothing can be uploaded: unset it, or use --dry-run OUT") from None
    except HfHubHTTPError as err:
        status = getattr(err.response, "status_code", None)
        if status == 401:
            raise ValueError(f"the Hugging Face token was rejected (401): {_login_hint()}") from None
        raise
    owner = repo_id.split("/")[0]
    allowed = {user.get("name")} | {org.get("name") for org in user.get("orgs") or []}
    if owner not in allowed:
        raise ValueError(
            f"logged in as {user.get('name')!r}, who cannot write to {owner!r}; pushable owners: {sorted(allowed)}"
        )

    with tempfile.TemporaryDirectory(prefix="bert_impl_push_") as tmp:
        build_upload_folder(model_dir, repo_id, tmp)
        # The Hub's own metadata check (a request to /api/validate-yaml) before any upload.
        ModelCard.load(Path(tmp) / CARD_FILE).validate()
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=tmp,
            repo_type="model",
            revision=revision,
            commit_message=commit_message or "Upload bert_impl model with hf-bert-impl",
        )


__all__ = [
    "NOT_RECORDED",
    "build_model_card",
    "build_upload_folder",
    "check_model_dir",
    "check_repo_id",
    "copy_tokenizer_files",
    "load_training_facts",
    "push_model_dir",
    "save_model_card",
    "validate_model_card",
]
