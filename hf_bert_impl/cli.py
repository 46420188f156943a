"""The training scripts' command-line plumbing: argument preamble, one-line errors, the speed layer (`--kernels`), and
the end of a run (save, training_facts.json, loss-curve PNG, model card) that `hf_bert_impl.pretraining` and
`hf_bert_impl.finetuning` share; the machine record and JSON file of the benchmark scripts. The data they train on is
in `hf_bert_impl.data`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import sys
from collections import Counter
from pathlib import Path

from . import saving
from .hub import FACTS_FILE, save_model_card


LOSS_CURVE_FILE = "loss_curve.png"


class UsageError(ValueError):
    """A problem with the user's input (a file, a column, an option): the scripts print its message as
    one line and exit with status 2 instead of a traceback."""


def parse_script_arguments(dataclass_types, argv, logger, defaults=None):
    """The training scripts' arguments through HfArgumentParser: a single .json path on the command line
    (transformers' example convention) or the flags; then logging (info on the main process only). `defaults`
    replaces the dataclasses' defaults of those fields (a script's own recipe), in --help too."""
    import transformers
    from transformers import HfArgumentParser

    parser = HfArgumentParser(dataclass_types)
    parser.set_defaults(**(defaults or {}))
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        path = os.path.abspath(sys.argv[1])
        try:
            given = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"{path}: not a readable JSON file of arguments ({e})") from e
        if not isinstance(given, dict):
            raise UsageError(f"{path}: a JSON file of arguments holds one object, not a {type(given).__name__}")
        parsed = parser.parse_dict({**(defaults or {}), **given})
    else:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    logger.setLevel(logging.INFO if parsed[-1].should_log else logging.WARNING)
    transformers.utils.logging.set_verbosity_warning()
    return parsed


def parse_config_overrides(text: str | None) -> dict:
    """'a=1,b=0.1,c=learned,d=none' -> {'a': 1, 'b': 0.1, 'c': 'learned', 'd': None}."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        if "=" not in item:
            raise UsageError(f"--config_overrides: {item!r} is not of the form name=value")
        key, value = (s.strip() for s in item.split("=", 1))
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                pass
        else:
            value = {"none": None, "true": True, "false": False}.get(value.lower(), value)
        out[key] = value
    return out


def run_cli(main) -> int:
    """Run a script's `main()`; a UsageError (bad file, bad option) becomes one line on stderr and exit
    status 2, as argparse does, instead of a traceback; an integer `main()` returns is the exit status."""
    finished = False
    try:
        status = main()
        finished = True
    except UsageError as e:
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        return 2
    finally:
        _close_process_group(wait=finished)  # a failed rank must not wait for the others forever
    return status if isinstance(status, int) else 0


