"""Checkpoint files of bert_impl models that lose nothing: an all-or-nothing `save_pretrained` and a
`from_pretrained` that refuses what transformers would load unsafely.

`CheckpointSafetyMixin` sits before `PreTrainedModel` in `BertImplPreTrainedModel`'s bases.

Saving. `save_pretrained` writes the new checkpoint into a hidden sibling `.NAME.saving-*`, hard-links
the old directory's other files into it (tokenizer, checkpoint-*; not its weights: no stale shard
survives), then
  1. renames NAME to `.NAME.replaced-*` (the complete old checkpoint),
  2. renames `.NAME.saving-*` to NAME (the complete new one),
  3. removes `.NAME.replaced-*`.
Why two renames: a directory rename is atomic, but the standard library cannot swap two non-empty
directories (Linux's renameat2(RENAME_EXCHANGE) takes a foreign-function call, which remote-code
reviewers rightly flag), and replacing the files inside NAME one by one leaves mixes, e.g. a new
config.json beside old weights, which loads silently. With two renames the one window is
between 1 and 2, where NAME is missing and both complete checkpoints sit beside it. A crash at any
point (SIGKILL included) leaves:
  - before 1: NAME as it was; the next save removes `.NAME.saving-*`;
  - between 1 and 2: no NAME. `BertImpl*.from_pretrained(NAME)` loads the old checkpoint from
    `.NAME.replaced-*` and warns that it does (loading changes no file); the next save renames it back
    first. Loaders that read NAME/config.json before reaching this class (AutoModel, AutoConfig,
    AutoTokenizer) get transformers' not-found error until then. Several such siblings (left by saves
    from several hosts) are a ValueError that lists them: which is newer is not known;
  - after 2: NAME is the new checkpoint; the next save removes `.NAME.replaced-*`.
An exception between 1 and 2 renames the old checkpoint back at once. Leftovers carry host and pid: a
save touches only those of dead saves on its host (on Windows, which has no standard-library test of
a pid, it leaves them). Files are not fsynced: this covers crashed processes, not power cuts.

Loading. `from_pretrained` refuses (ValueError) a local directory of pickled weights only and a
truncated or corrupt safetensors file. Missing weights follow transformers' contract: the model loads,
they start random and are listed in `output_loading_info=True`'s `missing_keys`; missing encoder
weights, unlike a new head or pooler, are never normal and get a warning of their own.

Travels to the Hub with the model code (modeling_bert_impl.py imports it): portable standard library
only, no foreign-function call, child process, system-file read or network.
"""

import logging
import os
import platform
import re
import shutil
import uuid

logger = logging.getLogger(__name__)  # the logger transformers.utils.logging.get_logger(__name__) returns

# Weight files transformers writes or reads (shards and indexes included): pickled ones, and any.
PICKLED_WEIGHTS = re.compile(r"pytorch_model(-\d{5}-of-\d{5})?\.bin(\.index\.json)?")
WEIGHTS_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")
ENCODER_KEY = re.compile(r"(bert\.)?(embeddings|layers)\.")  # a weight no head may start without


def _owner_tag() -> str:
    """host and pid of this save, so a later save can tell a killed save's leftovers from a running one's."""
    return f"{(platform.node() or 'host').replace('-', '_').replace('.', '_')}-{os.getpid()}"


def _leftover(name: str, entry: str):
    """Match `.NAME.saving-HOST-PID-ID` / `.NAME.replaced-HOST-PID-ID`: groups kind, host, pid."""
    return re.fullmatch(rf"\.{re.escape(name)}\.(saving|replaced)-(.+)-(\d+)-[0-9a-f]{{12}}", entry)


def _running(pid: int) -> bool:
    """Whether a save's process may still run. On Windows os.kill(pid, 0) sends CTRL_C_EVENT: say yes."""
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    return True


def _remove_stale_staging(parent: str, name: str) -> None:
    """Remove `.NAME.saving-*` / `.NAME.replaced-*` siblings left by a save on this host whose process is gone."""
    host = _owner_tag().rsplit("-", 1)[0]
    for entry in os.listdir(parent):
        m = _leftover(name, entry)
        if not m or m.group(2) != host or _running(int(m.group(3))):
            continue
        path, target = os.path.join(parent, entry), os.path.join(parent, name)
        if m.group(1) == "replaced" and not os.path.exists(target):
            os.rename(path, target)  # killed between the two renames: bring the old one back
        else:
            shutil.rmtree(path, ignore_errors=True)


def _previous_checkpoint(folder) -> str | None:
    """For a missing local directory NAME, its `.NAME.replaced-*` sibling (a save killed between its renames)."""
    parent, name = os.path.split(os.path.abspath(os.fspath(folder)))
    if os.path.exists(folder) or not name or not os.path.isdir(parent):
        return None
    found = sorted(e for e in os.listdir(parent) if (m := _leftover(name, e)) and m.group(1) == "replaced")
    if len(found) > 1:
        raise ValueError(
            f"{folder} does not exist, and {len(found)} interrupted saves left previous checkpoints beside it: "
            f"{found}. Rename the one you want back to {name} (or delete all but one)"
        )
    return os.path.join(parent, found[0]) if found else None


