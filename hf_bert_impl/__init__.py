"""hf-bert-impl: a from-scratch, formula-faithful BERT encoder that is a first-class Hugging Face model.

Importing this package registers `BertImplConfig` with `AutoConfig` and every head with its Auto
class, so `AutoModelForMaskedLM.from_pretrained(dir)` works on our checkpoints without
`trust_remote_code`; and it marks each class for the Hub, so `save_pretrained` / `push_to_hub`
copy the code files and write `auto_map` for people who do not have this package.

`kernelize(model)` puts the package's speed layer (kernels_bert_impl.py) on a loaded model; a model that is never
kernelized runs the plain model file, as every trust_remote_code user does.
"""

import transformers
from transformers import AutoConfig

from . import modeling_bert_impl
from .configuration_bert_impl import AUTO_MAP, SIZE_PRESETS, BertImplConfig
from .heads import HEAD_TABLE
from .kernels_bert_impl import kernelize, kernelized
from .modeling_bert_impl import (  # the heads by name, for editors; HEADS below is read off the table
    BertImplForMaskedLM,
    BertImplForMultipleChoice,
    BertImplForNextSentencePrediction,
    BertImplForPreTraining,
    BertImplForPreTrainingOutput,
    BertImplForQuestionAnswering,
    BertImplForSequenceClassification,
    BertImplForTokenClassification,
    BertImplModel,
    BertImplPreTrainedModel,
    sinusoidal_position_encoding,
)


__version__ = "0.7.0"

# Auto class -> our head, read off the head table; both registrations below use it.
HEADS = {getattr(transformers, head.auto_class): getattr(modeling_bert_impl, head.name) for head in HEAD_TABLE}


def _register():
    AutoConfig.register(BertImplConfig.model_type, BertImplConfig, exist_ok=True)
    BertImplConfig.register_for_auto_class()
    for auto_cls, model_cls in HEADS.items():
        auto_cls.register(BertImplConfig, model_cls, exist_ok=True)
        model_cls.register_for_auto_class(auto_cls.__name__)


_register()


def _register_peft_defaults():
    """peft's LoRA default for our model_type (its table has "bert": query, value): the fused projection Wqkv, so
    `LoraConfig()` without target_modules works on our models as on BertModel. Only where peft is installed."""
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as lora_defaults
    except ImportError:
        return
    lora_defaults.setdefault(BertImplConfig.model_type, ["Wqkv"])


_register_peft_defaults()

__all__ = [
    "AUTO_MAP",
    "HEADS",
    "HEAD_TABLE",
    "SIZE_PRESETS",
    "BertImplConfig",
    "BertImplPreTrainedModel",
    *(head.name for head in HEAD_TABLE),
    "BertImplForPreTrainingOutput",
    "sinusoidal_position_encoding",
    "kernelize",
    "kernelized",
]
