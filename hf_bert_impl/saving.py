"""Saves that never leave a torn file, for the package's scripts (the model itself keeps transformers' own
`save_pretrained` / `from_pretrained`).

`staged(save_directory)` yields a fresh hidden folder inside `save_directory`; whatever is written there (by
`model.save_pretrained`, `tokenizer.save_pretrained`, `Trainer.save_model`) is moved into `save_directory` file by file
when the block ends without an error, each with `os.replace` (atomic for a file within one file system): the weight
files first, then the old weight files the new save does not write are removed (shards of an older sharded save, or
the single file of an older unsharded one), then the other files, config.json last; then the hidden folder goes. So:
  - every file in `save_directory` is either its old or its new version, complete, at every moment (a crash, SIGKILL
    included, between two moves leaves some files new and some old: the guarantee is per file, not per checkpoint;
    transformers reads model.safetensors before an index, so where either save is one weights file, the weights a
    load finds are wholly the old or wholly the new ones);
  - `save_directory` itself is written into, never renamed, replaced or removed: a mount point, `.`, a symlink (its
    target gets the files) and a folder holding other files work as with transformers' own save;
  - an error inside the block changes no file of `save_directory` (a folder the save created is removed again while
    empty); the hidden folder of a killed save is removed by the next save into the same folder
    (`.hf_bert_impl-saving-*`, a dead process's on this host).
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


def _order(rel: str) -> tuple[int, str]:
    """The top folder's weights first, its config.json last: a reader that sees the new config sees new weights."""
    top = os.path.dirname(rel) == ""
    return (0 if top and WEIGHTS_FILE.fullmatch(rel) else 2 if rel == "config.json" else 1, rel)


def _missing(folder: str) -> list[str]:
    """`folder` and those of its parents that do not exist yet, deepest first (what `os.makedirs` will create)."""
    missing, path = [], os.path.abspath(folder)
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


@contextlib.contextmanager
def staged(save_directory: str | os.PathLike) -> Iterator[str]:
    """A hidden folder inside `save_directory` (created if missing) to save into; its files are moved into place when
    the block ends (see the module docstring)."""
    folder = os.fspath(save_directory)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"cannot save into {folder}: it is a file, not a folder")
    created = _missing(folder)
    os.makedirs(folder, exist_ok=True)
    _remove_dead_staging(folder)
    staging = os.path.join(folder, f"{STAGING_PREFIX}{_tag()}-{uuid.uuid4().hex[:12]}")
    os.mkdir(staging)
    try:
        try:
            yield staging
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            for path in created:  # the folders this save created, while still empty: a failed save leaves none
                try:
                    os.rmdir(path)
                except OSError:
                    break
            raise
        moves = sorted(
            (
                os.path.relpath(os.path.join(root, name), staging)
                for root, _, files in os.walk(staging)
                for name in files
            ),
            key=_order,
        )
        weights = [rel for rel in moves if _order(rel)[0] == 0]
        for rel in weights:
            _move(staging, folder, rel)
        if weights:  # the new weights are in place: an older checkpoint's shards go before the new config comes
            for name in sorted(os.listdir(folder)):
                if WEIGHTS_FILE.fullmatch(name) and name not in weights:
                    os.remove(os.path.join(folder, name))
        for rel in moves[len(weights) :]:
            _move(staging, folder, rel)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move(staging: str, folder: str, rel: str) -> None:
    target = os.path.join(folder, rel)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.replace(os.path.join(staging, rel), target)  # atomic within one file system: the old or the new file


def save_pretrained(save_directory: str | os.PathLike, *objects, **kwargs) -> None:
    """`obj.save_pretrained(save_directory, **kwargs)` for each object (a model, its tokenizer, ...), each file moved
    into place complete (`staged`)."""
    with staged(save_directory) as staging:
        for obj in objects:
            obj.save_pretrained(staging, **kwargs)


__all__ = ["staged", "save_pretrained", "STAGING_PREFIX"]
