"""Training through Trainer and accelerate: gradient accumulation, parity with transformers'
BertForMaskedLM, many processes, resume.

Sizes: the debug flavour (hidden 32, 2 layers, 4 heads, intermediate 37), sequences of 7 (in-process
runs) or 16 tokens (script runs), a handful of optimizer steps. Tolerances are stated per test."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

from hf_bert_impl import BertImplForMaskedLM, pretraining
from hf_bert_impl.data import IGNORE_INDEX, default_corpus_dataset, train_wordpiece_tokenizer

from .conftest import REPO_ROOT, ListDataset


VOCAB, SEQ = 99, 7


def mlm_rows(n: int, seed: int = 0, learnable: bool = False):
    """n pre-masked MLM examples of length 7 with 1-5 masked positions each (so micro-batches hold
    different numbers of masked tokens, which is what makes accumulation non-trivial) and some padding.
    learnable: each row repeats one token, so a masked token can be read off its neighbours."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, VOCAB, (n, SEQ), generator=g)
    if learnable:
        input_ids = input_ids[:, :1].expand(n, SEQ).clone()
    lengths = SEQ - torch.randint(0, 3, (n,), generator=g)
    attention_mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    labels = torch.full((n, SEQ), IGNORE_INDEX)
    for i in range(n):
        k = int(torch.randint(1, 6, (1,), generator=g))
        pos = torch.randperm(int(lengths[i]), generator=g)[:k]
        labels[i, pos] = input_ids[i, pos]
        input_ids[i, pos] = 4  # [MASK]
    input_ids = input_ids * attention_mask
    return [{"input_ids": input_ids[i], "attention_mask": attention_mask[i], "labels": labels[i]} for i in range(n)]


def train(model, rows, tmp_path, **kw):
    args = {
        "output_dir": str(tmp_path),
        "use_cpu": True,
        "report_to": "none",
        "save_strategy": "no",
        "seed": 0,
        "data_seed": 0,
        "logging_steps": 1,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    args.update(kw)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**args),
        train_dataset=ListDataset(rows),
        data_collator=default_data_collator,
    )
    trainer.train()
    return trainer


def params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_gradient_accumulation_1x8_equals_4x2(debug_config, tmp_path):
    """Trainer with SGD, 3 optimizer steps: batch 8 x 1 step vs batch 2 x 4 accumulated steps.
    Tolerance: max |w_a - w_b| <= 1e-6 * max |w_a - w_0| (relative to the update itself, stricter
    than relative to the weights). Control: with the loss averaged per micro-batch (what a model
    that ignores num_items_in_batch gets) the same comparison fails by orders of magnitude."""
    rows = mlm_rows(24)
    torch.manual_seed(0)
    base = BertImplForMaskedLM(debug_config(vocab_size=VOCAB))
    w0 = params(base)

    def run(bs, ga, accepts_loss_kwargs=True, tag=""):
        model = BertImplForMaskedLM(base.config)
        model.load_state_dict(base.state_dict())
        model.accepts_loss_kwargs = accepts_loss_kwargs
        train(
            model,
            rows,
            tmp_path / f"{bs}x{ga}{tag}",
            per_device_train_batch_size=bs,
            gradient_accumulation_steps=ga,
            max_steps=3,
            optim="sgd",
            learning_rate=0.5,
            lr_scheduler_type="constant",
            weight_decay=0.0,
        )
        return params(model)

    big, acc = run(8, 1), run(2, 4)
    update = max((big[k] - w0[k]).abs().max().item() for k in w0)
    diff = max((big[k] - acc[k]).abs().max().item() for k in w0)
    assert update > 1e-2, f"the runs barely moved the weights (max update {update})"
    print(f"1x8 vs 4x2: max |weight diff| {diff:.3e}, max |update| {update:.3e}")
    assert diff <= 1e-6 * update, f"1x8 vs 4x2: max weight difference {diff:.3e}, update {update:.3e}"

    naive = run(2, 4, accepts_loss_kwargs=False, tag="naive")
    naive_diff = max((big[k] - naive[k]).abs().max().item() for k in w0)
    print(f"control (per-micro-batch mean): max |weight diff| {naive_diff:.3e}")
    assert naive_diff > 1e-4 * update, f"control: per-micro-batch means should differ, got {naive_diff:.3e}"


