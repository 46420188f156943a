"""Saving writes where the user said: into ".", a symlinked folder (its target), a folder holding other files and a
mount point, never renaming, replacing or removing that folder.

First transformers' own `save_pretrained` of our model, beside transformers' `BertModel` as the control (the two must
behave alike, the model has no save / load override); then the package's per-file crash-safe saves
(`hf_bert_impl.saving.save_pretrained` / `staged`) in the same folders, and their guarantees: a save SIGKILLed after
any number of its file moves leaves every file complete (its old or its new version, byte for byte), an error inside
the block changes no file, the next save removes a killed save's hidden folder, and stale weight files of an older
checkpoint (shards, or the single file) go.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import BertModel, BertTokenizerFast

from hf_bert_impl import BertImplModel, saving
from hf_bert_impl.convert import to_hf_bert


TEXT = "hello worlds, hello bert"
WORDS = ["hello", "world", "bert", ",", "##s", "##t"]


def _tokenizer(extra=(), model_max_length=32) -> BertTokenizerFast:
    """A small WordPiece tokenizer built from a vocabulary dict (no download)."""
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *extra]
    return BertTokenizerFast(vocab={t: i for i, t in enumerate(tokens)}, model_max_length=model_max_length)


def _model(debug_config, seed: int, **overrides) -> BertImplModel:
    torch.manual_seed(seed)
    return BertImplModel(debug_config(**overrides)).eval()


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes), hidden ones included."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _staging(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(saving.STAGING_PREFIX))


@pytest.fixture
def pair(debug_config):
    """Our model and transformers' BertModel holding the same weights (the control)."""
    ours = _model(debug_config, 0)
    return {"ours": ours, "bert": to_hf_bert(ours).eval()}


def _save_transformers(folder, model, tokenizer):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _save_package(folder, model, tokenizer):
    saving.save_pretrained(folder, model, tokenizer)


def _save_staged(folder, model, tokenizer):
    with saving.staged(folder) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)


# (saver name, model of `pair`, the save): transformers' own saves of both models, then the package's of ours
SAVERS = {
    "BertModel.save_pretrained": ("bert", _save_transformers),
    "BertImplModel.save_pretrained": ("ours", _save_transformers),
    "saving.save_pretrained": ("ours", _save_package),
    "saving.staged": ("ours", _save_staged),
}
CODE_FILES = {"configuration_bert_impl.py", "modeling_bert_impl.py"}
SAVED = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}  # + CODE_FILES for ours


def _check_saved(folder: Path, which: str, model, tokenizer, before: dict[str, bytes]):
    """The save's files are in `folder` and load back as the model and tokenizer; every other file is unchanged."""
    after, saved = _files(folder), SAVED | (CODE_FILES if which == "ours" else set())
    assert set(after) == set(before) | saved, sorted(after)  # the save's files and nothing else came
    assert all(after[name] == data for name, data in before.items() if name not in saved)
    assert _staging(folder) == []
    loaded = (BertImplModel if which == "ours" else BertModel).from_pretrained(folder).eval()
    assert type(loaded) is type(model) and _same_weights(loaded, model)
    assert BertTokenizerFast.from_pretrained(folder)(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]