def _close_process_group(wait: bool) -> None:
    """Under `accelerate launch` / torchrun: leave together, then tear the process group down before
    the interpreter exits (left to the destructors at exit, gloo's threads can abort a process with
    "terminate called without an active exception" after the run itself has finished)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


def resolve_resume_argument(training_args) -> str | None:
    """`--resume_from_checkpoint`: "true" means the latest checkpoint-* in --output_dir (as Trainer users
    expect from `trainer.train(resume_from_checkpoint=True)`), "false" / unset means none, anything
    else must be a checkpoint directory. Bad values are UsageErrors naming them."""
    from transformers.trainer_utils import get_last_checkpoint

    resume = training_args.resume_from_checkpoint
    if resume is None or str(resume).lower() in ("false", ""):
        return None
    if str(resume).lower() == "true":
        last = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) else None
        if last is None:
            raise UsageError(f"--resume_from_checkpoint true: no checkpoint-* directory in {training_args.output_dir}")
        return last
    if not Path(resume).is_dir():
        raise UsageError(f"--resume_from_checkpoint {resume}: no such directory")
    return resume


def plot_loss_curve(log_history: list[dict], path, title: str = "loss") -> Path | None:
    """Training loss per logged step (and evaluation loss where logged) from
    `trainer.state.log_history`, drawn with matplotlib's Agg backend into `path` (PNG); None, with a
    log line, where matplotlib (the `plot` extra) is not installed."""
    try:
        import matplotlib
    except ImportError:
        logging.getLogger(__name__).warning(
            "no %s: matplotlib is not installed (pip install 'hf-bert-impl[plot]')", path
        )
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    evals = [(h["step"], h["eval_loss"]) for h in log_history if "eval_loss" in h and "step" in h]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="training loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="evaluation loss")
    if not (train or evals):
        ax.text(
            0.5,
            0.5,
            "no loss was logged (raise the step count or lower --logging_steps)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if train or evals:
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_training_facts(
    output_dir, *, task, dataset, base_model, hyperparameters, metrics, loss_curve=LOSS_CURVE_FILE, **extra
) -> Path:
    """`output_dir/training_facts.json`, the facts `hf_bert_impl.hub.save_model_card` puts in the card.
    Metrics that are not finite numbers (e.g. a perplexity that overflowed) are left out."""
    clean = {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
    facts = {
        "task": task,
        "dataset": dataset,
        "base_model": base_model,
        "hyperparameters": hyperparameters,
        "metrics": clean,
        "loss_curve": loss_curve,
        **extra,
    }
    path = Path(output_dir) / FACTS_FILE
    path.write_text(json.dumps(facts, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def default_logging_steps(training_args, num_update_steps: int | None = None) -> None:
    """Trainer logs every 500 steps by default, which leaves short runs without a loss curve: when
    the user kept that default, log about 50 points over the run instead."""
    if training_args.logging_steps == 500 and training_args.logging_strategy == "steps":
        steps = training_args.max_steps if training_args.max_steps > 0 else num_update_steps
        if steps:
            training_args.logging_steps = max(1, steps // 50)


KERNELS_HELP = (
    "the speed layer (hf_bert_impl.kernelize): auto (the kernels hf_bert_impl.kernels_bert_impl.KERNEL_TABLE names "
    "for the device, training or inference, and dtype), reference (the plain model) or kernel names to force, "
    "comma-separated (hf_bert_impl.kernels_bert_impl.KERNELS). The saved model is the same either way."
)


def check_kernels_argument(kernels: str) -> None:
    """`--kernels`: a UsageError naming the value unless it is auto, reference or kernel names."""
    from .kernels_bert_impl import kernel_names

    try:
        kernel_names(kernels)
    except ValueError as e:
        raise UsageError(f"--kernels: {e}") from None


def apply_kernels(model, kernels: str, logger):
    """`hf_bert_impl.kernelize(model, kernels)`, logged; returns the model. The config and the saved files stay those
    of the plain model."""
    from .kernels_bert_impl import kernelize, kernelized

    check_kernels_argument(kernels)
    kernelize(model, kernels)
    logger.info("kernels %r: %d modules run the speed layer", kernels, len(kernelized(model)))
    return model


def kernels_in_use(kernels: str, device_type: str, dtype, modes=("training", "inference")) -> dict[str, list[str]]:
    """{mode: the kernels `kernels` runs in that mode ("training" or "inference")} on a device type and dtype:
    `KERNEL_TABLE`'s entry under "auto" (kernels_bert_impl.table_kernels), the forced names, none under "reference"."""
    from .kernels_bert_impl import kernel_names, table_kernels

    setting = kernel_names(kernels)
    if setting == "reference":
        return {mode: [] for mode in modes}
    if setting != "auto":
        return {mode: sorted(setting) for mode in modes}
    return {mode: list(table_kernels(device_type, mode == "training", dtype)) for mode in modes}


def kernel_facts(model, kernels: str, modes=("training", "inference")) -> dict:
    """What the speed layer put on `model` in this run, for its facts: the setting; the kernels it runs per mode of
    `modes` (`kernels_in_use` on the model's device type and parameter dtype: under autocast over float32 weights the
    encoder's input is still float32); how many of the model's modules run each kernel function
    (hf_bert_impl.kernelized; none for "reference": the plain model); and whether its masked-LM heads predict the
    labelled positions only (`config.sparse_prediction`)."""
    from .kernels_bert_impl import kernelized

    parameter = next(model.parameters())
    return {
        "setting": kernels,
        "kernels": kernels_in_use(kernels, parameter.device.type, parameter.dtype, modes),
        "kernelized": dict(sorted(Counter(kernelized(model).values()).items())),
        "sparse_prediction": bool(getattr(model.config, "sparse_prediction", False)),
    }


