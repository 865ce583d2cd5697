"""The run loop: steps, metrics, checkpoints, stop requests, and what the user is told.

Steps are dispatched asynchronously: the metrics of step ``k`` are fetched after step
``k + 1`` has been queued, so the host's logging overlaps the device's work. At a
checkpoint step (every ``checkpoint_every``, the target, or a stop request) the step's
metrics are checked first, so a NaN state is never saved. A small state keeps the
pipeline going through a checkpoint: it is snapshotted on device (``Checkpoints.snapshot``)
and step ``k + 1`` is queued before step ``k`` is checked and its snapshot saved; the
target and a stop request save the state itself, at once.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import TYPE_CHECKING, Any

import jax

from workbench import runs
from workbench._notebook import in_notebook
from workbench.train.checkpoint import CheckpointError
from workbench.train.metrics import ProgressLine, TensorBoard, step_record
from workbench.train.signals import StopSignals

if TYPE_CHECKING:
    from workbench.train.trainer import Trainer


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


def make_progress(tr: Trainer, target: int) -> Any:
    """The live panel in a notebook, a progress line elsewhere, or None."""
    mode = tr.progress
    if mode is None or not tr.primary:
        return None
    if mode == "auto":
        mode = "widget" if in_notebook() else "line"
    if mode == "widget":
        from workbench.widgets.train_panel import TrainPanel

        panel = TrainPanel(tr.run_dir, target=target, start=tr.step)
        panel.display()
        return panel
    if mode == "line":
        return ProgressLine(target)
    raise ValueError(f"progress={mode!r}; use 'auto', 'widget', 'line' or None")


class NonFiniteLoss(FloatingPointError):
    """The loss or gradient norm became NaN/inf; the run stopped (see the message)."""


class _Finisher:
    """Fetches a step's metrics, checks them, saves when asked, and logs the record."""

    def __init__(self, tr: Trainer, sinks: list[Any]) -> None:
        self.tr, self.sinks = tr, sinks
        self.tokens = tr.config.tokens_per_step
        self.t_prev = time.perf_counter()
        self.last_saved = tr.checkpoints.latest_step()

    def __call__(self, step: int, outs: list[dict[str, Any]], data_time: float,
                 save: Any = None) -> None:
        """Logs step ``step``; then saves ``save`` (a state pytree or a Snapshot) if given."""
        tr = self.tr
        values = jax.device_get(outs)                   # blocks until the step is done
        loss = math.fsum(float(v["loss"]) for v in values) / len(values)
        grad_norm = math.fsum(float(v["grad_norm"]) for v in values) / len(values)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            kept = f"checkpoint step {self.last_saved}" if self.last_saved else "no checkpoint"
            what = f"loss is {loss}" if not math.isfinite(loss) else \
                f"gradient norm is {grad_norm} (loss {loss:.4f})"
            raise NonFiniteLoss(
                f"{what} at step {step}; training stopped. "
                f"The last good checkpoint is kept ({kept} in {tr.checkpoints.directory}); "
                "nothing after it was saved. Lower optimizer.lr, keep clip_norm on, or check "
                f"the data, then re-run: it continues from step {self.last_saved or 0}.")
        ckpt_time = 0.0
        if save is not None:
            meta = {"config": tr.config.to_dict(), "loss": loss}
            ckpt_time = tr.checkpoints.save(step, save, data=tr.parts.data, meta=meta,
                                            force=True)
            self.last_saved = step
        now = time.perf_counter()
        p = tr.parts
        rec = step_record(
            step=step, loss=loss, grad_norm=grad_norm, lr=tr.lr(step),
            step_time=now - self.t_prev, data_time=data_time, ckpt_time=ckpt_time,
            tokens=self.tokens, model_flops=p.model_flops, n_devices=p.n_devices,
            peak=p.peak, peak_source=p.peak_source,
            compiled_flops=getattr(tr, "compiled_flops", None))
        self.t_prev = now
        tr.history.append(rec)
        for sink in self.sinks:
            sink(rec)


