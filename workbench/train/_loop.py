"""The run loop: steps, metrics, checkpoints, stop requests, and what the user is told.

Steps are dispatched asynchronously: the metrics of step ``k`` are fetched after step
``k + 1`` has been queued, so the host's logging overlaps the device's work. At a
checkpoint step (every ``checkpoint_every``, the target, or a stop request) the step's
metrics are checked first, so a NaN state is never saved. A small state keeps the
pipeline going through a checkpoint: it is snapshotted on device (``Checkpoints.snapshot``)
and step ``k + 1`` is queued before step ``k`` is checked and its snapshot saved; the
target and a stop request save the state itself, at once.

The loop never sees the Trainer: it gets what it uses as :class:`LoopInputs` and reports
through sinks (``workbench.train._sinks``): ``update`` with each step's record, exactly
once and in order, and ``finish`` with the call's status and message.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from workbench.train._checkpoint import CheckpointError, Checkpoints
from workbench.train._metrics import moe_record
from workbench.train._sinks import Sink
from workbench.train._signals import StopSignals


@dataclasses.dataclass
class RunResult:
    """What ``Trainer.run`` returns.

    Attributes:
      status: "finished" (target reached), "interrupted" (Ctrl-C / SIGTERM) or "failed".
      step: steps done in total.
      target: the step the call trained towards.
      message: what happened and how to continue.
    """

    status: str
    step: int
    target: int
    message: str = ""

    def __repr__(self) -> str:
        return f"RunResult(status={self.status!r}, step={self.step}, target={self.target})"


class NonFiniteLoss(FloatingPointError):
    """The loss or gradient norm became NaN/inf; the run stopped (see the message)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopInputs:
    """Everything the run loop uses, passed explicitly (the loop never sees the Trainer).

    Attributes:
      step_fn: the compiled train step, ``(state, batch) -> (state, metrics)``; donates
        the state.
      rng: the run's base PRNG key, saved with every checkpoint.
      data: the input pipeline (``next(data)`` is a batch; its position is checkpointed).
      checkpoints: where checkpoints are saved.
      accumulate: micro-batches (train-step calls) per update.
      checkpoint_every: save every this many updates (also at the target and on a stop).
      config: the run's config as a dict, stored with every checkpoint.
      lr: learning rate of update ``k`` (1-based).
      record: a step's record from ``step``, ``loss``, ``grad_norm``, ``lr``,
        ``step_time``, ``data_time`` and ``ckpt_time`` (``metrics.step_record`` with the
        run's constants bound).
      sinks: where records and the end of the call are reported, in order.
      run_dir: the run directory (named in the message on how to continue).
      evaluate: None, or ``state -> device values`` of the held-out eval
        (``workbench.train._evaluate.Evaluator``), dispatched after every
        ``eval_every``-th update; its numbers join that step's record.
      eval_every: updates between evaluations (with ``evaluate``).
      saved: what a checkpoint holds of the state (None: all of it).
    """

    step_fn: Callable[[Any, Any], tuple[Any, Any]]
    rng: Any
    data: Any
    checkpoints: Checkpoints
    accumulate: int
    checkpoint_every: int
    config: dict[str, Any]
    lr: Callable[[int], float]
    record: Callable[..., dict[str, Any]]
    sinks: Sequence[Sink]
    run_dir: Path
    evaluate: Callable[[Any], Any] | None = None
    eval_every: int = 0
    #: the part of the train state a checkpoint holds (LoRA: the adapters and their
    #: optimizer state, ``workbench.models._lora.saved_state``); None: all of it
    saved: Callable[[Any], Any] | None = None


