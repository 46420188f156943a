"""Save a bert_impl model as a sentence-transformers model (Reimers & Gurevych, "Sentence-BERT", 2019).

    from hf_bert_impl.sentence_embeddings import save_as_sentence_transformer
    save_as_sentence_transformer(model, tokenizer, "my-embedder/")            # mean pooling
    save_as_sentence_transformer(model, tokenizer, "my-embedder/", pooling="cls", normalize=True)

    from sentence_transformers import SentenceTransformer
    SentenceTransformer("my-embedder/", trust_remote_code=True).encode(["a sentence"])

The directory is written by sentence-transformers itself (`SentenceTransformer.save`): the encoder
and our code files at the top (so it also loads with `AutoModel.from_pretrained(dir,
trust_remote_code=True)`), the tokenizer, `modules.json`, `1_Pooling/` and, when asked,
`2_Normalize/`. The other way round, converting an existing sentence-transformers checkpoint keeps
its modules: `scripts/convert_checkpoint.py` (`hf_bert_impl.convert.copy_sentence_transformers_files`).
Needs the `sentence-transformers` extra (`pip install 'hf-bert-impl[sentence-transformers]'`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .modeling_bert_impl import BertImplModel, BertImplPreTrainedModel


POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")


def save_as_sentence_transformer(
    model: BertImplPreTrainedModel,
    tokenizer,
    out: str | Path,
    pooling: str = "mean",
    normalize: bool = False,
    max_seq_length: int | None = None,
):
    """Write `model`'s encoder (a BertImplModel, or the encoder inside any of our heads; the head
    itself is not part of a sentence embedding) with `tokenizer` as a sentence-transformers model in
    `out`, and return the `SentenceTransformer`. pooling: how token vectors become one vector (mean
    over real tokens by default, as all-MiniLM-L6-v2 and most sentence-transformers models do);
    normalize: L2-normalise the embeddings; max_seq_length: longest input in tokens (default: the
    config's `max_position_embeddings`, capped by the tokenizer's `model_max_length`)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    if not isinstance(model, BertImplPreTrainedModel):
        raise ValueError(f"save_as_sentence_transformer takes a bert_impl model, got {type(model).__name__}")
    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling must be one of {POOLING_MODES}, got {pooling!r}")
    if max_seq_length is not None and (
        isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length <= 0
    ):
        raise ValueError(f"max_seq_length must be a positive integer, got {max_seq_length!r}")
    encoder = model if isinstance(model, BertImplModel) else model.base_model
    if max_seq_length is None:
        max_seq_length = min(model.config.max_position_embeddings, getattr(tokenizer, "model_max_length", 10**9))
    with tempfile.TemporaryDirectory() as tmp:
        encoder.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        remote = {"trust_remote_code": True}
        transformer = Transformer(
            tmp, model_kwargs=remote, config_kwargs=remote, processor_kwargs=remote, max_seq_length=max_seq_length
        )
        modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)]
        if normalize:
            modules.append(Normalize())
        st_model = SentenceTransformer(modules=modules, device=str(encoder.device))
        st_model.save(str(out))
    return st_model


__all__ = ["save_as_sentence_transformer", "POOLING_MODES"]
