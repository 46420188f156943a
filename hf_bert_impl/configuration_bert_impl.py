"""BertImplConfig: the configuration of hf-bert-impl's BERT encoder (travels to the Hub beside modeling_bert_impl.py).
Fields and defaults as `transformers.BertConfig`'s, plus three; each is checked at construction (a ValueError names the
field and value); checks coupling fields (hidden size divisible by the head count) run when the model is built."""

import re

import transformers
from transformers import PretrainedConfig


MIN_TRANSFORMERS = (4, 57, 0)  # the oldest transformers the Hub files run on (4.57 is the last v4 line)


def require_transformers(version: str = transformers.__version__) -> None:  # one ImportError naming what is needed
    if tuple(int(x) for x in re.findall(r"\d+", version)[:3]) < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(
            f"this bert_impl model needs transformers>={need} (4.57.x or any 5.x), but transformers "
            f"{version} is installed; upgrade it: pip install -U 'transformers>={need}'"
        )


require_transformers()

POSITION_EMBEDDING_TYPES = ("sinusoidal", "learned")
HIDDEN_ACTS = ("gelu", "gelu_new", "gelu_python", "gelu_pytorch_tanh", "relu", "silu", "swish", "tanh", "quick_gelu")
# Where each Auto class finds our code in a saved directory: one repository serves every head by trust_remote_code.
AUTO_MAP = {
    "AutoConfig": "configuration_bert_impl.BertImplConfig",
    "AutoModel": "modeling_bert_impl.BertImplModel",
    **{
        f"AutoModelFor{task}": f"modeling_bert_impl.BertImplFor{task}"
        for task in (
            "MaskedLM",
            "PreTraining",
            "NextSentencePrediction",
            "SequenceClassification",
            "TokenClassification",
            "QuestionAnswering",
            "MultipleChoice",
        )
    },
}
# Named sizes: "debug" (odd sizes) for smoke tests; the others are BERT's and Turc et al. (2019)'s.
SIZE_PRESETS = {
    "debug": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37},
    "tiny": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 512},
    "mini": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024},
    "small": {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "intermediate_size": 2048},
    "medium": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "intermediate_size": 2048},
    "base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
    "large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096},
}
# Fields that decide the weights' shapes or numerics: a saved config must state each (a default would silently load
# the weights into another model). SAVED_BEFORE: fields added later, with the value that reproduces an older save.
REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "max_position_embeddings",
    "type_vocab_size",
    "layer_norm_eps",
    "position_embedding_type",
)
SAVED_BEFORE = {"scale_word_embeddings": False}  # 0.3.x added the encoding to unscaled word embeddings
RETIRED_FIELDS = ("unpad_inputs", "onednn_linear", "kernels")  # speed switches of 0.3-0.5


def word_embedding_scale(scale_word_embeddings: bool | None, position_embedding_type: str, hidden_size: int) -> float:
    """√hidden_size where the word embeddings are scaled (None: with sinusoidal positions), else 1.0."""
    if scale_word_embeddings is None:
        scale_word_embeddings = position_embedding_type == "sinusoidal"
    return hidden_size**0.5 if scale_word_embeddings else 1.0