def log_kernel_facts(facts: dict, logger) -> None:
    """The kernels a run used, in one line on `logger` (info)."""
    modes = "; ".join(f"{mode}: {', '.join(names) or 'none'}" for mode, names in facts["kernels"].items())
    sparse = "on" if facts["sparse_prediction"] else "off"
    count = sum(facts["kernelized"].values())
    logger.info("kernels %s (%s); %d modules kernelized; sparse prediction %s", facts["setting"], modes, count, sparse)


def save_trained(trainer, train_result) -> dict:
    """Right after `trainer.train()`: the model, the tokenizer and training_args.bin (`trainer.save_model`) into
    `--output_dir`, each file complete under a temporary name first, then moved into place (`hf_bert_impl.saving`:
    a crash never leaves a torn file there), and the trainer state; logs the training metrics and returns them.
    Every process stages its own writes (the other ranks join save_model's collectives and write nothing, or their
    own shards under DeepSpeed / sharded FSDP)."""
    with saving.staged(trainer.args.output_dir) as staging:
        trainer.save_model(staging)
    trainer.save_state()
    metrics = dict(train_result.metrics)
    trainer.log_metrics("train", metrics)
    return metrics


def mixed_precision(args) -> str | None:
    """TrainingArguments' mixed precision as a run's facts name it: "bf16", "fp16" (autocast; float32 weights) or
    None (float32)."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else None


def run_hyperparameters(trainer) -> dict:
    """The hyperparameters every training run records in its facts (a script adds its own)."""
    args = trainer.args
    return {
        "learning_rate": args.learning_rate,
        "train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "world_size": args.world_size,
        "max_steps": args.max_steps if args.max_steps > 0 else trainer.state.global_step,
        "warmup_steps": args.warmup_steps,
        "weight_decay": args.weight_decay,
        "mixed_precision": mixed_precision(args),
        "seed": args.seed,
    }


def finish_run(trainer, *, title: str, task: str, hyperparameters: dict, **facts) -> Path | None:
    """The end of a training script, once the model is saved: on the main process, the loss curve
    (`title`), `training_facts.json` (`run_hyperparameters` plus the script's `hyperparameters`, and
    the other `facts`: dataset, base_model, metrics, ...) and the model card rendered from them, all
    in `--output_dir`. Returns that directory on the main process, None on the others."""
    if not trainer.is_world_process_zero():
        return None
    out = Path(trainer.args.output_dir)
    curve = plot_loss_curve(trainer.state.log_history, out / LOSS_CURVE_FILE, title=title)
    hyperparameters = {**run_hyperparameters(trainer), **hyperparameters}
    write_training_facts(out, task=task, hyperparameters=hyperparameters, loss_curve=curve and curve.name, **facts)
    save_model_card(out)
    return out


def machine_record(device=None) -> dict:
    """What a benchmark ran on: lscpu's model name, cores, torch threads, versions, the GPU, load averages."""
    import torch
    import transformers

    from . import __version__

    cpu, cpuinfo = platform.processor() or platform.machine(), {}
    try:
        with open("/proc/cpuinfo") as f:  # lscpu's "Model name", "CPU family" and "Model" of the first CPU
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                cpuinfo[key.strip()] = value.strip()
    except OSError:
        pass
    info = {
        "cpu": cpuinfo.get("model name", cpu),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "hf_bert_impl": __version__,
    }
    if "cpu family" in cpuinfo:  # tells apart CPUs of one model name (AMD EPYC Zen 3: 25/1, Zen 4: 25/17)
        info["cpu_family_model"] = f"{cpuinfo['cpu family']}/{cpuinfo.get('model', '?')}"
    if device is not None and device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        info["load_average_at_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def write_result_json(result: dict, path) -> None:
    """A benchmark's result as JSON at `path` (folders made as needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