@pytest.mark.parametrize("speed_layer", ["plain", "kernelized"])
def test_loss_curve_matches_transformers_bert_for_masked_lm(debug_config, tmp_path, speed_layer):
    """Same initial weights (our model converted with to_hf_bert), same data order and Trainer
    settings (AdamW, linear schedule, seed): the per-step training losses of 20 steps agree within
    1e-5 absolute. Learned positions, as transformers' BERT has; dropout off (the two models draw
    their dropout masks in different orders). Ours as loaded (the plain model) and as
    scripts/pretrain_mlm.py trains it (kernelize "auto", and the model option sparse_prediction:
    logits for the labelled tokens only, the same loss)."""
    from transformers import BertForMaskedLM

    from hf_bert_impl import kernelize, kernelized
    from hf_bert_impl.convert import to_hf_bert

    rows = mlm_rows(80, seed=1, learnable=True)
    torch.manual_seed(0)
    ours = BertImplForMaskedLM(debug_config(vocab_size=VOCAB, position_embedding_type="learned"))
    theirs = to_hf_bert(ours)
    assert isinstance(theirs, BertForMaskedLM)
    if speed_layer == "kernelized":
        ours.config.sparse_prediction = True
        kernelize(ours, "auto")
        assert kernelized(ours)["bert.layers"] == "unpadded_encoder_forward"
    kw = {
        "per_device_train_batch_size": 4,
        "max_steps": 20,
        "learning_rate": 2e-2,
        "warmup_steps": 2,
        "optim": "adamw_torch",
    }
    losses = []
    for model, tag in ((ours, "ours"), (theirs, "transformers")):
        trainer = train(model, rows, tmp_path / tag, **kw)
        losses.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert len(losses[0]) == len(losses[1]) == 20
    worst = max(abs(a - b) for a, b in zip(*losses))
    print(f"max |loss difference| over 20 steps: {worst:.3e}; range {min(losses[0]):.4f}..{max(losses[0]):.4f}")
    assert worst <= 1e-5, f"loss curves differ by up to {worst:.3e}:\nours {losses[0]}\ntransformers {losses[1]}"
    # Not vacuous: the losses move by orders of magnitude more than the tolerance from step to step.
    assert max(losses[0]) - min(losses[0]) > 0.1, f"a flat loss curve proves little: {losses[0]}"


# ----------------------------------------------------------------------------------------------
# Script-level runs: a tokenizer and a text file shared by the tests below


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    """A WordPiece tokenizer (vocab <= 500) trained on the embedded corpus and a 120-paragraph train.txt."""
    root = tmp_path_factory.mktemp("corpus")
    texts = default_corpus_dataset()["train"]["text"]
    tokenizer = train_wordpiece_tokenizer(texts[:300], vocab_size=500)
    tokenizer.save_pretrained(root / "tokenizer")
    (root / "train.txt").write_text("\n".join(texts[:120]) + "\n", encoding="utf-8")
    return root


def pretrain_args(corpus_files, out, *extra):
    return [
        "--output_dir",
        str(out),
        "--train_file",
        str(corpus_files / "train.txt"),
        "--tokenizer_name",
        str(corpus_files / "tokenizer"),
        "--model_size",
        "debug",
        "--max_seq_length",
        "16",
        "--use_cpu",
        "--report_to",
        "none",
        "--seed",
        "3",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "true",
        "--validation_split_percentage",
        "0",
        *extra,
    ]


def weights(directory):
    return load_file(str(Path(directory) / "model.safetensors"))


def max_weight_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


class _Killed(RuntimeError):
    pass


