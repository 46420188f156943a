"""The package's shims for the transformers / huggingface_hub releases it runs on: transformers 4.57.x
(the last v4, with huggingface_hub 0.3x) and every 5.x (huggingface_hub 1.x and later).

Where an API the scripts, conversion or Hub helpers use differs between those releases, it gets one
small named function here, and the rest of the package calls that function; never a version check
scattered through the code. Each shim uses the newer API when it exists (detected by the API itself,
not by a version number) and says what the older release lacks. The Hub files (modeling_ and
configuration_bert_impl.py) keep their own shims: they travel without this package. tests/test_compat.py runs the
scripts, the conversion and the card rendering under transformers 4.57.6 and 5.0.0 (docs/compatibility.md).

The shims, with what transformers 5.x / huggingface_hub 1.x does and what transformers 4.57 / huggingface_hub 0.3x
does instead:

- `bert_tokenizer_from_vocab`: 5.x takes `BertTokenizerFast(vocab={token: id})`; 4.57 takes
  `BertTokenizerFast(vocab_file=...)` only: the vocabulary goes through a vocab.txt.
- `language_modeling_collator`: 5.x's `DataCollatorForLanguageModeling(whole_word_mask=True)` sets [MASK]-only
  replacement itself; 4.57's same class raises a TypeError at construction unless that replacement is passed
  explicitly.

Everything else the package calls is the same on both lines and needs no shim: `Trainer(processing_class=)`,
the `TrainingArguments` fields the scripts use (`use_cpu`, `eval_strategy`, ...), `DataCollatorWithFlattening
(return_position_ids=True)`, `DataCollatorForLanguageModeling(seed=)`, and from huggingface_hub 0.36 / 1.x
`ModelCard` / `ModelCardData` / `EvalResult`, `validate_repo_id`, `snapshot_download`, `HfApi`, `get_token`
and `errors.HfHubHTTPError` / `OfflineModeIsEnabled`.
"""

from __future__ import annotations

import inspect
import os
import tempfile


def bert_tokenizer_from_vocab(vocab: dict[str, int], do_lower_case: bool = True):
    """A BERT WordPiece tokenizer (`BertTokenizerFast`: BERT's normalizer, pre-tokenizer and
    [CLS] A [SEP] B [SEP] post-processor) over `vocab` ({token: id}).

    transformers 5.x builds it from the dict (`vocab=`). 4.57's `BertTokenizerFast` takes a vocab.txt
    path only (`vocab_file=`, one token per line in id order) and converts its slow tokenizer; the
    file is written to a temporary folder and is not needed afterwards (the fast tokenizer holds the
    vocabulary, and `save_pretrained` writes it again)."""
    from transformers import BertTokenizerFast

    if "vocab" in inspect.signature(BertTokenizerFast.__init__).parameters:
        return BertTokenizerFast(vocab=vocab, do_lower_case=do_lower_case)
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError("the vocabulary's ids must be 0..n-1, each once")
    with tempfile.TemporaryDirectory(prefix="hf_bert_impl_vocab_") as tmp:
        path = os.path.join(tmp, "vocab.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(token + "\n" for token in tokens))
        return BertTokenizerFast(vocab_file=path, do_lower_case=do_lower_case)


def language_modeling_collator(tokenizer, mlm_probability: float = 0.15, whole_word_mask: bool = False, **kwargs):
    """`DataCollatorForLanguageModeling` for masked LM (`mlm=True`); `kwargs` go through (`seed=`,
    `return_tensors=`, `pad_to_multiple_of=`).

    With `whole_word_mask=True` every transformers release masks whole words with [MASK] only (no
    random or kept tokens): 5.x sets `mask_replace_prob=1, random_replace_prob=0` itself with a
    warning, and 4.57 means to but its warning call is broken (`warnings.warn(str, str)`: a
    TypeError at construction). Passing the two values explicitly gives the same masks on both, and
    no warning."""
    from transformers import DataCollatorForLanguageModeling

    if whole_word_mask:
        kwargs.update(mask_replace_prob=1.0, random_replace_prob=0.0)
    return DataCollatorForLanguageModeling(
        tokenizer, mlm=True, mlm_probability=mlm_probability, whole_word_mask=whole_word_mask, **kwargs
    )