@pytest.mark.parametrize("saver", sorted(SAVERS))
def test_save_into_the_working_folder(pair, tmp_path, monkeypatch, saver):
    """`cd repo; model.save_pretrained("."); tokenizer.save_pretrained(".")`, as in a cloned Hub repository: the
    working folder stays the same folder (same inode, still the cwd) and keeps its other files."""
    which, save = SAVERS[saver]
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / "README.md").write_text("# a model\n")
    monkeypatch.chdir(repo)
    inode, before = os.stat(".").st_ino, _files(repo)
    tokenizer = _tokenizer()
    save(".", pair[which], tokenizer)
    assert os.getcwd() == str(repo) and os.stat(".").st_ino == inode == os.stat(repo).st_ino
    _check_saved(repo, which, pair[which], tokenizer, before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


@pytest.mark.parametrize("saver", sorted(SAVERS))
def test_save_into_a_symlinked_folder(pair, tmp_path, saver):
    """The link stays a link to the same target, and the target gets the files."""
    which, save = SAVERS[saver]
    target = tmp_path / "volume" / "models"
    target.mkdir(parents=True)
    link = tmp_path / "ckpt"
    link.symlink_to(target, target_is_directory=True)
    tokenizer = _tokenizer()
    save(link, pair[which], tokenizer)
    assert link.is_symlink() and os.readlink(link) == str(target)
    _check_saved(target, which, pair[which], tokenizer, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "volume"]


@pytest.mark.parametrize("saver", sorted(SAVERS))
def test_save_into_a_folder_holding_other_files(pair, tmp_path, saver):
    """The folder keeps its inode, its other files (and their folders) byte for byte; its siblings stay."""
    which, save = SAVERS[saver]
    folder = tmp_path / "ckpt"
    (folder / "checkpoint-5").mkdir(parents=True)
    (folder / "checkpoint-5" / "trainer_state.json").write_text('{"global_step": 5}')
    (folder / "README.md").write_text("# notes\n")
    (folder / "training_args.bin").write_bytes(b"\x00\x01 not ours")
    (tmp_path / "sibling.txt").write_text("next door")
    inode, before = os.stat(folder).st_ino, _files(folder)
    tokenizer = _tokenizer()
    save(folder, pair[which], tokenizer)
    assert os.stat(folder).st_ino == inode
    _check_saved(folder, which, pair[which], tokenizer, before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "sibling.txt"]
    assert (tmp_path / "sibling.txt").read_text() == "next door"


@pytest.mark.parametrize("cls", [BertImplModel, BertModel])
def test_trainer_saves_into_the_working_folder(pair, tmp_path, monkeypatch, cls):
    """`Trainer(output_dir=".")`, then `save_model()`: the model lands in the working folder, which stays."""
    from transformers import Trainer, TrainingArguments

    model = pair["ours" if cls is BertImplModel else "bert"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("kept")
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=".", report_to=[], use_cpu=True))
    trainer.save_model()
    assert os.getcwd() == str(tmp_path) and (tmp_path / "README.md").read_text() == "kept"
    assert _same_weights(cls.from_pretrained("."), model)


@pytest.mark.parametrize("cls", [BertImplModel, BertModel])
def test_missing_folder_raises_and_no_hidden_folder_is_loaded(pair, tmp_path, cls):
    """A missing folder is an OSError, as for BertModel, even with hidden folders beside it that hold a complete
    checkpoint (0.5's replaced-folder fallback loaded those) or a killed staged save's files."""
    model = pair["ours" if cls is BertImplModel else "bert"]
    model.save_pretrained(tmp_path / ".ckpt.replaced-host-1-0123456789ab")
    model.save_pretrained(tmp_path / f"{saving.STAGING_PREFIX}host-1-0123456789ab")
    before = _files(tmp_path)
    with pytest.raises(OSError) as err:
        cls.from_pretrained(tmp_path / "ckpt")
    assert str(tmp_path / "ckpt") in str(err.value)
    assert _files(tmp_path) == before and not (tmp_path / "ckpt").exists()
    # the control: transformers' BertModel raises the same exception type for the same missing folder
    with pytest.raises(type(err.value)):
        BertModel.from_pretrained(tmp_path / "ckpt")