@pytest.mark.parametrize("masking", [[], ["--static_masking"]], ids=["per-batch-masking", "static-masking"])
def test_resume_from_checkpoint_gives_the_uninterrupted_weights(corpus_files, tmp_path, monkeypatch, masking):
    """Run A: 6 steps uninterrupted. Run B: the same command dies right after its step-3
    checkpoint is written (an exception from on_save, as a kill would leave the directory), then
    the same command with --resume_from_checkpoint true finishes it. Dropout stays on, so data
    order, optimizer, scheduler and dropout RNG must all be restored; with per-batch masking so must
    the masks (Trainer restores the global RNG only after fetching the first batch past the resume
    point, so the collator masks batch k from its own seed and `MaskingResumeCallback` restores k).
    Tolerance: max |diff| <= 1e-7 (the same float ops in the same order)."""
    script = pretraining
    common = [
        "--max_steps",
        "6",
        "--save_steps",
        "3",
        "--per_device_train_batch_size",
        "4",
        "--learning_rate",
        "1e-3",
        *masking,
    ]
    script.main(pretrain_args(corpus_files, tmp_path / "full", *common))

    class KillAfterFirstCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            raise _Killed(f"killed after the checkpoint of step {state.global_step}")

    class DyingTrainer(script.Trainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.add_callback(KillAfterFirstCheckpoint())

    out = tmp_path / "resumed"
    monkeypatch.setattr(script, "Trainer", DyingTrainer)
    with pytest.raises(_Killed, match="step 3"):
        script.main(pretrain_args(corpus_files, out, *common))
    monkeypatch.undo()
    assert (out / "checkpoint-3").is_dir() and not (out / "model.safetensors").exists()
    script.main(pretrain_args(corpus_files, out, *common, "--resume_from_checkpoint", "true"))

    full, resumed = weights(tmp_path / "full"), weights(out)
    initial_gap = max_weight_diff(full, weights(out / "checkpoint-3"))
    assert initial_gap > 1e-4, "steps 4-6 changed nothing, the comparison would be empty"
    print(
        f"resumed vs uninterrupted: max |weight diff| {max_weight_diff(full, resumed):.3e} "
        f"(steps 4-6 moved {initial_gap:.3e})"
    )
    assert max_weight_diff(full, resumed) <= 1e-7
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 6


def _script_tokenizer_args(corpus_files, out, *extra):
    """pretrain_args without --tokenizer_name: the script trains its WordPiece tokenizer (vocab 500)."""
    args = pretrain_args(corpus_files, out, *extra)
    i = args.index("--tokenizer_name")
    return args[:i] + args[i + 2 :] + ["--tokenizer_vocab_size", "500"]


MULTI_COMMON = [
    "--max_steps",
    "3",
    "--save_strategy",
    "no",
    "--learning_rate",
    "3e-3",
    "--warmup_steps",  # not the recipe's warm-up: every one of the 3 steps moves the weights
    "0",
    "--config_overrides",
    "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
    "--ddp_find_unused_parameters",
    "false",
]
LAUNCH_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


def _single_process_reference(corpus_files, out, tokenizer_dir):
    """One process, batch 4, with the tokenizer the multi-process run trained (WordPiece training does not
    give the same ids twice: tokens of equal rank are numbered in hash order, hence one training, shared)."""
    args = pretrain_args(corpus_files, out, *MULTI_COMMON, "--per_device_train_batch_size", "4")
    args[args.index("--tokenizer_name") + 1] = str(tokenizer_dir)
    pretraining.main(args)
    logs = [h for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    # Not vacuous: every step had a non-zero gradient and learning rate, and AdamW moves each such
    # weight by about the learning rate (3e-3) per step, far beyond the 1e-5 tolerance.
    assert len(logs) == 3 and all(h["grad_norm"] > 1e-3 and h["learning_rate"] > 0 for h in logs), logs
    return weights(out)


@pytest.mark.slow
def test_two_gloo_processes_equal_one_process_over_the_same_global_batches(corpus_files, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on CPU (2 gloo processes, per-device batch 2)
    against one process with batch 4, 3 AdamW steps, with the script's defaults: per-batch masking
    (each example masked from (seed, step, its place in the global batch), so rank r's slice gets the
    masks the single process gives it) and a WordPiece tokenizer the script trains (once, on rank 0;
    rank 1 loads it). No dropout. Tolerance: max |diff| <= 1e-5."""
    multi = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(REPO_ROOT / "scripts" / "pretrain_mlm.py"),
            *_script_tokenizer_args(
                corpus_files, tmp_path / "ddp", *MULTI_COMMON, "--per_device_train_batch_size", "2"
            ),
        ],
        cwd=REPO_ROOT,
        env={**os.environ, **LAUNCH_ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert multi.returncode == 0, multi.stderr[-3000:]
    facts = json.loads((tmp_path / "ddp" / "training_facts.json").read_text())
    assert facts["hyperparameters"]["world_size"] == 2, "accelerate did not start 2 processes"
    assert multi.stderr.count("training a WordPiece tokenizer") == 1, "the tokenizer must be trained once, on rank 0"
    a, b = weights(tmp_path / "ddp"), _single_process_reference(corpus_files, tmp_path / "single", tmp_path / "ddp")
    print(f"2 processes vs 1: max |weight diff| {max_weight_diff(a, b):.3e}")
    assert max_weight_diff(a, b) <= 1e-5


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_machines_on_loopback_equal_one_process(corpus_files, tmp_path):
    """Two "machines": `accelerate launch --num_machines 2 --machine_rank {0,1} --main_process_ip
    127.0.0.1 --main_process_port P`, one gloo process each, per-device batch 2, the script's defaults
    (per-batch masking, a tokenizer trained by machine 0's process into the shared --output_dir and
    loaded by machine 1's). Must equal one process with batch 4 over 3 AdamW steps: max |diff| <= 1e-5."""
    port = _free_port()
    out = tmp_path / "two_machines"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--multi_gpu",
                "--num_machines",
                "2",
                "--num_processes",
                "2",
                "--machine_rank",
                str(rank),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                str(port),
                "--mixed_precision",
                "no",
                "--dynamo_backend",
                "no",
                str(REPO_ROOT / "scripts" / "pretrain_mlm.py"),
                *_script_tokenizer_args(corpus_files, out, *MULTI_COMMON, "--per_device_train_batch_size", "2"),
            ],
            cwd=REPO_ROOT,
            env={**os.environ, **LAUNCH_ENV},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            results.append((p.returncode, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (code, stderr) in enumerate(results):
        assert code == 0, f"machine {rank}: {stderr[-3000:]}"
    facts = json.loads((out / "training_facts.json").read_text())
    assert facts["hyperparameters"]["world_size"] == 2
    assert sum(stderr.count("training a WordPiece tokenizer") for _, stderr in results) == 1
    a, b = weights(out), _single_process_reference(corpus_files, tmp_path / "single", out)
    print(f"2 machines vs 1 process: max |weight diff| {max_weight_diff(a, b):.3e}")
    assert max_weight_diff(a, b) <= 1e-5
