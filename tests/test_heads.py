"""The head table (`hf_bert_impl.heads.HEAD_TABLE`) is the one list of heads that the auto map,
the package's exports, the model card and the converter read. Each row is checked against
transformers itself, so a swapped name (an Auto class, a Bert class, a task) fails here."""

import pytest
import transformers
from transformers import BertConfig
from transformers.pipelines import SUPPORTED_TASKS

import hf_bert_impl
from hf_bert_impl.convert import ARCHITECTURES
from hf_bert_impl.heads import HEAD_TABLE
from hf_bert_impl.hub import HEAD_INFO, PIPELINE_HEAD, PIPELINE_TAGS


@pytest.mark.parametrize("head", HEAD_TABLE, ids=lambda head: head.name)
def test_each_row_agrees_with_transformers(head, debug_config):
    auto = getattr(transformers, head.auto_class)
    # the row's Auto class builds transformers' Bert class named in the row, and ours from our config
    bert = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37)
    assert type(auto.from_config(bert)).__name__ == head.hf_class
    assert type(auto.from_config(debug_config())) is getattr(hf_bert_impl, head.name)
    # the task: transformers' pipeline for it loads the head through that Auto class (the MLM part for pretraining)
    pipeline_auto = getattr(transformers, PIPELINE_HEAD.get(head.name, head.auto_class))
    if head.task in SUPPORTED_TASKS:
        assert pipeline_auto in SUPPORTED_TASKS[head.task]["pt"]
    assert (head.task in PIPELINE_TAGS) == (head.task not in ("next-sentence-prediction", "multiple-choice"))


def test_every_listing_is_read_off_the_table():
    names = [head.name for head in HEAD_TABLE]
    assert len(set(names)) == len(names) == 8
    assert {f"modeling_bert_impl.{n}" for n in names} == set(hf_bert_impl.AUTO_MAP.values()) - {
        "configuration_bert_impl.BertImplConfig"
    }
    assert [cls.__name__ for cls in hf_bert_impl.HEADS.values()] == names
    assert set(names) <= set(hf_bert_impl.__all__)
    assert all(getattr(hf_bert_impl, cls.__name__) is cls for cls in hf_bert_impl.HEADS.values())  # exported by name
    assert list(HEAD_INFO) == names
    assert [cls.__name__ for cls in ARCHITECTURES.values()] == names
