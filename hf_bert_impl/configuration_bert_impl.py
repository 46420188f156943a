"""BertImplConfig: the configuration of hf-bert-impl's BERT encoder.

Field names and defaults follow `transformers.BertConfig` (bert-base sizes), plus
`position_embedding_type`: "sinusoidal" (default, Vaswani et al. 2017's formula) or "learned" (a trained
table, as in Google's BERT). Every field is validated at construction and again on every later
assignment (`config.hidden_size = ...`, `from_pretrained(dir, hidden_size=...)` overrides); a bad
value raises a `ValueError` that names the field, the value and what is accepted, and leaves the
config as it was.

`check_inputs` checks a model input against the config (ids in range, shapes, positions) with errors that name
the value. This file travels to the Hub beside `modeling_bert_impl.py`: it imports only torch and transformers. Both
files run on transformers 4.57.x and 5.x; an older transformers gets one ImportError naming the
version needed (`require_transformers`), raised here because transformers imports this file first.
"""

import re
from typing import NamedTuple

import torch
import transformers
from transformers import PretrainedConfig

# The oldest transformers the Hub files run on (4.57 is the last v4 line). Checked at import.
MIN_TRANSFORMERS = (4, 57, 0)


def require_transformers(version: str = transformers.__version__) -> None:
    """Raise one ImportError naming the transformers needed when `version` is older than
    MIN_TRANSFORMERS (instead of an ImportError of some name a newer transformers added)."""
    found = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
    if found < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(
            f"this bert_impl model needs transformers>={need} (4.57.x or any 5.x), but transformers {version} "
            f"is installed; upgrade it: pip install -U 'transformers>={need}'"
        )


require_transformers()

POSITION_EMBEDDING_TYPES = ("sinusoidal", "learned")
# Activations the feed-forward block accepts (names from transformers.activations.ACT2FN).
HIDDEN_ACTS = ("gelu", "gelu_new", "gelu_python", "gelu_pytorch_tanh", "relu", "silu", "swish", "tanh", "quick_gelu")


class Head(NamedTuple):
    """One head, by name: our class, the Auto class that loads it, transformers' matching Bert class,
    and its task (the Hub `pipeline_tag` where the Hub has one)."""

    name: str
    auto_class: str
    hf_class: str
    task: str


# The one table of heads. The auto map below, the package's exports and Auto registration
# (`hf_bert_impl.HEADS`), the model card's task info (`hub.HEAD_INFO`) and the converter's
# architectures (`convert.ARCHITECTURES`) are all read off it. Names only: this file travels to
# the Hub and imports nothing but transformers.
HEAD_TABLE = (
    Head("BertImplModel", "AutoModel", "BertModel", "feature-extraction"),
    Head("BertImplForMaskedLM", "AutoModelForMaskedLM", "BertForMaskedLM", "fill-mask"),
    # tagged fill-mask as Google's BERT is; its output has no `logits`, so the card's fill-mask
    # pipeline loads the MLM head from it (hub.PIPELINE_HEAD)
    Head("BertImplForPreTraining", "AutoModelForPreTraining", "BertForPreTraining", "fill-mask"),
    Head("BertImplForNextSentencePrediction", "AutoModelForNextSentencePrediction", "BertForNextSentencePrediction",
         "next-sentence-prediction"),
    Head("BertImplForSequenceClassification", "AutoModelForSequenceClassification", "BertForSequenceClassification",
         "text-classification"),
    Head("BertImplForTokenClassification", "AutoModelForTokenClassification", "BertForTokenClassification",
         "token-classification"),
    Head("BertImplForQuestionAnswering", "AutoModelForQuestionAnswering", "BertForQuestionAnswering",
         "question-answering"),
    Head("BertImplForMultipleChoice", "AutoModelForMultipleChoice", "BertForMultipleChoice", "multiple-choice"),
)

