"""The jitted pieces of a Trainer, each compiled once: the AOT train step (with the FLOPs
and memory XLA reports for it), the held-out evaluation, and the learning-rate table.

A mixin of ``workbench.train._trainer.Trainer``: it reads the Trainer's ``config``,
``parts``, ``mesh`` and ``rules``.
"""
from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

#: Steps of the learning-rate table one jitted call fills.
_LR_BLOCK = 4096


class Compiled:
    """A Trainer's compiled step, evaluator and learning rates."""

    _compiled: Any
    _evaluator: Any
    _lr_fn: Any
    _lr_blocks: dict[int, np.ndarray]

    def compiled_step(self) -> Any:
        """The AOT-compiled train step (compiled once, timed, logged as an event)."""
        if self._compiled is None:
            from workbench._flops import compiled_flops
            from workbench._step import jit_train_step, make_train_step

            p = self.parts
            fn = make_train_step(p.graphdef, p.tx, rules=self.rules, mesh=self.mesh,
                                 pipeline=self.config.pipeline)
            jitted = jit_train_step(fn, p.shardings, p.batch_shardings, donate=True,
                                    compiler_options=p.compile_options)
            t0 = time.perf_counter()
            self._compiled = jitted.lower(p.abstract_state, p.abstract_batch).compile()
            self.compile_seconds = time.perf_counter() - t0
            flops = compiled_flops(self._compiled)
            self.compiled_flops = flops * self.config.optimizer.accumulate if flops else None
            mem = self._compiled.memory_analysis()
            self.memory_per_device = None if mem is None else {
                k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0)
                for k in ("argument", "output", "temp", "generated_code")}
        return self._compiled

    def evaluator(self) -> Any:
        """The held-out evaluation (``workbench.train._evaluate.Evaluator``), or None when
        ``config.eval_every`` is 0."""
        if not self.config.eval_every:
            return None
        if self._evaluator is None:
            from workbench.train._evaluate import Evaluator

            p = self.parts
            self._evaluator = Evaluator(p.graphdef, p.eval_data, p.shardings.params,
                                        rules=self.rules, mesh=self.mesh)
        return self._evaluator

    def lr(self, step: int) -> float:
        """Learning rate of update ``step`` (1-based): ``schedule(step - 1)``.

        Evaluated by one jitted function on blocks of 4096 steps (compiled once).
        """
        block, i = divmod(step - 1, _LR_BLOCK)
        table = self._lr_blocks.get(block)
        if table is None:
            if self._lr_fn is None:
                self._lr_fn = jax.jit(jax.vmap(self.parts.schedule))
            steps = np.arange(block * _LR_BLOCK, (block + 1) * _LR_BLOCK, dtype=np.int32)
            table = self._lr_blocks[block] = np.asarray(self._lr_fn(steps))
        return float(table[i])