def _wait(pid: int, timeout: float = 120.0) -> int:
    """The wait status of child `pid`; SIGKILLed (and the test failed) if it has not ended within `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"child process {pid} did not end within {timeout} s")


CLONE_NEWNS = 0x00020000  # unshare(2): a private copy of the mount table (what `unshare -m` does)


def _mount_and_save(mounts: dict[str, Path], pair, tokenizer) -> dict:
    """In a forked child: a private mount namespace (mounts made there never reach this process), a tmpfs on each
    folder of `mounts`, then each saver saves into its folder and the result is checked (`_check_saved`).
    Returns {"skip": reason} where the machine does not allow it, {"error": traceback}, or one report per saver."""
    import ctypes
    import traceback

    report_path = next(iter(mounts.values())).parent / "mount_report.json"
    pid = os.fork()
    if pid:
        _wait(pid)
        return json.loads(report_path.read_text())
    report = {}
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNS) != 0:
            report = {"skip": f"unshare(CLONE_NEWNS) failed: {os.strerror(ctypes.get_errno())}"}
            return
        for command in (
            ["mount", "--make-rprivate", "/"],  # first: no mount below may propagate out
            *(["mount", "-t", "tmpfs", "tmpfs", str(folder)] for folder in mounts.values()),
        ):
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                report = {"skip": f"{' '.join(command)} failed: {done.stderr.strip()[:200]}"}
                return
        for name, (which, save) in SAVERS.items():
            folder = mounts[name]
            mounted, device = os.path.ismount(folder), os.stat(folder).st_dev
            save(folder, pair[which], tokenizer)
            _check_saved(folder, which, pair[which], tokenizer, {})
            report[name] = {
                "mounted_before": mounted,
                "mounted_after": os.path.ismount(folder),
                "same_device": os.stat(folder).st_dev == device,
                "files": sorted(os.listdir(folder)),
            }
    except FileNotFoundError as e:  # no mount command
        report = {"skip": f"cannot mount here: {e}"}
    except BaseException:
        report = {"error": traceback.format_exc()}
    finally:
        report_path.write_text(json.dumps(report))
        os._exit(0)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "fork"), reason="Linux mount namespaces")
def test_save_into_a_mount_point(pair, tmp_path):
    """A Docker / Kubernetes volume or SageMaker's model folder is a mount point: it cannot be renamed or removed, so a
    save must write into it. Each saver saves into its own tmpfs, mounted in a private mount namespace of a child
    process (needs root, as `unshare -m` does; skipped with the reason where the machine does not allow it)."""
    tokenizer = _tokenizer()
    mounts = {name: tmp_path / f"volume{i}" for i, name in enumerate(sorted(SAVERS))}
    for folder in mounts.values():
        folder.mkdir()
    report = _mount_and_save(mounts, pair, tokenizer)
    # the mounts were private to the child: here the folders are the empty folders they were
    assert all(not os.path.ismount(folder) and os.listdir(folder) == [] for folder in mounts.values())
    if "skip" in report:
        pytest.skip(report["skip"])
    assert "error" not in report, report.get("error")
    assert sorted(report) == sorted(SAVERS)
    for name, (which, _) in SAVERS.items():
        got = report[name]
        assert got["mounted_before"] and got["mounted_after"] and got["same_device"], (name, got)
        assert set(got["files"]) == SAVED | (CODE_FILES if which == "ours" else set()), (name, got["files"])


# ---------------------------------------------------------------------------------------------------------------------
# hf_bert_impl.saving: crash safety per file


def test_staged_refuses_a_file_and_removes_the_folders_a_failed_save_created(tmp_path, debug_config):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"cannot save into .*file: it is a file, not a folder"):
        with saving.staged(tmp_path / "file"):
            pass
    with pytest.raises(RuntimeError, match="stop"):
        with saving.staged(tmp_path / "a" / "b" / "c") as staging:
            _model(debug_config, 0).save_pretrained(staging)
            raise RuntimeError("stop")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # a, a/b, a/b/c: created by the save, removed


class Interrupted(Exception):
    pass


def _old_save(folder: Path, debug_config, sharded=False):
    """An older checkpoint (model, tokenizer) in `folder` beside a file of the user's; returns the model."""
    old = _model(debug_config, 0)
    folder.mkdir(parents=True, exist_ok=True)
    old.save_pretrained(folder, **({"max_shard_size": "20KB"} if sharded else {}))
    _tokenizer().save_pretrained(folder)
    (folder / "README.md").write_text("the user's notes")
    return old


def _new(debug_config):
    """A newer model and tokenizer whose every file differs from the old save's."""
    return _model(debug_config, 1, classifier_dropout=0.25), _tokenizer(extra=["new"], model_max_length=64)


