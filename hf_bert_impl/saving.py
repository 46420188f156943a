"""Saves that never leave a torn file, for the package's scripts (the model itself keeps transformers' own
`save_pretrained` / `from_pretrained`).

`staged(save_directory)` yields a fresh hidden folder inside `save_directory`; whatever is written there (by
`model.save_pretrained`, `tokenizer.save_pretrained`, `Trainer.save_model`) is moved into `save_directory` file by file
when the block ends without an error, each with `os.replace` (atomic for a file within one file system), then old
weight shards the new save does not list are removed and the hidden folder goes. So:
  - every file in `save_directory` is either its old or its new version, complete, at every moment (a crash, SIGKILL
    included, between two moves leaves some files new and some old: the guarantee is per file, not per checkpoint);
  - `save_directory` itself is written into, never renamed, replaced or removed: a mount point, `.`, a symlink (its
    target gets the files) and a folder holding other files work as with transformers' own save;
  - an error inside the block changes no file of `save_directory`; the hidden folder of a killed save is removed by the
    next save into the same folder (`.hf_bert_impl-saving-*`, a dead process's on this host).
Files are not fsynced: this covers crashed processes, not power cuts. Standard library only.
"""

import contextlib
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator

STAGING_PREFIX = ".hf_bert_impl-saving-"
# Weight files transformers writes (shards and their indexes): old ones the new save does not write are removed.
WEIGHTS_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


def _tag() -> str:  # host and pid: a later save can tell a killed save's folder from a running one's
    return f"{socket.gethostname().replace('-', '_')}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # another user's process, or a platform without signal 0 (Windows)
        return True
    return True


def _remove_dead_staging(folder: str) -> None:
    host = _tag().rsplit("-", 1)[0]
    for entry in os.listdir(folder):
        m = re.fullmatch(re.escape(STAGING_PREFIX) + r"(.+)-(\d+)-[0-9a-f]{12}", entry)
        if m and m.group(1) == host and not _alive(int(m.group(2))):
            shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)


def _order(name: str) -> tuple[int, str]:  # weights first, config.json last: a reader that sees it new sees new weights
    return (0 if WEIGHTS_FILE.fullmatch(name) else 2 if name == "config.json" else 1, name)


@contextlib.contextmanager
def staged(save_directory: str | os.PathLike) -> Iterator[str]:
    """A hidden folder inside `save_directory` (created if missing) to save into; its files are moved into place when
    the block ends (see the module docstring)."""
    folder = os.fspath(save_directory)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"cannot save into {folder}: it is a file, not a folder")
    os.makedirs(folder, exist_ok=True)
    _remove_dead_staging(folder)
    staging = os.path.join(folder, f"{STAGING_PREFIX}{_tag()}-{uuid.uuid4().hex[:12]}")
    os.mkdir(staging)
    try:
        yield staging
        written = set()
        for root, dirs, files in os.walk(staging):
            dirs.sort()
            rel = os.path.relpath(root, staging)
            for name in sorted(files, key=_order):
                target = os.path.normpath(os.path.join(folder, rel, name))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.replace(os.path.join(root, name), target)
                written.add(os.path.normpath(os.path.join(rel, name)))
        if any(WEIGHTS_FILE.fullmatch(name) for name in written):
            for name in os.listdir(folder):
                if WEIGHTS_FILE.fullmatch(name) and name not in written:
                    os.remove(os.path.join(folder, name))  # a shard of the old checkpoint: no mixed weights
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_pretrained(save_directory: str | os.PathLike, *objects, **kwargs) -> None:
    """`obj.save_pretrained(save_directory, **kwargs)` for each object (a model, its tokenizer, ...), each file moved
    into place complete (`staged`)."""
    with staged(save_directory) as staging:
        for obj in objects:
            obj.save_pretrained(staging, **kwargs)


__all__ = ["staged", "save_pretrained", "STAGING_PREFIX"]
