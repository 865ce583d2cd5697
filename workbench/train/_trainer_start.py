"""The state a Trainer's run starts from when no checkpoint holds it (step 0).

The seed's initialisation, or the parameters of ``Trainer(initial_model=...)`` (a plan's
``materialize``), or ``TrainConfig.init``'s Hugging Face weights (a folder, or a Hub id at
the commit ``run.json`` recorded, so a resume loads the same weights), laid out by the
run's sharding rules; for a LoRA run, the frozen base and fresh adapters. A mixin of
``workbench.train._trainer.Trainer``: it reads the Trainer's ``config``, ``parts``,
``mesh``, ``rules``, ``run_dir`` and ``_initial_model``, and sets its state, step and key.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from workbench import _runs as runs


class StartState:
    """Step 0 of a Trainer's run: its state, PRNG key and (for ``init``) weights' record."""

    _initial_model: Any
    _init_resolved: Any

    def _init_state(self) -> None:
        """Step 0: the state from ``initial_model`` / ``config.init``, else from the seed."""
        if self._initial_model is not None or self.config.init is not None:
            self._state = self._state_from_model(self._initial_model)
        else:
            from workbench._step import init_state

            _, self._state = init_state(self.parts.model_config, self.parts.tx, self.rules,
                                        self.mesh, seed=self.config.seed)
        self._rng = self._new_rng()
        self.step = 0
        self.parts.data.set_state(self.parts.initial_data_state)

    def _new_rng(self) -> Any:
        """The run's base PRNG key (typed), replicated over the mesh: a global array, so
        every process saves the same key in a multi-process checkpoint."""
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return jax.jit(lambda: jax.random.key(self.config.seed), out_shardings=replicated)()

    def _abstract_rng(self) -> Any:
        key = jax.eval_shape(lambda: jax.random.key(0))
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)

    def _state_from_model(self, model: Any) -> Any:
        """A fresh TrainState whose params are ``model``'s, laid out by this run's rules."""
        from flax import nnx

        from workbench._train_state import TrainState

        if model is None:   # TrainConfig.init: an HF folder, read into this run's shardings
            from workbench._hf_format.load import check_weights
            from workbench._hub import MODEL_FILES

            hub = self._init_hub(MODEL_FILES)
            if hub is not None:
                check_weights(hub, "TrainConfig", arg="init")
                self._init_resolved = hub
            params = self._base_params(hub)
            if self._lora:   # fresh adapters (B = 0) on the loaded base
                params = self._lora.combine(params, self._seed_params(adapters=True))
            model = nnx.merge(self.parts.graphdef, params)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        want = self.parts.abstract_state.params
        if jax.tree.structure(params) != jax.tree.structure(want):
            raise ValueError("the model's parameters do not match the config's model "
                             f"({self.parts.model_config}); pass the model of the same plan")
        sh = self.parts.shardings
        params = jax.device_put(params, sh.params)
        tx = self._lora.for_params(self.parts.tx, params) if self._lora else self.parts.tx
        opt_state = jax.jit(tx.init, out_shardings=sh.opt_state)(params)
        step = jax.device_put(np.zeros((), np.int32), sh.step)
        return TrainState(step=step, params=params, opt_state=opt_state)

    @property
    def _lora(self) -> Any:
        """``workbench.models._lora`` for a LoRA run (``TrainConfig.lora``, or a model config
        with adapters, e.g. from a plan), else None."""
        if getattr(self.parts.model_config, "lora", None) is None:
            return None
        from workbench.models import _lora as lora

        return lora

    def _base_params(self, hub: Any = None) -> Any:
        """The frozen weights: ``init``'s (a LoRA run's base, loaded into this run's
        shardings without its adapters) or, without ``init``, the seed's (a LoRA run's:
        the same bits as at step 0)."""
        shardings = self.parts.shardings.params
        cfg = self.parts.model_config
        if self._lora:
            shardings = self._lora.split_params(shardings)[0]
            cfg = cfg.replace(lora=None)
        if self.config.init is None:
            return self._seed_params(adapters=False)
        from workbench._hf_format.load import check_weights, load_params
        from workbench._hub import MODEL_FILES

        if hub is None:
            hub = self._init_hub(MODEL_FILES)
        if hub is not None:
            check_weights(hub, "TrainConfig", arg="init")
            self._init_resolved = hub
        params, source = load_params(hub.path if hub else self.config.init, cfg, shardings,
                                     hub=hub)
        self._say(f"initialised from {source.family} checkpoint {source.path}"
                  + (f" ({hub.repo_id} at commit {hub.revision})" if hub else ""))
        return params

    def _seed_params(self, *, adapters: bool) -> Any:
        """The adapters (or the base) of a LoRA model initialised from the run's seed,
        straight into their shards (XLA drops the other part's initialisation)."""
        from workbench._step import seed_params

        lora, every = self._lora, self.parts.shardings.params
        part = 1 if adapters else 0

        def init(key: Any) -> Any:
            return lora.split_params(seed_params(self.parts.model_config, every, key))[part]

        shardings = lora.split_params(every)[part]
        return jax.jit(init, out_shardings=shardings)(jax.random.key(self.config.seed))

    def _recorded_init(self) -> dict[str, Any]:
        """``run.json``'s ``init`` record of this run, if it has one for this Hub id."""
        try:
            rec = runs.read_run(self.run_dir).get("init") or {}
        except (OSError, ValueError):
            return {}
        ok = isinstance(rec, dict) and rec.get("repo_id") == self.config.init \
            and isinstance(rec.get("revision"), str)
        return rec if ok else {}

    def _init_hub(self, files: list[str]) -> Any:
        """``TrainConfig.init``'s Hub snapshot (None for a local folder), at the commit the
        run recorded when it started (a resume loads the same weights), else at
        ``init_revision`` ("main")."""
        from workbench._hub import is_hub_id, resolve

        if not is_hub_id(self.config.init):
            return None
        revision = self._recorded_init().get("revision") or self.config.init_revision
        return resolve(self.config.init, revision=revision, files=files,
                       where="TrainConfig", arg="init")

    def _init_record(self) -> dict[str, Any]:
        """``run.json``'s ``init``: the folder, and for a Hub id the id and commit."""
        from workbench._hub import CONFIG_FILES

        hub = getattr(self, "_init_resolved", None) or self._recorded_init() or \
            self._init_hub(CONFIG_FILES)
        if hub is None:
            return {"format": "huggingface", "path": str(Path(self.config.init).resolve())}
        if isinstance(hub, dict):
            return hub
        return {"format": "huggingface", "path": str(hub.path), "repo_id": hub.repo_id,
                "revision": hub.revision}