class _Run:
    """One call of the loop: the step reached, the live state, and each step's finishing
    (fetch its metrics, check them, save when asked, report the record)."""

    def __init__(self, inputs: LoopInputs, state: Any, step: int) -> None:
        self.inputs, self.state, self.step = inputs, state, step
        self.updates = tuple(sink.update for sink in inputs.sinks)
        self.last_saved = inputs.checkpoints.latest_step()
        self.t_prev = time.perf_counter()

    def finish(self, step: int, outs: list[dict[str, Any]], data_time: float,
               save: Any = None, evaluated: Any = None) -> None:
        """Reports step ``step``; first saves ``save`` (a state pytree or a Snapshot) if given;
        ``evaluated``: the step's eval values in flight (``Evaluator``), or None."""
        inp = self.inputs
        values = jax.device_get(outs)                   # blocks until the step is done
        loss = math.fsum(float(v["loss"]) for v in values) / len(values)
        grad_norm = math.fsum(float(v["grad_norm"]) for v in values) / len(values)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise NonFiniteLoss(self._non_finite(step, loss, grad_norm))
        ckpt_time = 0.0
        if save is not None:
            ckpt_time = inp.checkpoints.save(step, save, data=inp.data, force=True,
                                             meta={"config": inp.config, "loss": loss})
            self.last_saved = step
        now = time.perf_counter()
        rec = inp.record(step=step, loss=loss, grad_norm=grad_norm, lr=inp.lr(step),
                         step_time=now - self.t_prev, data_time=data_time,
                         ckpt_time=ckpt_time)
        rec.update(moe_record(values))   # mixture of experts: router load per step
        if evaluated is not None:
            from workbench.train._evaluate import eval_record

            rec.update(eval_record(evaluated))
        self.t_prev = now
        for update in self.updates:
            update(rec)

    def _non_finite(self, step: int, loss: float, grad_norm: float) -> str:
        kept = f"checkpoint step {self.last_saved}" if self.last_saved else "no checkpoint"
        what = f"loss is {loss}" if not math.isfinite(loss) else \
            f"gradient norm is {grad_norm} (loss {loss:.4f})"
        return (f"{what} at step {step}; training stopped. The last good checkpoint is kept "
                f"({kept} in {self.inputs.checkpoints.directory}); nothing after it was "
                "saved. Lower optimizer.lr, keep clip_norm on, or check the data, then "
                f"re-run: it continues from step {self.last_saved or 0}.")

    def steps(self, target: int, stop: StopSignals) -> None:
        """Trains to ``target`` or to a stop request, one update ahead of its reporting."""
        inp = self.inputs
        compiled, acc, every, data = inp.step_fn, inp.accumulate, inp.checkpoint_every, inp.data
        state = self.state
        pending: tuple[int, list[Any], float, Any, Any] | None = None
        self.t_prev = time.perf_counter()
        while self.step < target:
            t0 = time.perf_counter()
            batches = [next(data) for _ in range(acc)]
            data_time = time.perf_counter() - t0
            outs = []
            for batch in batches:
                state, metrics = compiled(state, batch)
                outs.append(metrics)
            self.state = state
            self.step = step = self.step + 1
            # the eval reads this step's state before the next step (which donates it) runs
            evaluated = inp.evaluate(state) if inp.evaluate is not None and \
                step % inp.eval_every == 0 else None
            if pending is not None:
                self.finish(*pending)
            pending = (step, outs, data_time, None, evaluated)
            stopping = stop.should_stop(step)
            if step % every == 0 or step == target or stopping:
                save = {"train": state if inp.saved is None else inp.saved(state),
                        "rng": inp.rng}
                last = step == target or stopping
                snap = None if last else inp.checkpoints.snapshot(save, data)
                if snap is None:
                    self.finish(step, outs, data_time, save, evaluated)
                    pending = None
                else:  # saved once step k + 1 is queued and step k's loss is known to be finite
                    pending = (step, outs, data_time, snap, evaluated)
            if stopping:
                break


def run_loop(inputs: LoopInputs, state: Any, *, start: int, target: int
             ) -> tuple[RunResult, Any]:
    """Trains ``state`` from update ``start`` to ``target``; see ``Trainer.run``.

    Returns:
      ``(result, state)``: what happened, and the state after the last update.

    Raises:
      NonFiniteLoss, CheckpointError, KeyboardInterrupt: after the sinks were finished
        (the state is then lost: reload it from the newest checkpoint).
    """
    run = _Run(inputs, state, start)
    ckpts = inputs.checkpoints
    status, message, error = "finished", "", None
    with StopSignals(distributed=jax.process_count() > 1) as stop:
        try:
            run.steps(target, stop)
            ckpts.wait()
            if run.step < target:
                status = "interrupted"
                message = (f"{stop.signal}: stopped at step {run.step} of {target}; checkpoint "
                           f"step {run.step} saved in {ckpts.directory}. Re-run "
                           f"trainer.run({target}) (or this cell, or a new Trainer on "
                           f"{str(inputs.run_dir)!r}) to continue from step {run.step}.")
            else:
                message = (f"finished: step {run.step} of {target} "
                           f"({run.step - start} steps this call).")
        except KeyboardInterrupt:
            status, error = "interrupted", "KeyboardInterrupt"
            last = _wait_quietly(ckpts)
            message = (f"aborted during step {run.step} without saving; the newest checkpoint "
                       f"is step {last}. Re-run to continue from step {last}.")
            raise
        except Exception as e:  # NonFiniteLoss, CheckpointError, ...
            status, error = "failed", f"{type(e).__name__}: {e}"
            _wait_quietly(ckpts)
            raise
        finally:
            for sink in inputs.sinks:
                sink.finish(status, message or error)
    return RunResult(status=status, step=run.step, target=target, message=message), run.state


def _wait_quietly(checkpoints: Checkpoints) -> int:
    """Waits for in-flight saves after a failure; returns the newest committed step."""
    try:
        checkpoints.wait()
    except CheckpointError:
        pass
    return checkpoints.latest_step() or 0