def _steps(tr: Trainer, state: Any, target: int, stop: StopSignals, finish: _Finisher) -> Any:
    compiled = tr.compiled_step()
    acc, every, data = tr.config.optimizer.accumulate, tr.config.checkpoint_every, tr.parts.data
    pending: tuple[int, list[Any], float, Any] | None = None
    finish.t_prev = time.perf_counter()
    while tr.step < target:
        t0 = time.perf_counter()
        batches = [next(data) for _ in range(acc)]
        data_time = time.perf_counter() - t0
        outs = []
        for batch in batches:
            state, metrics = compiled(state, batch)
            outs.append(metrics)
        tr._state = state
        tr.step += 1
        if pending is not None:
            finish(*pending)
        pending = (tr.step, outs, data_time, None)
        stopping = stop.should_stop(tr.step)
        if tr.step % every == 0 or tr.step == target or stopping:
            save = {"train": state, "rng": tr._rng}
            last = tr.step == target or stopping
            snap = None if last else tr.checkpoints.snapshot(save, data)
            if snap is None:
                finish(tr.step, outs, data_time, save)
                pending = None
            else:  # saved once step k + 1 is queued and step k's loss is known to be finite
                pending = (tr.step, outs, data_time, snap)
        if stopping:
            break
    return state


def run_loop(tr: Trainer, state: Any, target: int) -> RunResult:
    """Trains ``tr`` from its current step to ``target``; see ``Trainer.run``."""
    progress = make_progress(tr, target)
    compiled_now = tr._compiled is None
    if compiled_now:
        if progress is not None:
            progress.event("compiling")
        tr.compiled_step()
        if progress is not None:
            progress.event("compiled", seconds=tr.compile_seconds)
    writer = runs.RunWriter(tr.run_dir, config=tr.config.to_dict(),
                            meta=tr.run_meta(target)) if tr.primary else None
    sinks: list[Any] = []
    board = TensorBoard(tr.run_dir / "tensorboard") if tr.tensorboard and tr.primary else None
    if writer is not None:
        if tr._config_event is not None:
            writer.event(**tr._config_event, step=tr.step)
            tr._config_event = None
        if tr._inherited and not tr.checkpoints.all_steps():
            for rec in tr.history:            # a fork's first run: the source's curve so far
                writer.log(rec)
        if compiled_now:
            writer.event("compile", seconds=tr.compile_seconds, cache=tr.compile_cache)
        if tr.step > 0:
            writer.event("resume", step=tr.step)
        sinks.append(writer.log)
    sinks += [s.log for s in (board,) if s is not None]
    if progress is not None:
        sinks.append(progress.update)
    finish = _Finisher(tr, sinks)
    start = tr.step
    status, message, error = "finished", "", None
    with StopSignals(distributed=jax.process_count() > 1) as stop:
        try:
            state = _steps(tr, state, target, stop, finish)
            tr.checkpoints.wait()
            if tr.step < target:
                status = "interrupted"
                message = (f"{stop.signal}: stopped at step {tr.step} of {target}; checkpoint "
                           f"step {tr.step} saved in {tr.checkpoints.directory}. Re-run "
                           f"trainer.run({target}) (or this cell, or a new Trainer on "
                           f"{str(tr.run_dir)!r}) to continue from step {tr.step}.")
            else:
                message = (f"finished: step {tr.step} of {target} "
                           f"({tr.step - start} steps this call).")
        except KeyboardInterrupt:
            tr._state = None  # the step in flight may have consumed the state's buffers
            status, error = "interrupted", "KeyboardInterrupt"
            last = _wait_quietly(tr)
            message = (f"aborted during step {tr.step} without saving; the newest checkpoint "
                       f"is step {last}. Re-run to continue from step {last}.")
            _reload_quietly(tr)
            raise
        except Exception as e:  # NonFiniteLoss, CheckpointError, ...
            tr._state, status, error = None, "failed", f"{type(e).__name__}: {e}"
            _wait_quietly(tr)
            _reload_quietly(tr)
            raise
        finally:
            if writer is not None:
                writer.close(status, error=error if status == "failed" else None)
            if board is not None:
                board.close()
            if progress is not None:
                progress.finish(status, message or error)
            if (message and tr.primary and status != "finished"
                    and not isinstance(progress, ProgressLine)):  # how to continue
                print(message, file=sys.stderr, flush=True)
    return RunResult(status=status, step=tr.step, target=target, message=message)


def _wait_quietly(tr: Trainer) -> int:
    """Waits for in-flight saves after a failure; returns the newest committed step."""
    try:
        tr.checkpoints.wait()
    except CheckpointError:
        pass
    return tr.checkpoints.latest_step() or 0


def _reload_quietly(tr: Trainer) -> None:
    """After a failure: back to the newest good checkpoint (step, state, data position)."""
    try:
        tr._load(tr._source)
    except Exception:  # noqa: BLE001 - the state stays None and reloads on next use
        tr._state = None
