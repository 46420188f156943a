"""Training for a wall-clock budget instead of a step count (the budgeted schedule of Cramming, Geiping &
Goldstein 2022, "Cramming: training a language model on a single GPU in one day").

`TimeBudget` is a `TrainerCallback`. Given to any `Trainer` (ours or transformers' models alike) it

- lays the learning-rate schedule over the training time: at every optimizer step the schedule named by
  `TrainingArguments.lr_scheduler_type` (linear, cosine, constant, ... from transformers' `get_scheduler`)
  is read at the fraction of the budget spent, so the rate reaches its end value when the time is up,
  whatever the speed of the machine. Warm-up: `warmup_steps` optimizer steps when it is 1 or more; a
  `warmup_steps` below 1 (transformers 5's spelling of a ratio) or `warmup_ratio` (4.x) is that share of
  the budget's time; the rate is the schedule's value times the warm-up factor;
- stops training cleanly at the first optimizer step that ends past the budget (the script then saves
  the model as after any run);
- counts training time only: from `on_train_begin` to now, less the time spent evaluating, logging and
  saving checkpoints, so evaluating often does not shorten training. Data loading, masking and the
  first-use kernel measuring are training time;
- evaluates every `eval_interval` seconds of training time when asked (the pretraining race plots
  held-out loss against seconds this way);
- writes its clock into every checkpoint, so a resumed run continues the schedule where it stopped;
- shows a progress bar in seconds of the budget (in place of Trainer's bar in steps, which has no
  known total here: remove `ProgressCallback` from the Trainer, as `scripts/pretrain_mlm.py` does).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from transformers import TrainerCallback


STATE_FILE = "time_budget_state.json"
_SCHEDULE_RESOLUTION = 100_000  # the named schedule is read on a grid of this many points over the budget


class TimeBudget(TrainerCallback):
    """Train for `seconds` of training time; see the module's docstring.

    seconds: the budget (> 0). eval_interval: evaluate every so many seconds of training time (None: only
    as `TrainingArguments` says). resume_from: the checkpoint directory a resumed run starts from (its
    clock is read from there). clock: a function returning seconds (time.perf_counter; tests pass a fake).
    """

    def __init__(
        self,
        seconds: float,
        eval_interval: float | None = None,
        resume_from: str | None = None,
        clock=time.perf_counter,
    ):
        if not seconds or seconds <= 0:
            raise ValueError(f"a time budget must be a positive number of seconds, got {seconds!r}")
        if eval_interval is not None and eval_interval <= 0:
            raise ValueError(f"eval_interval must be a positive number of seconds, got {eval_interval!r}")
        self.seconds, self.eval_interval = float(seconds), eval_interval
        self.resume_from, self.clock = resume_from, clock
        self.started = None  # clock value at on_train_begin
        self.excluded = 0.0  # seconds of evaluating / logging / saving since then
        self.carried = 0.0  # training seconds of the run this one resumes
        self.mark = None  # clock value at the end of the last optimizer step
        self.next_eval = eval_interval
        self.bar = None
        self.stopped_at = None  # (step, training seconds) where the budget ended the run
        self.frozen = None  # training seconds at on_train_end: the clock stops with training

    # -- the clock ----------------------------------------------------------------------------------

    def elapsed(self) -> float:
        """Training seconds spent so far (0 before training starts; fixed once training ends)."""
        if self.frozen is not None:
            return self.frozen
        if self.started is None:
            return self.carried
        return self.carried + self.clock() - self.started - self.excluded

    def fraction(self) -> float:
        return min(1.0, self.elapsed() / self.seconds)

    def _exclude_since_mark(self):
        now = self.clock()
        if self.mark is not None:
            self.excluded += now - self.mark
        self.mark = now

    # -- the schedule -------------------------------------------------------------------------------

    def _lay_schedule_over_time(self, args, scheduler):
        """Replace the step-based factors of Trainer's LambdaLR by time-based ones, in place."""
        import torch
        from transformers import get_scheduler

        inner = getattr(scheduler, "scheduler", scheduler)  # accelerate may wrap it
        if not isinstance(inner, torch.optim.lr_scheduler.LambdaLR):
            raise ValueError(
                f"a time budget needs a LambdaLR schedule (transformers' get_scheduler types), "
                f"got {type(inner).__name__} for lr_scheduler_type {args.lr_scheduler_type!r}"
            )
        probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        shape = get_scheduler(
            args.lr_scheduler_type,
            probe,
            num_warmup_steps=0,
            num_training_steps=_SCHEDULE_RESOLUTION,
            scheduler_specific_kwargs=dict(args.lr_scheduler_kwargs or {}),
        ).lr_lambdas[0]
        steps = args.warmup_steps or 0  # transformers 5 reads warmup_steps < 1 as a share; 4.x has warmup_ratio
        warmup_steps = int(steps) if steps >= 1 else 0
        warmup_ratio = 0.0 if warmup_steps else (steps or getattr(args, "warmup_ratio", 0.0) or 0.0)

        def factor(scheduler_steps):  # LambdaLR passes the number of steps taken (restored on resume)
            f = self.fraction()
            if warmup_steps:  # as transformers' schedules: the rate of step n (from 0) is n / warmup_steps of it
                warm = min(1.0, scheduler_steps / warmup_steps)
            elif warmup_ratio:
                warm = min(1.0, f / warmup_ratio)
            else:
                warm = 1.0
            return warm * shape(min(_SCHEDULE_RESOLUTION, int(f * _SCHEDULE_RESOLUTION)))

        inner.lr_lambdas = [factor for _ in inner.lr_lambdas]
        for group, base in zip(inner.optimizer.param_groups, inner.base_lrs):
            group["lr"] = base * factor(inner.last_epoch)
        inner._last_lr = [group["lr"] for group in inner.optimizer.param_groups]

    # -- Trainer events -----------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        if self.resume_from is not None:
            path = Path(self.resume_from, STATE_FILE)
            if not path.is_file():
                raise ValueError(
                    f"{self.resume_from} has no {STATE_FILE}: it was not saved by a run with a time "
                    "budget, so the resumed run cannot know how much of the budget was spent"
                )
            self.carried = float(json.loads(path.read_text())["training_seconds"])
            if self.eval_interval:
                self.next_eval = (int(self.carried // self.eval_interval) + 1) * self.eval_interval
        self.started = self.mark = self.clock()
        self.excluded, self.frozen = 0.0, None
        if lr_scheduler is not None:
            self._lay_schedule_over_time(args, lr_scheduler)
        if state.is_world_process_zero and not args.disable_tqdm:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=round(self.seconds),
                initial=round(min(self.carried, self.seconds)),
                dynamic_ncols=True,
                desc="training for a time budget",
                bar_format="{l_bar}{bar}| {n}/{total} s{postfix}",
            )

    def on_step_end(self, args, state, control, **kwargs):
        self.mark = self.clock()
        spent = self.elapsed()
        if self.bar is not None:
            self.bar.set_postfix_str(f"step {state.global_step}", refresh=False)
            self.bar.update(max(0, round(min(spent, self.seconds)) - self.bar.n))
        if spent >= self.seconds:
            control.should_training_stop = True
            control.should_evaluate = control.should_evaluate or self.eval_interval is not None
            self.stopped_at = (state.global_step, spent)
        elif self.eval_interval is not None and spent >= self.next_eval:
            control.should_evaluate = True
            while self.next_eval <= spent:
                self.next_eval += self.eval_interval
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._exclude_since_mark()
        if state.log_history:  # Trainer appended this entry just before calling on_log
            state.log_history[-1]["training_seconds"] = round(self.elapsed(), 3)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._exclude_since_mark()

    def on_save(self, args, state, control, **kwargs):
        self._exclude_since_mark()
        if args.process_index == 0:
            folder = Path(args.output_dir, f"checkpoint-{state.global_step}")
            if folder.is_dir():
                (folder / STATE_FILE).write_text(json.dumps({"training_seconds": self.elapsed()}))

    def on_train_end(self, args, state, control, **kwargs):
        self._exclude_since_mark()  # saving the last checkpoint, if any, is not training
        self.frozen = self.elapsed()
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def remove_step_progress_bar(trainer) -> None:
    """Trainer's progress bar counts steps towards max_steps, which a time budget leaves open: drop it
    (the `TimeBudget` bar counts seconds instead)."""
    from transformers.trainer_callback import ProgressCallback

    trainer.remove_callback(ProgressCallback)


# max_steps for a run that the budget ends: Trainer needs a step count to loop over the data.
UNBOUNDED_MAX_STEPS = 10**9