# Where each Auto class finds our code inside a saved / pushed directory. Written into every
# config.json so that one repository serves every head through `trust_remote_code=True`.
AUTO_MAP = {
    "AutoConfig": "configuration_bert_impl.BertImplConfig",
    **{head.auto_class: f"modeling_bert_impl.{head.name}" for head in HEAD_TABLE},
}

# Named sizes. "debug" is the odd-sized flavour every smoke test uses (torchtitan's habit);
# the others are the published BERT / Turc et al. (2019) sizes.
SIZE_PRESETS = {
    "debug": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "mini": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048),
    "medium": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=2048),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


# Fields that decide the shape or the numerics of the weights. A saved config must state each one:
# a default silently filled in would load the weights into a different model.
REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "hidden_act", "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "position_embedding_type",
)
# Every field `_validate_bert_impl` checks: assigning one of them after construction re-validates.
VALIDATED_FIELDS = frozenset(REQUIRED_FIELDS + (
    "hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout", "initializer_range",
    "pad_token_id", "scale_word_embeddings", "sparse_prediction", "kernels",
))
# Fields added after configs were first saved, with the value that reproduces a checkpoint saved without them.
SAVED_BEFORE = {"scale_word_embeddings": False}  # 0.3.x added the encoding to unscaled word embeddings
# Speed switches of 0.3.x that `kernels` replaced: dropped from a saved config.json (they never changed the numbers).
RETIRED_FIELDS = ("unpad_inputs", "onednn_linear")
# config.kernels: "auto", "reference", or names of kernels_bert_impl.py's kernels to force (a list, or comma-separated)
KERNEL_NAMES = ("onednn_linear", "fused_activation", "skip_zero_rows", "bits_dropout", "unpadded", "per_sequence_attention",
                "grid_attention")


def kernel_names(setting) -> frozenset | str:
    """config.kernels -> "auto", "reference", or the frozenset of forced kernel names; ValueError naming a bad value."""
    if setting in ("auto", "reference"):
        return setting
    names = [s.strip() for s in setting.split(",")] if isinstance(setting, str) else \
        list(setting) if isinstance(setting, (list, tuple, set, frozenset)) else []
    unknown = [n for n in names if not isinstance(n, str) or n not in KERNEL_NAMES]
    if not names or unknown:
        raise ValueError(f"BertImplConfig.kernels must be 'auto', 'reference' or kernel names from {KERNEL_NAMES} "
                         f"(comma-separated), got {setting!r}")
    return frozenset(names)


def word_embedding_scale(scale_word_embeddings, position_embedding_type: str, hidden_size: int) -> float:
    """√hidden_size where the word embeddings are scaled (None: with sinusoidal positions), else 1.0. Also read off a
    config.json's fields (model cards), where a missing `scale_word_embeddings` is SAVED_BEFORE's."""
    if scale_word_embeddings is None:
        scale_word_embeddings = position_embedding_type == "sinusoidal"
    return hidden_size**0.5 if scale_word_embeddings else 1.0


# Instance flag set once __init__ has validated; kept out of config.json by `to_dict`.
_READY = "_bert_impl_validated"


