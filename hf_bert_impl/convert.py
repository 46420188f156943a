"""Two-way conversion between transformers' BERT checkpoints and hf-bert-impl.

    from hf_bert_impl.convert import from_hf_bert, to_hf_bert
    ours = from_hf_bert("path/to/bert-checkpoint")   # or a Hub id, or an in-memory transformers Bert* model
    theirs = to_hf_bert(ours)                         # a plain transformers Bert* model

The state dict goes through one declarative key table (`HF_TO_BERT_IMPL`, torchtitan's habit): every
transformers key either maps to one of ours, is dropped on purpose (`None`), or is one third of our
fused attention projection (`JOINED_QKV`). A checkpoint key that matches no row, or a weight our
model needs that the checkpoint lacks, is a `ValueError` that lists the keys: never a silent random
init. Shapes are checked key by key. The conversion is exact (copies and a concatenation / split),
so from -> to -> from is bit-identical.

Keys are written in the "full" space of a model with a head (`bert.` prefix on the encoder);
a bare `BertModel` / `BertImplModel` checkpoint has no prefix and is normalised on the way in/out.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import BertConfig

from . import modeling_bert_impl
from .configuration_bert_impl import BertImplConfig
from .heads import HEAD_TABLE
from .hub import TOKENIZER_FILES
from .modeling_bert_impl import BertImplModel, BertImplPreTrainedModel


logger = logging.getLogger(__name__)

# transformers key -> our key, both in the full (prefixed) space; "{}" is the layer index.
# None: dropped on purpose (buffers that older transformers versions saved in checkpoints).
HF_TO_BERT_IMPL: dict[str, str | None] = {
    "bert.embeddings.word_embeddings.weight": "bert.embeddings.word_embeddings.weight",
    "bert.embeddings.position_embeddings.weight": "bert.embeddings.position_embeddings.weight",
    "bert.embeddings.token_type_embeddings.weight": "bert.embeddings.token_type_embeddings.weight",
    "bert.embeddings.LayerNorm.weight": "bert.embeddings.LayerNorm.weight",
    "bert.embeddings.LayerNorm.bias": "bert.embeddings.LayerNorm.bias",
    "bert.embeddings.position_ids": None,
    "bert.embeddings.token_type_ids": None,
    # attention.self.{query,key,value}: see JOINED_QKV
    "bert.encoder.layer.{}.attention.output.dense.weight": "bert.layers.{}.attn.Wo.weight",
    "bert.encoder.layer.{}.attention.output.dense.bias": "bert.layers.{}.attn.Wo.bias",
    "bert.encoder.layer.{}.attention.output.LayerNorm.weight": "bert.layers.{}.attn_norm.weight",
    "bert.encoder.layer.{}.attention.output.LayerNorm.bias": "bert.layers.{}.attn_norm.bias",
    "bert.encoder.layer.{}.intermediate.dense.weight": "bert.layers.{}.mlp.Wi.weight",
    "bert.encoder.layer.{}.intermediate.dense.bias": "bert.layers.{}.mlp.Wi.bias",
    "bert.encoder.layer.{}.output.dense.weight": "bert.layers.{}.mlp.Wo.weight",
    "bert.encoder.layer.{}.output.dense.bias": "bert.layers.{}.mlp.Wo.bias",
    "bert.encoder.layer.{}.output.LayerNorm.weight": "bert.layers.{}.mlp_norm.weight",
    "bert.encoder.layer.{}.output.LayerNorm.bias": "bert.layers.{}.mlp_norm.bias",
    "bert.pooler.dense.weight": "bert.pooler.dense.weight",
    "bert.pooler.dense.bias": "bert.pooler.dense.bias",
    "cls.predictions.transform.dense.weight": "lm_head.dense.weight",
    "cls.predictions.transform.dense.bias": "lm_head.dense.bias",
    "cls.predictions.transform.LayerNorm.weight": "lm_head.norm.weight",
    "cls.predictions.transform.LayerNorm.bias": "lm_head.norm.bias",
    "cls.predictions.decoder.weight": "lm_head.decoder.weight",
    "cls.predictions.decoder.bias": "lm_head.decoder.bias",
    # transformers keeps the MLM output bias twice: `cls.predictions.bias` and the decoder's own bias
    # (tied when tie_word_embeddings; see `_drop_tied_copies` for which one is the real one).
    "cls.predictions.bias": "lm_head.decoder.bias",
    "cls.seq_relationship.weight": "nsp_head.weight",
    "cls.seq_relationship.bias": "nsp_head.bias",
    "classifier.weight": "classifier.weight",
    "classifier.bias": "classifier.bias",
    "qa_outputs.weight": "qa_outputs.weight",
    "qa_outputs.bias": "qa_outputs.bias",
}

# Our fused projection Wqkv = cat([W^Q; W^K; W^V], dim=0) (weights and biases): joined from, and
# split back into, these three transformers keys, in this order.
JOINED_QKV: dict[str, tuple[str, str, str]] = {
    f"bert.layers.{{}}.attn.Wqkv.{p}": tuple(
        f"bert.encoder.layer.{{}}.attention.self.{n}.{p}" for n in ("query", "key", "value")
    )
    for p in ("weight", "bias")
}

# Checkpoints converted from Google's TensorFlow release name LayerNorm parameters gamma / beta.
LEGACY_SUFFIXES = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}

# transformers' tied copies when tie_word_embeddings (its BertForMaskedLM._tied_weights_keys):
# copy -> original. The copy is dropped on the way in; both are written on the way out.
HF_TIED = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}

# transformers architecture -> our class, read off the head table. Both directions use it.
ARCHITECTURES: dict[str, type[BertImplPreTrainedModel]] = {
    head.hf_class: getattr(modeling_bert_impl, head.name) for head in HEAD_TABLE
}
OUR_TO_HF_ARCH = {ours: hf for hf, ours in ARCHITECTURES.items()}

# Config fields with the same name and meaning on both sides.
SHARED_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "max_position_embeddings",
    "type_vocab_size",
    "initializer_range",
    "layer_norm_eps",
    "pad_token_id",
    "classifier_dropout",
    "tie_word_embeddings",
)
# Task labels; num_labels follows from id2label.
LABEL_FIELDS = ("id2label", "label2id", "problem_type")

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


# A sentence-transformers model directory: these files beside the weights, plus one folder per
# module that modules.json lists with a path (1_Pooling/, 2_Normalize/, ...). The module at path ""
# is the transformer itself (the weights and config.json the conversion rewrites).
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def copy_sentence_transformers_files(source_dir: str | Path, out: str | Path) -> list[str]:
    """Copy a sentence-transformers model's own files (modules.json, its settings such as
    max_seq_length, and the Pooling / Normalize / Dense module folders) from `source_dir` to `out`,
    so the converted checkpoint loads with `SentenceTransformer(out)` as the original did. Returns
    the names copied; [] when `source_dir` is not a sentence-transformers model (no modules.json)."""
    import shutil

    source_dir, out = Path(source_dir), Path(out)
    if not (source_dir / "modules.json").is_file():
        return []
    try:
        modules = json.loads((source_dir / "modules.json").read_text())
        paths = [m["path"] for m in modules]
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{source_dir / 'modules.json'} is not a sentence-transformers module list ({e})") from e
    copied = []
    for name in SENTENCE_TRANSFORMERS_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, out / name)
            copied.append(name)
    for path in paths:
        if path and (source_dir / path).is_dir():  # Normalize has no files, so often no folder
            shutil.copytree(source_dir / path, out / path, dirs_exist_ok=True)
            copied.append(path + "/")
    return copied


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{\}", r"(\d+)") + "$")


_ROWS = [(_pattern(src), dst) for src, dst in HF_TO_BERT_IMPL.items()]
_QKV_ROWS = [(_pattern(part), fused, i) for fused, parts in JOINED_QKV.items() for i, part in enumerate(parts)]


def _lookup(hf_key: str):
    """transformers key -> ("map", our key) | ("drop", None) | ("qkv", (fused key, 0|1|2)) | None."""
    for pattern, dst in _ROWS:
        m = pattern.match(hf_key)
        if m:
            return ("drop", None) if dst is None else ("map", dst.format(*m.groups()))
    for pattern, fused, i in _QKV_ROWS:
        m = pattern.match(hf_key)
        if m:
            return "qkv", (fused.format(*m.groups()), i)
    return None


def _hf_names(our_key: str) -> str:
    """Our key -> the transformers key(s) it comes from, for error messages."""
    for src, dst in HF_TO_BERT_IMPL.items():
        m = dst and _pattern(dst).match(our_key)
        if m:
            return src.format(*m.groups())
    for fused, parts in JOINED_QKV.items():
        m = _pattern(fused).match(our_key)
        if m:
            return " + ".join(part.format(*m.groups()) for part in parts)
    return our_key


def _layer_index(key: str) -> int | None:
    m = re.search(r"(?:encoder\.layer|layers)\.(\d+)\.", key)
    return int(m.group(1)) if m else None


def _is_base(model_cls) -> bool:
    return model_cls is BertImplModel or model_cls is transformers.BertModel


# ----------------------------------------------------------------------------------------------
# Configs


def bert_impl_config_from_hf(hf_config: BertConfig) -> BertImplConfig:
    """transformers BertConfig -> BertImplConfig, field by field; positions "absolute" -> "learned"."""
    if getattr(hf_config, "model_type", "bert") != "bert":
        raise ValueError(f"expected a BERT config (model_type 'bert'), got model_type {hf_config.model_type!r}")
    positions = getattr(hf_config, "position_embedding_type", "absolute")
    if positions != "absolute":
        raise ValueError(
            f"position_embedding_type {positions!r} is not supported: hf-bert-impl converts BERT with "
            "absolute (learned) positions only"
        )
    for flag in ("is_decoder", "add_cross_attention"):
        if getattr(hf_config, flag, False):
            raise ValueError(f"config.{flag}=True: hf-bert-impl is an encoder only; cannot convert a BERT decoder")
    kw = {f: getattr(hf_config, f) for f in SHARED_CONFIG_FIELDS if hasattr(hf_config, f)}
    kw.update({f: getattr(hf_config, f) for f in LABEL_FIELDS if getattr(hf_config, f, None) is not None})
    return BertImplConfig(position_embedding_type="learned", **kw)


def hf_config_from_bert_impl(config: BertImplConfig) -> BertConfig:
    """BertImplConfig -> transformers BertConfig (both position types become transformers' absolute table)."""
    kw = {f: getattr(config, f) for f in SHARED_CONFIG_FIELDS if hasattr(config, f)}
    kw.update({f: getattr(config, f) for f in LABEL_FIELDS if getattr(config, f, None) is not None})
    return BertConfig(**kw)


# ----------------------------------------------------------------------------------------------
# Reading checkpoints


def resolve_source_dir(source: str | Path) -> Path:
    """A local checkpoint directory as given, or a Hub id downloaded (safetensors preferred; the
    `.bin` weights only when the repository has no safetensors)."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(
            f"{str(source)!r} is a file, not a checkpoint directory; pass the directory that holds config.json"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(str(source))
    except HFValidationError:
        raise ValueError(f"no such directory: {str(source)!r} (and it is not a Hub id either)") from None
    try:
        patterns = [
            "config.json",
            "*.safetensors",
            "*.safetensors.index.json",
            *TOKENIZER_FILES,
            *SENTENCE_TRANSFORMERS_FILES,
            "*/config.json",
        ]  # sentence-transformers modules too
        local = Path(snapshot_download(str(source), allow_patterns=patterns))
        if not any((local / f).exists() for f in WEIGHT_FILES[:2]):
            local = Path(snapshot_download(str(source), allow_patterns=[*patterns, "pytorch_model.bin*"]))
        return local
    except Exception as e:  # offline, unknown repo, no access: one actionable message
        raise ValueError(
            f"no such directory: {str(source)!r}, and fetching it as a Hub id failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e


def read_hf_config(directory: Path) -> BertConfig:
    """config.json of a transformers BERT checkpoint; a clear error for anything else."""
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{str(directory)!r} has no config.json; is it a Hugging Face checkpoint directory?")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON ({e})") from e
    model_type = raw.get("model_type")
    if model_type == "bert_impl":
        raise ValueError(
            f"{str(directory)!r} is already an hf-bert-impl checkpoint (model_type 'bert_impl'); load it with "
            "AutoModel.from_pretrained(..., trust_remote_code=True) or convert it with to_hf_bert"
        )
    if model_type != "bert":
        raise ValueError(
            f"{str(directory)!r} is a {model_type!r} checkpoint, not a BERT one (model_type 'bert'); "
            "only transformers BERT checkpoints can be converted"
        )
    return BertConfig.from_pretrained(directory)


def _load_weight_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        # Never unpickle arbitrary objects from a downloaded file.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(
            f"cannot read weights file {path}: it is corrupt or truncated ({type(e).__name__}: {e})"
        ) from e


def read_hf_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: safetensors (single or sharded), else `.bin` loaded
    with `torch.load(weights_only=True)`."""
    for name in WEIGHT_FILES:
        path = directory / name
        if not path.is_file():
            continue
        if name.endswith(".index.json"):
            try:
                shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{path} is not a valid shard index ({e})") from e
            state = {}
            for shard in shards:
                if not (directory / shard).is_file():
                    raise ValueError(f"{path} lists shard {shard!r}, which is missing from {directory}")
                state.update(_load_weight_file(directory / shard))
            return state
        return _load_weight_file(path)
    raise ValueError(f"{str(directory)!r} holds no weights: looked for {', '.join(WEIGHT_FILES)}")


# ----------------------------------------------------------------------------------------------
# transformers -> ours


def _normalise_hf_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Bring a checkpoint into the full key space: `bert.` prefix for bare-BertModel keys, legacy
    gamma/beta LayerNorm names renamed."""
    out = {}
    for key, tensor in state.items():
        for old, new in LEGACY_SUFFIXES.items():
            if key.endswith(old):
                key = key[: -len(old)] + new
        if key.startswith(("embeddings.", "encoder.", "pooler.")):
            key = "bert." + key
        if key in out:
            raise ValueError(f"checkpoint holds key {key!r} twice (once under a legacy or unprefixed name)")
        out[key] = tensor
    return out


def _drop_tied_copies(state: dict[str, torch.Tensor], tied: bool) -> None:
    """Keep the one copy transformers' forward actually uses. Tied: the word embeddings and
    `cls.predictions.bias` (the decoder's are copies). Untied: the decoder's own weight and bias
    (`cls.predictions.bias` is then unused)."""
    if tied:
        for copy, original in HF_TIED.items():
            if copy in state and original in state:
                del state[copy]
            elif copy in state and copy.endswith("bias"):
                state[original] = state.pop(copy)  # only the decoder bias was saved: same tensor
    else:
        if "cls.predictions.decoder.bias" in state:
            state.pop("cls.predictions.bias", None)


def _architecture_of(config: BertConfig, keys) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        if all(k.startswith("bert.") for k in keys):
            return "BertModel"
        raise ValueError(
            "the checkpoint's config.json names no `architectures` and has head weights; "
            f"pass model_class= one of {[c.__name__ for c in ARCHITECTURES.values()]}"
        )
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"architecture {arch!r} has no hf-bert-impl counterpart; supported: {sorted(ARCHITECTURES)} "
            "(or pass model_class= to load its encoder into one of our heads)"
        )
    return arch


def convert_hf_state_dict(hf_state: dict[str, torch.Tensor], num_layers: int, tied: bool = True):
    """transformers tensors (any prefix) -> (our tensors in the full key space, dropped keys).
    Raises ValueError listing every key that matches no table row or a layer beyond `num_layers`."""
    state = _normalise_hf_keys(hf_state)
    _drop_tied_copies(state, tied)
    ours, dropped, unexpected = {}, [], []
    qkv_parts: dict[str, list] = {}
    for key, tensor in state.items():
        hit = _lookup(key)
        layer = _layer_index(key)
        if hit is None or (layer is not None and layer >= num_layers):
            unexpected.append(key)
        elif hit[0] == "drop":
            dropped.append(key)
        elif hit[0] == "map":
            ours[hit[1]] = tensor
        else:
            fused, i = hit[1]
            qkv_parts.setdefault(fused, [None, None, None])[i] = tensor
    if unexpected:
        raise ValueError(
            "checkpoint keys that match no row of the conversion table "
            f"(num_hidden_layers={num_layers}): {sorted(unexpected)}"
        )
    for fused, parts in qkv_parts.items():
        if any(p is None for p in parts):
            names = [n for n, p in zip(("query", "key", "value"), parts) if p is None]
            raise ValueError(f"cannot build {fused}: the checkpoint lacks its {'/'.join(names)} part(s)")
        ours[fused] = torch.cat(parts, dim=0)  # (3H, H) / (3H,): [W^Q; W^K; W^V]
    return ours, dropped


def _full_keys(model: nn.Module) -> dict[str, torch.Tensor]:
    prefix = "bert." if _is_base(type(model)) else ""
    return {prefix + k: v for k, v in model.state_dict().items()}


def from_hf_bert(source, model_class: type[BertImplPreTrainedModel] | None = None) -> BertImplPreTrainedModel:
    """A transformers BERT checkpoint -> the matching hf-bert-impl model, exactly.

    source: a local checkpoint directory, a Hub id, or an in-memory transformers Bert* model.
    model_class: one of our classes; by default the head matching the checkpoint's `architectures`
        (`ARCHITECTURES`). Choosing a different head loads the encoder: checkpoint head weights the
        new head has no use for are dropped, and head weights the checkpoint lacks start from a fresh
        init; both are logged by name. Encoder weights must always be complete.
    Returns the model in eval mode, in the checkpoint's floating dtype.
    Raises ValueError on a non-BERT checkpoint, unreadable weights, or any missing / unexpected /
    mis-shaped key (the message lists them).
    """
    if isinstance(source, transformers.BertPreTrainedModel):
        hf_config = source.config
        hf_state = dict(source.state_dict())
        arch = type(source).__name__
        if arch not in ARCHITECTURES:
            raise ValueError(f"{arch} has no hf-bert-impl counterpart; supported: {sorted(ARCHITECTURES)}")
    elif isinstance(source, nn.Module):
        raise ValueError(f"expected a transformers Bert* model, got {type(source).__name__}")
    elif isinstance(source, (str, Path)):
        directory = resolve_source_dir(source)
        hf_config = read_hf_config(directory)
        hf_state = read_hf_state_dict(directory)
        arch = None
    else:
        raise ValueError(
            f"source must be a directory, a Hub id or a transformers Bert* model, got {type(source).__name__}"
        )

    if model_class is not None and model_class not in OUR_TO_HF_ARCH:
        raise ValueError(f"model_class must be one of {[c.__name__ for c in OUR_TO_HF_ARCH]}, got {model_class!r}")
    config = bert_impl_config_from_hf(hf_config)
    ours, dropped = convert_hf_state_dict(hf_state, config.num_hidden_layers, tied=config.tie_word_embeddings)
    if arch is None:
        if model_class is not None and not getattr(hf_config, "architectures", None):
            arch = OUR_TO_HF_ARCH[model_class]  # an old config that names none: the caller's choice is the claim
        else:
            arch = _architecture_of(hf_config, _normalise_hf_keys(hf_state))
    matching = ARCHITECTURES[arch]
    model_class = model_class or matching

    kwargs = {}
    if model_class is BertImplModel and not any(k.startswith("bert.pooler.") for k in ours):
        kwargs["add_pooling_layer"] = False  # a BertModel saved without its pooler
    model = model_class(config, **kwargs)
    expected = _full_keys(model)
    tied_targets = set(getattr(model, "_tied_weights_keys", None) or {}) if config.tie_word_embeddings else set()

    missing = sorted(k for k in expected if k not in ours and k not in tied_targets)
    unused = sorted(k for k in ours if k not in expected)
    shape_errors = [
        f"{_hf_names(k)}: checkpoint {tuple(ours[k].shape)} vs config {tuple(expected[k].shape)}"
        for k in ours
        if k in expected and ours[k].shape != expected[k].shape
    ]
    if shape_errors:
        raise ValueError(f"shape mismatch for {len(shape_errors)} key(s): {shape_errors}")
    switching_head = model_class is not matching
    encoder_missing = [k for k in missing if k.startswith("bert.")]
    if encoder_missing or ((missing or unused) and not switching_head):
        raise ValueError(
            f"checkpoint ({arch}) does not fit {model_class.__name__}: missing keys "
            f"{[_hf_names(k) for k in missing]}, unexpected keys {[_hf_names(k) for k in unused]}"
        )
    if unused:
        logger.warning(
            "from_hf_bert: %s has no use for the %s head weights %s; dropped", model_class.__name__, arch, unused
        )
        for k in unused:
            del ours[k]
    if missing:
        logger.warning(
            "from_hf_bert: %s head weights %s are not in the %s checkpoint; freshly initialised",
            model_class.__name__,
            missing,
            arch,
        )
    if dropped:
        logger.info("from_hf_bert: dropped checkpoint buffers %s", dropped)

    prefix = "bert." if _is_base(model_class) else ""
    result = model.load_state_dict({k[len(prefix) :]: v for k, v in ours.items()}, strict=False)
    leftover = [k for k in result.missing_keys if prefix + k not in tied_targets and prefix + k not in missing]
    if leftover or result.unexpected_keys:
        raise ValueError(f"internal conversion error: missing {leftover}, unexpected {result.unexpected_keys}")
    dtype = ours["bert.embeddings.word_embeddings.weight"].dtype
    if dtype.is_floating_point and dtype != torch.float32:
        model = model.to(dtype)
    return model.eval()


# ----------------------------------------------------------------------------------------------
# ours -> transformers


def to_hf_bert(model: BertImplPreTrainedModel) -> transformers.BertPreTrainedModel:
    """An hf-bert-impl model -> the matching transformers Bert* model (exact inverse of `from_hf_bert`).

    Sinusoidal positions are written into transformers' learned table: identical outputs for inputs
    up to `max_position_embeddings` tokens. Word embeddings scaled by √d_model (`scale_word_embeddings`) are
    written scaled; a masked-LM decoder then keeps the unscaled table, untied (`tie_word_embeddings=False`).
    Returns the model in eval mode, in our model's dtype.
    """
    if not isinstance(model, BertImplPreTrainedModel) or type(model) not in OUR_TO_HF_ARCH:
        raise ValueError(f"to_hf_bert takes one of {[c.__name__ for c in OUR_TO_HF_ARCH]}, got {type(model).__name__}")
    config = model.config
    hf_cls = getattr(transformers, OUR_TO_HF_ARCH[type(model)])
    kwargs = {}
    if hf_cls is transformers.BertModel and model.pooler is None:
        kwargs["add_pooling_layer"] = False
    hf_config = hf_config_from_bert_impl(config)
    ours = _full_keys(model)
    scale = config.word_embedding_scale
    if scale != 1.0:  # transformers adds its word table unscaled: the √d_model is folded into the input table, and an
        word = ours["bert.embeddings.word_embeddings.weight"]  # MLM decoder keeps the unscaled one (the tie is undone)
        ours["bert.embeddings.word_embeddings.weight"] = word * scale
        if "lm_head.decoder.weight" in ours:
            ours["lm_head.decoder.weight"], hf_config.tie_word_embeddings = word, False
    hf_model = hf_cls(hf_config, **kwargs)
    if config.position_embedding_type == "sinusoidal":
        encoding = model.base_model.embeddings.position_encoding  # (P, H): the formula, evaluated once
        ours["bert.embeddings.position_embeddings.weight"] = encoding.to(
            ours["bert.embeddings.word_embeddings.weight"].dtype
        )
    hf_prefix = "bert." if _is_base(hf_cls) else ""
    hf_state, used, unmapped = {}, set(), []
    for hf_key in hf_model.state_dict():
        hit = _lookup(hf_prefix + hf_key)
        if hit is None or hit[0] == "drop":
            unmapped.append(hf_key)
        elif hit[0] == "map":
            if hit[1] not in ours:
                unmapped.append(hf_key)
                continue
            hf_state[hf_key] = ours[hit[1]]
            used.add(hit[1])
        else:
            fused, i = hit[1]
            if fused not in ours:
                unmapped.append(hf_key)
                continue
            hf_state[hf_key] = ours[fused].chunk(3, dim=0)[i]  # [W^Q; W^K; W^V] -> one of them
            used.add(fused)
    tied_targets = set(getattr(model, "_tied_weights_keys", None) or {}) if config.tie_word_embeddings else set()
    left = sorted(set(ours) - used - tied_targets)
    if unmapped or left:
        raise ValueError(f"to_hf_bert: {hf_cls.__name__} keys with no source {unmapped}; our keys not written {left}")
    hf_model.load_state_dict(hf_state, strict=True)
    dtype = ours["bert.embeddings.word_embeddings.weight"].dtype
    if dtype != torch.float32:
        hf_model = hf_model.to(dtype)
    return hf_model.eval()


__all__ = [
    "HF_TO_BERT_IMPL",
    "JOINED_QKV",
    "ARCHITECTURES",
    "from_hf_bert",
    "to_hf_bert",
    "bert_impl_config_from_hf",
    "hf_config_from_bert_impl",
    "read_hf_config",
    "resolve_source_dir",
    "read_hf_state_dict",
    "convert_hf_state_dict",
    "copy_sentence_transformers_files",
    "SENTENCE_TRANSFORMERS_FILES",
]