def test_an_error_inside_the_block_changes_no_file(tmp_path, debug_config, monkeypatch):
    """transformers' weight writer dies after writing half a file (a crash or Ctrl-C mid-write), inside
    saving.save_pretrained: every file of the folder is as it was, and no hidden folder is left."""
    import transformers.modeling_utils as mu

    folder = tmp_path / "ckpt"
    old = _old_save(folder, debug_config)
    before = _files(folder)
    real = mu.safe_save_file

    def half_then_die(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        raise Interrupted(filename)

    monkeypatch.setattr(mu, "safe_save_file", half_then_die)
    with pytest.raises(Interrupted) as err:
        saving.save_pretrained(folder, *_new(debug_config))
    assert saving.STAGING_PREFIX in str(err.value)  # the torn file was in the hidden folder
    assert _files(folder) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert _same_weights(BertImplModel.from_pretrained(folder), old)


def _fork(action, kill_after=None, log=None) -> int:
    """Run `action(arm)` in a forked child and return its wait status. `arm(staging)` copies the hidden folder's files
    (the new versions) to `log` + ".new", then starts counting the child's file moves and removals (os.replace /
    os.remove): each is logged to `log` as "replace NAME" / "remove NAME" before it runs, and the one after
    `kill_after` of them SIGKILLs the child instead of running."""
    pid = os.fork()
    if pid:
        return _wait(pid)
    code = 1
    try:
        real = {"replace": os.replace, "remove": os.remove}
        done = []

        def step(kind):
            def call(path, *rest, **kwargs):
                if len(done) == kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                target = rest[0] if kind == "replace" else path
                with open(log, "a") as f:
                    f.write(f"{kind} {os.path.relpath(target, os.path.dirname(log))}\n")
                done.append(kind)
                return real[kind](path, *rest, **kwargs)

            return call

        def arm(staging):
            shutil.copytree(staging, f"{log}.new")
            os.replace, os.remove = step("replace"), step("remove")

        action(arm)
        code = 0
    finally:
        os._exit(code)


LAYOUTS = {  # (old checkpoint sharded, new checkpoint sharded)
    "single_to_single": (False, False),
    "sharded_to_single": (True, False),
    "single_to_sharded": (False, True),
}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill test forks the save")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_save_killed_after_each_file_move_leaves_every_file_complete(tmp_path, debug_config, layout):
    """saving.save_pretrained(folder, model, tokenizer) in a child process, SIGKILLed before its (k+1)-th file
    operation for every k (none done, ..., all but one done), then once not at all. Each time: the folder is exactly
    the old files with the first k operations applied (every file its old or its new version byte for byte, each
    safetensors file loads); the order is the new weights first, then the old checkpoint's other weight files
    removed, then the other files, config.json last, so the weights a load finds are wholly old or wholly new; the
    user's file never changes; the killed save's hidden folder is there, and the next save removes it."""
    old_sharded, new_sharded = LAYOUTS[layout]
    new, new_tokenizer = _new(debug_config)
    shards = {"max_shard_size": "20KB"} if new_sharded else {}

    def save(folder):
        def action(arm):
            with saving.staged(folder) as staging:
                new.save_pretrained(staging, **shards)
                new_tokenizer.save_pretrained(staging)
                arm(staging)  # the block is done: from here on, the moves

        return action

    old = _old_save(tmp_path / "old", debug_config, sharded=old_sharded)
    k, outcomes, full_log = 0, [], None
    while True:
        folder = tmp_path / f"ckpt{k}"
        shutil.copytree(tmp_path / "old", folder)
        old_files = _files(folder)
        assert (len([n for n in old_files if n.startswith("model-")]) > 1) == old_sharded, sorted(old_files)
        log = tmp_path / f"ckpt{k}.log"
        status = _fork(save(folder), kill_after=k, log=log)
        ops = [tuple(line.split(" ", 1)) for line in log.read_text().splitlines()] if log.exists() else []
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        assert killed or os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        new_files = _files(Path(f"{log}.new"))  # the new version of each file, as this save wrote it
        assert (len([n for n in new_files if n.startswith("model-")]) > 1) == new_sharded, sorted(new_files)
        # what the folder must hold: the old files with the first k operations applied
        expected = dict(old_files)
        for kind, name in ops:
            rel = os.path.relpath(name, f"ckpt{k}")
            if kind == "replace":
                expected[rel] = new_files[rel]
            else:
                del expected[rel]
        got = {name: data for name, data in _files(folder).items() if not name.startswith(saving.STAGING_PREFIX)}
        assert got == expected, (k, ops)
        assert all(data in (old_files.get(n), new_files.get(n)) for n, data in got.items())
        assert got["README.md"] == b"the user's notes"
        for name in got:
            if name.endswith(".safetensors"):
                load_file(folder / name)  # complete: a torn file would not load
        loaded = BertImplModel.from_pretrained(folder)
        outcome = "new" if _same_weights(loaded, new) else "old" if _same_weights(loaded, old) else "mixed"
        outcomes.append(outcome)
        if not killed:
            full_log = [(kind, os.path.relpath(name, f"ckpt{k}")) for kind, name in ops]
            assert got == {**new_files, "README.md": b"the user's notes"}, sorted(got)
            assert _staging(folder) == []
            break
        assert len(ops) == k, ops
        assert len(_staging(folder)) == 1  # the killed save's hidden folder
        if k == 0:
            assert got == old_files  # killed before the first move: the old files untouched
        saving.save_pretrained(folder, new, new_tokenizer, **shards)  # the next save removes the dead one's folder
        assert _staging(folder) == [] and _files(folder) == {**new_files, "README.md": b"the user's notes"}
        k += 1
    # the full order of the operations, and every killed run was a prefix of it
    weights = sorted(n for n in new_files if saving.WEIGHTS_FILE.fullmatch(n))
    stale = sorted(n for n in old_files if saving.WEIGHTS_FILE.fullmatch(n) and n not in new_files)
    others = sorted(n for n in new_files if n not in weights and n != "config.json")
    assert full_log == (
        [("replace", n) for n in weights]
        + [("remove", n) for n in stale]
        + [("replace", n) for n in others]
        + [("replace", "config.json")]
    ), full_log
    assert k == len(full_log) and len(outcomes) == k + 1
    assert "mixed" not in outcomes and outcomes[0] == "old" and outcomes[-1] == "new", outcomes
    # a new model.safetensors is read at once; an old one is read (before any index) until it is removed
    first_new = len(weights) + 1 if new_sharded and not old_sharded else 1
    assert outcomes == ["old"] * first_new + ["new"] * (k + 1 - first_new), outcomes


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill test forks the save")
def test_save_killed_while_writing_changes_no_file(tmp_path, debug_config):
    """SIGKILL while transformers writes the weights (half a file on disk): the folder's files are the old ones byte
    for byte, the torn file sits only in the killed save's hidden folder, and the next save removes that folder and
    leaves another live process's and another host's hidden folders alone."""
    import transformers.modeling_utils as mu

    folder = tmp_path / "ckpt"
    old = _old_save(folder, debug_config)
    before = _files(folder)
    new, new_tokenizer = _new(debug_config)

    def action(arm):
        real = mu.safe_save_file

        def half_then_killed(tensors, filename, metadata=None):
            real(tensors, filename, metadata=metadata)
            data = Path(filename).read_bytes()
            Path(filename).write_bytes(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)

        mu.safe_save_file = half_then_killed
        saving.save_pretrained(folder, new, new_tokenizer)

    status = _fork(action)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    (dead,) = _staging(folder)
    assert dead.startswith(f"{saving._tag().rsplit('-', 1)[0]}-", len(saving.STAGING_PREFIX)), dead
    torn = folder / dead / "model.safetensors"
    with pytest.raises(Exception):  # safetensors names its error type differently between releases
        load_file(torn)
    assert {n: d for n, d in _files(folder).items() if not n.startswith(saving.STAGING_PREFIX)} == before
    assert _same_weights(BertImplModel.from_pretrained(folder), old)
    live = f"{saving.STAGING_PREFIX}{saving._tag()}-{'a' * 12}"  # this process's: a save in progress
    elsewhere = f"{saving.STAGING_PREFIX}otherhost-1-{'b' * 12}"  # another host's: its pids mean nothing here
    (folder / live).mkdir()
    (folder / elsewhere).mkdir()
    saving.save_pretrained(folder, new, new_tokenizer)
    assert _staging(folder) == sorted([live, elsewhere])
    assert _same_weights(BertImplModel.from_pretrained(folder), new)
    assert (folder / "README.md").read_text() == "the user's notes"


@pytest.mark.parametrize("old_sharded, new_sharded", [(True, False), (False, True)])
def test_stale_weight_files_of_an_older_checkpoint_are_removed(tmp_path, debug_config, old_sharded, new_sharded):
    """A single-file save over a sharded checkpoint removes its shards and index, and a sharded save over a
    single-file one removes model.safetensors (transformers would load that file first); other files stay."""
    folder = tmp_path / "ckpt"
    _old_save(folder, debug_config, sharded=old_sharded)
    (folder / "adapter_model.safetensors").write_bytes(b"not a weight file of this model")
    new, new_tokenizer = _new(debug_config)
    saving.save_pretrained(folder, new, new_tokenizer, **({"max_shard_size": "20KB"} if new_sharded else {}))
    names = sorted(p.name for p in folder.iterdir())
    weights = [n for n in names if saving.WEIGHTS_FILE.fullmatch(n)]
    if new_sharded:
        shards = [f"model-{i:05d}-of-{len(weights) - 1:05d}.safetensors" for i in range(1, len(weights))]
        assert len(shards) > 1 and weights == [*shards, "model.safetensors.index.json"], names
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == shards
    else:
        assert weights == ["model.safetensors"], names
    assert (folder / "adapter_model.safetensors").read_bytes() == b"not a weight file of this model"
    assert "README.md" in names and "tokenizer.json" in names and _staging(folder) == []
    assert _same_weights(BertImplModel.from_pretrained(folder), new)


def test_staged_files_have_the_usual_permissions(tmp_path, debug_config):
    """The files and folders a staged save creates have the modes a plain save gives them (the hidden folder's
    own mode does not leak)."""
    import stat

    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    model = _model(debug_config, 0)
    model.save_pretrained(tmp_path / "plain")
    saving.save_pretrained(tmp_path / "staged", model)
    assert mode(tmp_path / "staged") == mode(tmp_path / "plain")
    for name in ("config.json", "model.safetensors", "modeling_bert_impl.py"):
        assert mode(tmp_path / "staged" / name) == mode(tmp_path / "plain" / name), name
    assert (
        hashlib.sha256((tmp_path / "staged" / "model.safetensors").read_bytes()).digest()
        == hashlib.sha256((tmp_path / "plain" / "model.safetensors").read_bytes()).digest()
    )