class BertImplConfig(PretrainedConfig):
    r"""Configuration of a [`BertImplModel`] and its heads.

    Args:
        vocab_size: number of WordPiece tokens; input ids must lie in `[0, vocab_size)`.
        hidden_size: d_model, the width of every token vector.
        num_hidden_layers: number of post-LN Transformer encoder layers.
        num_attention_heads: h; must divide `hidden_size` (head dim d_k = hidden_size / h).
        intermediate_size: width of the feed-forward block.
        hidden_act: feed-forward activation (one of `HIDDEN_ACTS`).
        hidden_dropout_prob: dropout on embeddings and on each sub-layer output, in [0, 1).
        attention_probs_dropout_prob: dropout on the attention probabilities, in [0, 1).
        max_position_embeddings: rows of the position table. With "learned" positions this is the
            longest sequence accepted; with "sinusoidal" positions longer inputs work (the encoding
            is computed for any position).
        type_vocab_size: number of segment (token type) ids.
        initializer_range: std of the normal(0, std) initialisation of weights.
        layer_norm_eps: LayerNorm epsilon.
        pad_token_id: id of [PAD].
        classifier_dropout: dropout before classification heads (None: `hidden_dropout_prob`).
        position_embedding_type: "sinusoidal" (PE(pos, 2i) = sin(pos / 10000^{2i/d}),
            PE(pos, 2i+1) = cos(...), not stored in checkpoints) or "learned" (a trained table).
        scale_word_embeddings: multiply the word embeddings by √d_model (√hidden_size) before the positions
            are added, as Vaswani et al. (2017, section 3.4) do for their fixed encoding. None (default):
            True with sinusoidal positions, False with learned ones (Devlin et al. 2019 add a table of the
            same 0.02 scale, unscaled). Without it the unit-amplitude encoding drowns the word signal of
            normal(0, 0.02)-initialised embeddings and pretraining stalls (docs/formulas.md). A config.json
            saved without this field (0.3.x) loads as False: it computes as it did.

    Speed switch (it changes how the same numbers are computed, never the formula):
        sparse_prediction: when MLM labels are given, run the decoder only on labelled positions;
            `logits` is then (n_labelled, V). Default False (transformers' full (b, s, V) logits);
            `scripts/pretrain_mlm.py` turns it on while training.
        kernels: the speed paths of kernels_bert_impl.py. "auto" (default): each is chosen by timing it
            against the plain model's code on the running machine, once per shape class (and kept only if
            it agrees within its tolerance); "reference": the plain model alone (padded batches, torch's
            F.linear and F.dropout); kernel names, comma-separated (e.g. "onednn_linear,bits_dropout"):
            force those, the reference elsewhere.
    """

    model_type = "bert_impl"

    def __init__(
        self,
        vocab_size=30522,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        hidden_act="gelu",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        max_position_embeddings=512,
        type_vocab_size=2,
        initializer_range=0.02,
        layer_norm_eps=1e-12,
        pad_token_id=0,
        classifier_dropout=None,
        position_embedding_type="sinusoidal",
        scale_word_embeddings=None,
        sparse_prediction=False,
        kernels="auto",
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.initializer_range = initializer_range
        self.layer_norm_eps = layer_norm_eps
        self.classifier_dropout = classifier_dropout
        self.position_embedding_type = position_embedding_type
        self.scale_word_embeddings = scale_word_embeddings
        self.sparse_prediction = sparse_prediction
        self.kernels = kernels
        for name in RETIRED_FIELDS:
            kwargs.pop(name, None)
        kwargs.setdefault("tie_word_embeddings", True)
        kwargs.setdefault("auto_map", dict(AUTO_MAP))
        super().__init__(pad_token_id=pad_token_id, **kwargs)
        self._validate_bert_impl()
        object.__setattr__(self, _READY, True)

    def __setattr__(self, key, value):
        """Assignments after construction are validated as in `__init__` (transformers' `from_pretrained`
        applies `hidden_size=...` style overrides with setattr). A rejected value is rolled back."""
        if key not in VALIDATED_FIELDS or not self.__dict__.get(_READY, False):
            return super().__setattr__(key, value)
        missing = object()
        before = self.__dict__.get(key, missing)
        super().__setattr__(key, value)
        try:
            self._validate_bert_impl()
        except ValueError:
            if before is missing:
                self.__dict__.pop(key, None)
            else:
                super().__setattr__(key, before)
            raise

    @property
    def word_embedding_scale(self) -> float:
        """The factor the word embeddings are multiplied by: √hidden_size or 1.0 (see `scale_word_embeddings`)."""
        return word_embedding_scale(self.scale_word_embeddings, self.position_embedding_type, self.hidden_size)

    def to_dict(self):
        out = super().to_dict()
        out.pop(_READY, None)
        return out

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "BertImplConfig":
        """A config of a named size (`SIZE_PRESETS`: debug, tiny, mini, small, medium, base, large)."""
        if name not in SIZE_PRESETS:
            raise ValueError(f"unknown size preset {name!r}; choose one of {sorted(SIZE_PRESETS)}")
        return cls(**{**SIZE_PRESETS[name], **overrides})

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """transformers' reader, refusing a config.json of another model type (transformers only warns,
        then builds our model with defaults and random weights)."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        model_type, source = config_dict.get("model_type"), str(pretrained_model_name_or_path)
        if model_type == "bert":
            raise ValueError(
                f"{source} is a transformers BERT checkpoint (model_type='bert'), not a bert_impl one; convert it "
                f"first: hf_bert_impl.convert.from_hf_bert({source!r}) in Python, or "
                f"`python scripts/convert_checkpoint.py --from-hf {source} --out DIR`"
            )
        if model_type != cls.model_type:
            raise ValueError(
                f"the config.json of {source} has model_type={model_type!r}; BertImplConfig loads only "
                f"model_type={cls.model_type!r} checkpoints"
            )
        return config_dict, kwargs

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """transformers' `from_dict`; a saved config (one that carries our model_type, as every config.json
        does) must state each of `REQUIRED_FIELDS`."""
        if config_dict.get("model_type") == cls.model_type:
            missing = [f for f in REQUIRED_FIELDS if f not in config_dict and f not in kwargs]
            if missing:
                raise ValueError(
                    f"bert_impl config is missing required field(s) {missing}; a saved config.json must state "
                    "them (save it again with save_pretrained, or add them by hand)"
                )
            config_dict = {**SAVED_BEFORE, **config_dict}
        return super().from_dict(config_dict, **kwargs)

    def check_inputs(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None) -> tuple[int, int]:
        """The (b, s) of a model input (tensors). Inputs that torch would reject with an opaque IndexError raise a
        ValueError naming the value. Skipped while compiling (data-dependent checks break the graph); on an accelerator
        the value checks are asynchronous device asserts (`_check_range`), not a host sync per forward."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        shape = tuple(input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1])
        if len(shape) != 2:
            raise ValueError(f"input_ids must have shape (batch, sequence), got {shape}")
        if torch.compiler.is_compiling():
            return shape
        config = self
        if 0 in shape:
            raise ValueError(f"the input has an empty dimension: shape {shape}; pass at least one sequence of one token")
        for name, t in (("input_ids", input_ids), ("token_type_ids", token_type_ids), ("position_ids", position_ids)):
            if t is not None and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
                raise ValueError(f"{name} must hold integer ids, got dtype {t.dtype}")
        if inputs_embeds is not None and inputs_embeds.shape[-1] != config.hidden_size:
            raise ValueError(f"inputs_embeds has width {inputs_embeds.shape[-1]} but config.hidden_size = {config.hidden_size}")
        for name, t, hint in (("token_type_ids", token_type_ids, "token type ids"),
                              ("attention_mask", attention_mask, "mask of 1 for tokens and 0 for padding")):
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)} but the input has shape {shape}; pass a (batch, sequence) {hint}")
        for name, ids, field_name in (("input_ids", input_ids, "vocab_size"), ("token_type_ids", token_type_ids, "type_vocab_size")):
            if ids is not None:
                limit = getattr(config, field_name)
                rule = f"outside [0, {field_name}={limit}); check that the tokenizer matches this model (config.{field_name} = {limit})"
                _check_range(ids, 0, limit, f"{name} contains {{}}, {rule}", f"{name} contains an id {rule}")
        if attention_mask is not None:
            binary, message = attention_mask.eq(0) | attention_mask.eq(1), "attention_mask must hold 1 for tokens and 0 for padding, got"
            if not _values_on_host(attention_mask):
                _device_assert(binary.all(), f"{message} other values")
            elif not binary.all():
                values = attention_mask.unique().tolist()
                raise ValueError(f"{message} values {values[:8]}" + " ..." * (len(values) > 8))
        if position_ids is not None:
            pshape = tuple(position_ids.shape)
            if len(pshape) != 2 or pshape[1] != shape[1] or pshape[0] not in (1, shape[0]):
                raise ValueError(f"position_ids has shape {pshape}; pass (batch, sequence) or (1, sequence) for input shape {shape}")
            message = "position_ids contains {}; positions start at 0"
            _check_range(position_ids, 0, None, message, message.format("a negative value"))
        if config.position_embedding_type == "learned":
            limit = config.max_position_embeddings
            message = (f"sequence needs position {{}} but learned positions stop at max_position_embeddings - 1 = {limit - 1}; "
                       "truncate the input (tokenizer(..., truncation=True)) or use position_embedding_type='sinusoidal'")
            if position_ids is None and shape[1] > limit:
                raise ValueError(message.format(shape[1] - 1))
            if position_ids is not None:
                _check_range(position_ids, None, limit, message, message.format(f">= {limit}"))
        return shape

    def _validate_bert_impl(self):
        def positive_int(field):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BertImplConfig.{field} must be a positive integer, got {value!r}")

        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            positive_int(field)
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"BertImplConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads}); pick a head count that divides it"
            )
        for field in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, field)
            if value is None and field == "classifier_dropout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"BertImplConfig.{field} must be a probability in [0, 1), got {value!r}")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            hint = " (transformers' 'absolute' is our 'learned')" if self.position_embedding_type == "absolute" else ""
            raise ValueError(
                f"BertImplConfig.position_embedding_type must be one of {POSITION_EMBEDDING_TYPES}, "
                f"got {self.position_embedding_type!r}{hint}"
            )
        if not (self.scale_word_embeddings is None or isinstance(self.scale_word_embeddings, bool)):
            raise ValueError(f"BertImplConfig.scale_word_embeddings must be None, True or False, got {self.scale_word_embeddings!r}")
        if not isinstance(self.sparse_prediction, bool):
            raise ValueError(f"BertImplConfig.sparse_prediction must be True or False, got {self.sparse_prediction!r}")
        kernel_names(self.kernels)
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"BertImplConfig.hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        for field in ("initializer_range", "layer_norm_eps"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"BertImplConfig.{field} must be a positive number, got {value!r}")
        pad = self.pad_token_id
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < self.vocab_size):
            raise ValueError(
                f"BertImplConfig.pad_token_id must be an id in [0, vocab_size={self.vocab_size}) or None, got {pad!r}"
            )


# Checks of model inputs against a config (`BertImplConfig.check_inputs`).


def _values_on_host(t: torch.Tensor) -> bool:  # may a check read t's values? on the CPU; an accelerator would sync
    return t.device.type == "cpu"


def _device_assert(condition: torch.Tensor, message: str) -> None:  # no host sync: a failure raises at the next sync
    torch._assert_async(condition, message)


def _check_range(t: torch.Tensor, low: int | None, high: int | None, message: str, device_message: str) -> None:
    """ValueError(message.format(the bad value)) unless low <= t < high (None: no bound); on an accelerator an async assert."""
    has_low, has_high = low is not None, high is not None  # which bounds apply
    if not _values_on_host(t):
        _device_assert(((t >= low if has_low else True) & (t < high if has_high else True)).all(), device_message)
        return
    lo, hi = int(t.min()), int(t.max())
    if has_low and lo < low or has_high and hi >= high:
        raise ValueError(message.format(lo if has_low and lo < low else hi))


__all__ = ["BertImplConfig", "SIZE_PRESETS", "AUTO_MAP", "HEAD_TABLE", "REQUIRED_FIELDS"]
