"""The one table of hf-bert-impl's heads (package only; the Hub files name the heads in `AUTO_MAP`).

The package's exports and Auto registration (`hf_bert_impl.HEADS`), the model card's task info (`hub.HEAD_INFO`) and
the converter's architectures (`convert.ARCHITECTURES`) are read off it; tests/test_heads.py checks it against
`AUTO_MAP`.
"""

from typing import NamedTuple


class Head(NamedTuple):
    """One head: our class, the Auto class that loads it, transformers' matching Bert class, and its task (the Hub
    `pipeline_tag` where the Hub has one)."""

    name: str
    auto_class: str
    hf_class: str
    task: str


HEAD_TABLE = (
    Head("BertImplModel", "AutoModel", "BertModel", "feature-extraction"),
    Head("BertImplForMaskedLM", "AutoModelForMaskedLM", "BertForMaskedLM", "fill-mask"),
    # tagged fill-mask as Google's BERT is; its output has no `logits`, so the card's fill-mask
    # pipeline loads the MLM head from it (hub.PIPELINE_HEAD)
    Head("BertImplForPreTraining", "AutoModelForPreTraining", "BertForPreTraining", "fill-mask"),
    Head(
        "BertImplForNextSentencePrediction",
        "AutoModelForNextSentencePrediction",
        "BertForNextSentencePrediction",
        "next-sentence-prediction",
    ),
    Head(
        "BertImplForSequenceClassification",
        "AutoModelForSequenceClassification",
        "BertForSequenceClassification",
        "text-classification",
    ),
    Head(
        "BertImplForTokenClassification",
        "AutoModelForTokenClassification",
        "BertForTokenClassification",
        "token-classification",
    ),
    Head(
        "BertImplForQuestionAnswering",
        "AutoModelForQuestionAnswering",
        "BertForQuestionAnswering",
        "question-answering",
    ),
    Head("BertImplForMultipleChoice", "AutoModelForMultipleChoice", "BertForMultipleChoice", "multiple-choice"),
)