def _link_tree(src: str, dst: str) -> None:
    """Hard-link (copy where links are not possible) a file or directory tree: no data is copied on one file system."""
    def link(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
    elif os.path.isdir(src):
        shutil.copytree(src, dst, symlinks=True, copy_function=link)
    else:
        link(src, dst)


def _replace_directory(target: str, write) -> None:
    """Run write(staging) on a fresh hidden sibling of `target`, then rename it in (steps 1-3 of the module docstring)."""
    if os.path.isfile(target):
        raise ValueError(f"save_pretrained needs a directory, but {target} is a file")
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    _remove_stale_staging(parent, name)
    staging = os.path.join(parent, f".{name}.saving-{_owner_tag()}-{uuid.uuid4().hex[:12]}")
    aside = staging.replace(".saving-", ".replaced-")
    os.mkdir(staging)  # not tempfile.mkdtemp (0700): the usual umask mode
    try:
        write(staging)
        if os.path.exists(target):
            new_names = set(os.listdir(staging))
            for entry in os.listdir(target):  # the old model's own files stay behind (no mixed shards)
                if entry not in new_names and not WEIGHTS_FILE.fullmatch(entry):
                    _link_tree(os.path.join(target, entry), os.path.join(staging, entry))
            os.rename(target, aside)  # 1. until 2, from_pretrained(target) loads the old checkpoint from aside
        try:
            os.rename(staging, target)  # 2.
        except BaseException:
            if os.path.exists(aside):
                os.rename(aside, target)  # the old checkpoint goes back
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if os.path.exists(aside) and os.path.exists(target):
            shutil.rmtree(aside, ignore_errors=True)  # 3.


class CheckpointSafetyMixin:
    """save_pretrained / from_pretrained of a bert_impl PreTrainedModel (see the module docstring)."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        source = pretrained_model_name_or_path
        folder = os.path.join(os.fspath(source), kwargs["subfolder"]) if kwargs.get("subfolder") else source
        previous = _previous_checkpoint(folder) if folder is not None else None
        if previous:
            logger.warning(
                "%s does not exist: a save_pretrained into it was killed between its two renames (or is finishing "
                "now). Loading the checkpoint it held before, from %s. The next save_pretrained into %s puts it "
                "back first; or rename it back yourself: mv %s %s", folder, previous, folder, previous, folder,
            )
            source = folder = previous
            kwargs.pop("subfolder", None)
        if folder is not None and os.path.isdir(folder) and kwargs.get("use_safetensors") is not False:
            names = os.listdir(folder)
            pickled = sorted(n for n in names if PICKLED_WEIGHTS.fullmatch(n))
            if pickled and not any(n.endswith(".safetensors") for n in names):
                raise ValueError(
                    f"{folder} holds only pickled weights {pickled}, which bert_impl does not load by default "
                    "(a pickle can execute code). If you trust the file, convert it explicitly: "
                    "model.load_state_dict(torch.load(path, weights_only=True)); model.save_pretrained(dir), "
                    "or pass use_safetensors=False to load it with torch.load(weights_only=True)"
                )
        want_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super().from_pretrained(source, *model_args, output_loading_info=True, **kwargs)
        except Exception as e:
            if type(e).__name__ != "SafetensorError":  # by name: the Hub files import only torch and transformers
                raise
            raise ValueError(
                f"the weights in {source} cannot be read ({e}): model.safetensors is truncated or corrupt "
                "(an interrupted download, copy or save?); download or save it again"
            ) from e
        # transformers' contract: load, start missing weights random, list them in missing_keys. A new head or
        # pooler is normal (an encoder fine-tuned for a task); a missing encoder weight is not: say so loudly.
        missing = sorted(k for k in info["missing_keys"] if ENCODER_KEY.match(k))
        if missing:
            logger.warning(
                "the checkpoint in %s lacks %d encoder weight(s) this config needs, e.g. %s; they were initialised "
                "randomly (see missing_keys of output_loading_info=True). Is it a bert_impl checkpoint of this "
                "architecture? (transformers BERT: convert it with hf_bert_impl.convert.from_hf_bert)",
                source, len(missing), missing[:4],
            )
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory, is_main_process: bool = True, *args, **kwargs):
        """transformers' save, all or nothing. `sparse_prediction`, a training switch, is saved as False.
        Pushes and non-main ranks go straight through."""
        sparse = getattr(self.config, "sparse_prediction", False)
        try:
            self.config.sparse_prediction = False
            if kwargs.get("push_to_hub") or kwargs.get("distributed_checkpoint") or not is_main_process:
                return super().save_pretrained(save_directory, is_main_process, *args, **kwargs)
            save = super().save_pretrained
            _replace_directory(os.path.abspath(os.fspath(save_directory)),
                               lambda staging: save(staging, is_main_process, *args, **kwargs))
        finally:
            self.config.sparse_prediction = sparse
