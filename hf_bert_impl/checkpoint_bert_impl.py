"""Checkpoint files of bert_impl models that lose nothing: an all-or-nothing `save_pretrained` and a
`from_pretrained` that refuses what transformers would load badly or unsafely.

`CheckpointSafetyMixin` sits before `PreTrainedModel` in `BertImplPreTrainedModel`'s bases:

- `save_pretrained` writes into a hidden sibling `.NAME.saving-*` and renames it in, or atomically
  exchanges it with an existing directory (Linux renameat2 RENAME_EXCHANGE) after the old directory's
  other files (tokenizer, checkpoint-*) were hard-linked in. Without the exchange the old directory is
  renamed aside first (a crash in between leaves it in `.NAME.replaced-*`, restored by the next save).
  So after a crash at any point the directory loads as the old or the new checkpoint, never a mix.
- `from_pretrained` refuses a local directory of pickled weights only, a truncated or corrupt
  safetensors file, and a checkpoint without encoder weights (transformers would start them random).

Travels to the Hub with the model code (modeling_bert_impl.py imports it); standard library only.
"""

import ctypes
import os
import re
import shutil
import socket
import sys
import uuid

# Weight files transformers writes or reads (shards and indexes included): pickled ones, and any.
PICKLED_WEIGHTS = re.compile(r"pytorch_model(-\d{5}-of-\d{5})?\.bin(\.index\.json)?")
WEIGHTS_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")
ENCODER_KEY = re.compile(r"(bert\.)?(embeddings|layers)\.")  # a weight no head may start without


def _owner_tag() -> str:
    """host and pid of this save, so a later save can tell a killed save's leftovers from a running one's."""
    return f"{socket.gethostname().replace('-', '_').replace('.', '_')}-{os.getpid()}"


def _remove_stale_staging(parent: str, name: str) -> None:
    """Remove `.NAME.saving-*` / `.NAME.replaced-*` siblings left by a save on this host whose process is gone."""
    host = _owner_tag().rsplit("-", 1)[0]
    for entry in os.listdir(parent):
        m = re.fullmatch(rf"\.{re.escape(name)}\.(saving|replaced)-(.+)-(\d+)-[0-9a-f]{{12}}", entry)
        if not m or m.group(2) != host:
            continue
        try:
            os.kill(int(m.group(3)), 0)
            continue  # that save is still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        path, target = os.path.join(parent, entry), os.path.join(parent, name)
        if m.group(1) == "replaced" and not os.path.exists(target):
            os.rename(path, target)  # a crash between the two renames: bring the old one back
        else:
            shutil.rmtree(path, ignore_errors=True)


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


def _exchange_directories(a: str, b: str) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:  # AT_FDCWD, RENAME_EXCHANGE
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this file system cannot exchange
        return False
    raise OSError(err, os.strerror(err), b)


def _replace_directory(target: str, write) -> None:
    """Run write(staging) on a fresh hidden sibling of `target`, then make it `target` as described above."""
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
            if _exchange_directories(staging, target):
                return  # staging holds the old checkpoint now: removed below
            os.rename(target, aside)
        try:
            os.rename(staging, target)
        except BaseException:
            if os.path.exists(aside):
                os.rename(aside, target)  # the old checkpoint goes back
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if os.path.exists(aside) and os.path.exists(target):
            shutil.rmtree(aside, ignore_errors=True)


class CheckpointSafetyMixin:
    """save_pretrained / from_pretrained of a bert_impl PreTrainedModel (see the module docstring)."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        source = pretrained_model_name_or_path
        folder = os.path.join(os.fspath(source), kwargs["subfolder"]) if kwargs.get("subfolder") else source
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
        # A new head or pooler is normal (an encoder fine-tuned for a task); a missing encoder weight is not.
        missing = sorted(k for k in info["missing_keys"] if ENCODER_KEY.match(k))
        if missing:
            raise ValueError(
                f"the checkpoint in {source} lacks {len(missing)} encoder weight(s) this config needs, e.g. "
                f"{missing[:4]}; they would start random. Is it a bert_impl checkpoint of this architecture? "
                "(transformers BERT: convert it with hf_bert_impl.convert.from_hf_bert; to load a partial "
                "state dict on purpose, use model.load_state_dict(..., strict=False))"
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
