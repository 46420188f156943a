"""hf-bert-impl: a from-scratch, formula-faithful BERT encoder that is a first-class Hugging Face model.

Importing this package registers `BertImplConfig` with `AutoConfig` and every head with its Auto
class, so `AutoModelForMaskedLM.from_pretrained(dir)` works on our checkpoints without
`trust_remote_code`; and it marks each class for the Hub, so `save_pretrained` / `push_to_hub`
copy the code files and write `auto_map` for people who do not have this package.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForNextSentencePrediction,
    AutoModelForPreTraining,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_bert_impl import AUTO_MAP, SIZE_PRESETS, BertImplConfig
from .modeling_bert_impl import (
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

__version__ = "0.2.0"

# Auto class -> our head. The one table both registrations below read.
HEADS = {
    AutoModel: BertImplModel,
    AutoModelForMaskedLM: BertImplForMaskedLM,
    AutoModelForPreTraining: BertImplForPreTraining,
    AutoModelForNextSentencePrediction: BertImplForNextSentencePrediction,
    AutoModelForSequenceClassification: BertImplForSequenceClassification,
    AutoModelForTokenClassification: BertImplForTokenClassification,
    AutoModelForQuestionAnswering: BertImplForQuestionAnswering,
    AutoModelForMultipleChoice: BertImplForMultipleChoice,
}


def _register():
    AutoConfig.register(BertImplConfig.model_type, BertImplConfig, exist_ok=True)
    BertImplConfig.register_for_auto_class()
    for auto_cls, model_cls in HEADS.items():
        auto_cls.register(BertImplConfig, model_cls, exist_ok=True)
        model_cls.register_for_auto_class(auto_cls.__name__)


_register()

__all__ = [
    "AUTO_MAP",
    "HEADS",
    "SIZE_PRESETS",
    "BertImplConfig",
    "BertImplPreTrainedModel",
    "BertImplModel",
    "BertImplForMaskedLM",
    "BertImplForPreTraining",
    "BertImplForNextSentencePrediction",
    "BertImplForSequenceClassification",
    "BertImplForTokenClassification",
    "BertImplForQuestionAnswering",
    "BertImplForMultipleChoice",
    "BertImplForPreTrainingOutput",
    "sinusoidal_position_encoding",
]
