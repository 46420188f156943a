"""Push a saved bert_impl model directory to the Hugging Face Hub, with a rendered model card.

    # see exactly what would be uploaded (no token, nothing leaves the machine)
    python scripts/push_to_hub.py --model-dir outputs/mlm --repo-id alice/bert-impl-mlm --dry-run out/upload

    # upload (log in first: `hf auth login`, or set HF_TOKEN)
    python scripts/push_to_hub.py --model-dir outputs/mlm --repo-id alice/bert-impl-mlm
    python scripts/push_to_hub.py --model-dir outputs/sst2 --repo-id alice/bert-impl-sst2 --private \\
        --revision v1 --commit-message "fine-tuned on SST-2"

    # anyone, without this package installed:
    #   AutoModelForMaskedLM.from_pretrained("alice/bert-impl-mlm", trust_remote_code=True)

Uploads model.safetensors, config.json (auto_map for every head), configuration_bert_impl.py and
modeling_bert_impl.py (the plain model: the package's speed layer never travels), the tokenizer files,
the loss-curve image and README.md (the model card, from model_cards/model_card.md and the
directory's training_facts.json). Every check (repo id,
files, safetensors, login) runs before anything is built or sent; a failed check prints one line
and exits with status 2 (status 1: the Hub itself refused the upload).
"""

import sys
from dataclasses import dataclass, field

from transformers import HfArgumentParser


@dataclass
class PushArguments:
    model_dir: str = field(metadata={"help": "a directory written by save_pretrained (+ tokenizer.save_pretrained)"})
    repo_id: str = field(metadata={"help": "the Hub repository, OWNER/NAME"})
    private: bool = field(default=False, metadata={"help": "create the repository as private"})
    revision: str | None = field(
        default=None, metadata={"help": "branch to push to (created if missing); default main"}
    )
    commit_message: str | None = field(default=None, metadata={"help": "the commit message"})
    dry_run: str | None = field(
        default=None,
        metadata={"help": "write the folder that would be uploaded to this (new or empty) path; upload nothing"},
    )


def main(argv=None) -> int:
    (args,) = HfArgumentParser(PushArguments).parse_args_into_dataclasses(args=argv)
    from huggingface_hub.errors import HfHubHTTPError

    from hf_bert_impl.hub import push_model_dir

    try:
        result = push_model_dir(
            args.model_dir,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            commit_message=args.commit_message,
            dry_run=args.dry_run,
        )
    except HfHubHTTPError as err:  # the Hub refused a request after every local check passed
        print(f"push_to_hub.py: error: the Hub refused the push: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as err:  # OSError: e.g. a --dry-run folder that cannot be written
        print(f"push_to_hub.py: error: {err}", file=sys.stderr)
        return 2
    if args.dry_run is not None:
        print(f"dry run: {len(result)} files written to {args.dry_run} (nothing uploaded):")
        print("\n".join(f"  {name}" for name in result))
    else:
        print(f"pushed to {result.commit_url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