class BertImplConfig(PretrainedConfig):
    r"""Configuration of a [`BertImplModel`] and its heads. Arguments as `transformers.BertConfig`'s, plus:
    position_embedding_type: "sinusoidal" (Vaswani et al. 2017's PE(pos, 2i) = sin(pos / 10000^{2i/d}),
        PE(pos, 2i+1) = cos(...); not stored, any length) or "learned" (a table of `max_position_embeddings` rows).
    scale_word_embeddings: multiply the word embeddings by √hidden_size before the positions are added (Vaswani
        et al. 2017, §3.4). None (default): True with sinusoidal positions, False with learned ones.
    sparse_prediction: with labels given, the masked-LM heads run their prediction head on the labelled positions
        only (as ModernBERT's): logits (n, vocab_size) for the n labelled tokens, the same loss. Default False
        (logits (batch, sequence, vocab_size), as transformers' BERT); pretraining turns it on."""

    model_type = "bert_impl"

    def __init__(
        self,
        vocab_size: int = 30522,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        intermediate_size: int = 3072,
        hidden_act: str = "gelu",
        hidden_dropout_prob: float = 0.1,
        attention_probs_dropout_prob: float = 0.1,
        max_position_embeddings: int = 512,
        type_vocab_size: int = 2,
        initializer_range: float = 0.02,
        layer_norm_eps: float = 1e-12,
        pad_token_id: int | None = 0,
        classifier_dropout: float | None = None,
        position_embedding_type: str = "sinusoidal",
        scale_word_embeddings: bool | None = None,
        sparse_prediction: bool = False,
        **kwargs,
    ):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.intermediate_size = num_attention_heads, intermediate_size
        self.hidden_act, self.hidden_dropout_prob = hidden_act, hidden_dropout_prob
        self.attention_probs_dropout_prob, self.classifier_dropout = attention_probs_dropout_prob, classifier_dropout
        self.max_position_embeddings, self.type_vocab_size = max_position_embeddings, type_vocab_size
        self.initializer_range, self.layer_norm_eps = initializer_range, layer_norm_eps
        self.position_embedding_type, self.scale_word_embeddings = position_embedding_type, scale_word_embeddings
        self.sparse_prediction = sparse_prediction
        _validate(self, pad_token_id)
        for name in RETIRED_FIELDS:
            kwargs.pop(name, None)
        kwargs.setdefault("tie_word_embeddings", True)
        kwargs.setdefault("auto_map", dict(AUTO_MAP))
        super().__init__(pad_token_id=pad_token_id, **kwargs)

    @property
    def word_embedding_scale(self) -> float:
        """The factor the word embeddings are multiplied by: √hidden_size or 1.0 (see `scale_word_embeddings`)."""
        return word_embedding_scale(self.scale_word_embeddings, self.position_embedding_type, self.hidden_size)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "BertImplConfig":
        """A config of a named size (`SIZE_PRESETS`: debug, tiny, mini, small, medium, base, large)."""
        if name not in SIZE_PRESETS:
            raise ValueError(f"unknown size preset {name!r}; choose one of {sorted(SIZE_PRESETS)}")
        return cls(**{**SIZE_PRESETS[name], **overrides})

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """transformers' reader, refusing a config.json of another model type (transformers only warns)."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        model_type, source = config_dict.get("model_type"), str(pretrained_model_name_or_path)
        if model_type == "bert":
            raise ValueError(
                f"{source} is a transformers BERT checkpoint (model_type='bert'), not a bert_impl one; "
                f"convert it first: hf_bert_impl.convert.from_hf_bert({source!r}) in Python, or "
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
        """transformers' `from_dict`; a saved config (with our model_type) must state `REQUIRED_FIELDS`. Overrides of
        our fields (`from_pretrained(dir, hidden_size=...)`) are checked with the others."""
        fields = cls.__init__.__code__.co_varnames[1 : cls.__init__.__code__.co_argcount]
        config_dict = {**config_dict, **{k: kwargs.pop(k) for k in list(kwargs) if k in fields}}
        if config_dict.get("model_type") == cls.model_type:
            missing = [f for f in REQUIRED_FIELDS if f not in config_dict and f not in kwargs]
            if missing:
                raise ValueError(
                    f"bert_impl config is missing required field(s) {missing}; a saved config.json must "
                    "state them (save it again with save_pretrained, or add them by hand)"
                )
            config_dict = {**SAVED_BEFORE, **config_dict}
        return super().from_dict(config_dict, **kwargs)


def _validate(c: BertImplConfig, pad_token_id) -> None:
    """ValueError naming the first field whose value is not accepted, the value and what is."""

    def number(v, kinds=(int, float)):  # bool is an int, but not a number here
        return isinstance(v, kinds) and not isinstance(v, bool)

    hint = " (transformers' 'absolute' is our 'learned')" if c.position_embedding_type == "absolute" else ""
    counts = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "max_position_embeddings",
        "type_vocab_size",
    )
    rules = {
        **dict.fromkeys(counts, ("a positive integer", lambda v: number(v, int) and v > 0)),
        **dict.fromkeys(
            ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"),
            ("a probability in [0, 1)", lambda v: number(v) and 0 <= v < 1),
        ),
        **dict.fromkeys(("initializer_range", "layer_norm_eps"), ("a positive number", lambda v: number(v) and v > 0)),
        "position_embedding_type": (f"one of {POSITION_EMBEDDING_TYPES}{hint}", POSITION_EMBEDDING_TYPES.__contains__),
        "hidden_act": (f"one of {HIDDEN_ACTS}", HIDDEN_ACTS.__contains__),
        "scale_word_embeddings": ("None, True or False", lambda v: isinstance(v, bool)),
        "sparse_prediction": ("True or False", lambda v: isinstance(v, bool)),
        "pad_token_id": ("a token id (an integer >= 0) or None", lambda v: number(v, int) and v >= 0),
    }
    optional = ("classifier_dropout", "scale_word_embeddings", "pad_token_id")  # None is accepted
    for field, (accepted, ok) in rules.items():
        value = pad_token_id if field == "pad_token_id" else getattr(c, field)
        if not (ok(value) or value is None and field in optional):
            raise ValueError(f"BertImplConfig.{field} must be {accepted}, got {value!r}")
