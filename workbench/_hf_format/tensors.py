"""Which Hugging Face tensors make each GPT parameter, and how: names, stacking over layers
and experts, reshapes and transposes, read slice by slice from a safetensors folder."""
from __future__ import annotations

import dataclasses
import json
import math
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from workbench.models._config import GPTConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_L = "model.layers.{layer}."


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mapping_:
    """One GPT parameter as HF tensors.

    Attributes:
        path: the parameter's path in ``nnx.to_pure_dict`` (``("blocks", 0, "attn", "q")``;
            scanned models have no layer index).
        hf: the HF tensor name, with ``{layer}`` / ``{expert}`` where it repeats.
        stack: leading axes of the parameter that enumerate HF tensors: "layers" (scanned
            blocks), "experts" (MoE experts), in order.
        split: the HF tensor reshaped to these sizes ("view")...
        groups: ...where HF axis ``i`` is the view axes ``groups[i]`` (consecutive)...
        perm: ...and the parameter's core is ``view.transpose(perm)``.
        layer: the block index of an unrolled parameter (None: not per block, or scanned).
    """

    path: tuple[Any, ...]
    hf: str
    stack: tuple[str, ...]
    split: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    layer: int | None = None

    @property
    def name(self) -> str:
        """Dotted parameter path (``blocks.0.attn.q``)."""
        return ".".join(str(p) for p in self.path)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(self.split[a] for a in g) for g in self.groups)

    @property
    def core_shape(self) -> tuple[int, ...]:
        return tuple(self.split[a] for a in self.perm)

    def hf_names(self, n_layers: int, n_experts: int) -> Iterator[tuple[tuple[int, ...], str]]:
        """``(stack index, HF name)`` of every HF tensor of this parameter."""
        sizes = [n_layers if s == "layers" else n_experts for s in self.stack]
        for idx in np.ndindex(*sizes):
            yield idx, self.hf_name(idx)

    def hf_name(self, idx: tuple[int, ...]) -> str:
        """The HF tensor at stack index ``idx``."""
        keys = dict(zip(self.stack, idx, strict=True))
        layer = keys.get("layers", self.layer)
        return self.hf.format(layer=layer, expert=keys.get("experts"))

    def to_hf(self, core: np.ndarray) -> np.ndarray:
        """The HF tensor of a core block of this parameter (whole, not a slice)."""
        view = np.transpose(core, np.argsort(self.perm))
        return np.ascontiguousarray(view.reshape(self.hf_shape))


def _m(path: tuple[Any, ...], hf: str, stack: tuple[str, ...], kind: str,
       shape: tuple[int, ...], layer: int | None) -> Mapping_:
    """A mapping of a ``kind`` of transform for a core ``shape`` (ours)."""
    if kind == "copy":          # same shape
        split, groups, perm = shape, tuple((i,) for i in range(len(shape))), \
            tuple(range(len(shape)))
    elif kind == "T":           # ours (a, b) = HF (b, a).T
        split, groups, perm = (shape[1], shape[0]), ((0,), (1,)), (1, 0)
    elif kind == "heads_in":    # ours (D, n, H) = HF (n*H, D)
        d, n, h = shape
        split, groups, perm = (n, h, d), ((0, 1), (2,)), (2, 0, 1)
    elif kind == "heads_out":   # ours (N, H, D) = HF (D, N*H)
        n, h, d = shape
        split, groups, perm = (d, n, h), ((0,), (1, 2)), (1, 2, 0)
    elif kind == "heads_bias":  # ours (n, H) = HF (n*H,)
        split, groups, perm = shape, ((0, 1),), (0, 1)
    else:
        raise ValueError(kind)
    return Mapping_(path=path, hf=hf, stack=stack, split=tuple(split), groups=groups,
                    perm=perm, layer=layer)


def mappings(cfg: GPTConfig, family: str) -> list[Mapping_]:
    """Every parameter of ``GPT(cfg)`` as HF tensors of ``family``, in parameter order."""
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    out = [_m(("embed",), "model.embed_tokens.weight", (), "copy", (cfg.vocab_size, d), None)]
    layers = [None] if cfg.scan_layers else list(range(cfg.n_layers))
    for i in layers:
        pre = ("blocks",) if i is None else ("blocks", i)
        st = ("layers",) if i is None else ()

        def add(rel: tuple[Any, ...], hf: str, kind: str, shape: tuple[int, ...],
                experts: bool = False) -> None:
            out.append(_m((*pre, *rel), _L + hf, st + (("experts",) if experts else ()),
                          kind, shape, i))

        add(("attn_norm", "scale"), "input_layernorm.weight", "copy", (d,))
        for name, heads in (("q", n), ("k", k), ("v", k)):
            add(("attn", name), f"self_attn.{name}_proj.weight", "heads_in", (d, heads, h))
            if cfg.qkv_bias:
                add(("attn", "bias", name), f"self_attn.{name}_proj.bias", "heads_bias",
                    (heads, h))
        add(("attn", "o"), "self_attn.o_proj.weight", "heads_out", (n, h, d))
        if cfg.qk_norm:
            add(("attn", "q_norm", "scale"), "self_attn.q_norm.weight", "copy", (h,))
            add(("attn", "k_norm", "scale"), "self_attn.k_norm.weight", "copy", (h,))
        add(("mlp_norm", "scale"), "post_attention_layernorm.weight", "copy", (d,))
        _mlp(cfg, family, add)
    out.append(_m(("final_norm", "scale"), "model.norm.weight", (), "copy", (d,), None))
    if not cfg.tie_embeddings:
        out.append(_m(("lm_head",), "lm_head.weight", (), "T", (d, cfg.vocab_size), None))
    return out


def _mlp(cfg: GPTConfig, family: str, add: Any) -> None:
    d, f = cfg.d_model, cfg.d_ff
    if not cfg.n_experts:
        add(("mlp", "gate"), "mlp.gate_proj.weight", "T", (d, f))
        add(("mlp", "up"), "mlp.up_proj.weight", "T", (d, f))
        add(("mlp", "down"), "mlp.down_proj.weight", "T", (f, d))
        return
    fe, e = cfg.moe_d_ff, cfg.n_experts
    if family == "mixtral":
        moe, names = "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        moe, names = "mlp.", ("gate_proj", "up_proj", "down_proj")
    add(("mlp", "router"), moe + "gate.weight", "T", (d, e))
    add(("mlp", "gate"), moe + f"experts.{{expert}}.{names[0]}.weight", "T", (d, fe), True)
    add(("mlp", "up"), moe + f"experts.{{expert}}.{names[1]}.weight", "T", (d, fe), True)
    add(("mlp", "down"), moe + f"experts.{{expert}}.{names[2]}.weight", "T", (fe, d), True)
    if cfg.n_shared_experts:
        fs = cfg.n_shared_experts * fe
        add(("mlp", "shared", "gate"), "mlp.shared_expert.gate_proj.weight", "T", (d, fs))
        add(("mlp", "shared", "up"), "mlp.shared_expert.up_proj.weight", "T", (d, fs))
        add(("mlp", "shared", "down"), "mlp.shared_expert.down_proj.weight", "T", (fs, d))
        if cfg.shared_expert_gate:
            add(("mlp", "shared_gate"), "mlp.shared_expert_gate.weight", "T", (d, 1))


# -- reading -----------------------------------------------------------------------------

class CheckpointError(ValueError):
    """A safetensors folder that does not hold what its config says (names file/tensor)."""


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json``, checked: an object of tensor
    name -> shard file, each shard a plain relative path inside the folder.

    Raises:
      CheckpointError: not UTF-8 JSON, not an object, no ``weight_map``, a name or file that
        is not a string, or a shard outside the folder (absolute, ``..``), naming the
        file, the field and the value.
    """
    fix = "re-save the checkpoint (save_pretrained) or download the index again"
    try:
        data = json.loads(index.read_bytes())
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{index} is not UTF-8 text (byte {e.start}; binary?); "
                              f"{fix}") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{index} is not valid JSON ({e}); {fix}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        got = f"a JSON {type(data).__name__}" if not isinstance(data, dict) else \
            f"'weight_map' = {_short(weight_map)}"
        raise CheckpointError(f"{index} holds {got}; a safetensors index needs a "
                              f"'weight_map' object of tensor name -> shard file; {fix}")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise CheckpointError(f"{index}: weight_map[{name!r}] is {_short(file)}, not a "
                                  f"shard file name; {fix}")
        parts = PurePosixPath(file).parts
        if PurePosixPath(file).is_absolute() or "\\" in file or ".." in parts or \
                file.startswith("~"):
            raise CheckpointError(
                f"{index}: weight_map[{name!r}] is {file!r}, outside the model folder; shards "
                f"must lie inside {index.parent} (a name such as "
                "'model-00001-of-00002.safetensors'). Nothing was read")
    return weight_map


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Folder:
    """The safetensors files of an HF model folder: which file holds each tensor, its
    shape and dtype, and slices read through ``safe_open(...).get_slice`` (at most
    ``max_open`` files open at once, so memory-mapped pages are released)."""

    def __init__(self, path: str | Path, *, max_open: int = 2) -> None:
        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            self.files = {name: self.path / f for name, f in _weight_map(index).items()}
        elif (self.path / SINGLE).is_file():
            self.files = None
        else:
            found = sorted(p.name for p in self.path.glob("*.safetensors"))
            raise CheckpointError(
                f"{self.path} has neither {SINGLE} nor {INDEX}"
                + (f" (found {found}; sharded checkpoints need their index file)" if found
                   else "; only safetensors checkpoints are read (convert *.bin with "
                   "save_pretrained(..., safe_serialization=True))"))
        self._open: OrderedDict[Path, Any] = OrderedDict()
        self.max_open = max_open
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for file in sorted(set(self.files.values()) if self.files else [self.path / SINGLE]):
            f = self._handle(file)
            for name in f.keys():
                s = f.get_slice(name)
                self._meta[name] = (tuple(s.get_shape()), s.get_dtype())
            if self.files is None:
                self.files = dict.fromkeys(f.keys(), file)
        missing = sorted(n for n, f in self.files.items() if n not in self._meta)
        if missing:
            raise CheckpointError(f"{INDEX} lists {missing[:3]} in {self.files[missing[0]].name}"
                                  f", which does not hold them; re-save the checkpoint")

    def _handle(self, file: Path) -> Any:
        from safetensors import safe_open

        if file in self._open:
            self._open.move_to_end(file)
            return self._open[file]
        if not file.is_file():
            raise CheckpointError(f"shard {file.name} (listed in {INDEX}) is missing from "
                                  f"{self.path}; download or copy it there")
        try:
            handle = safe_open(str(file), framework="np")
        except Exception as e:   # safetensors_rust.SafetensorError: truncated, bad header
            raise CheckpointError(
                f"{file} is not a readable safetensors file ({e}); it may be truncated "
                f"({file.stat().st_size} bytes): download or copy it again") from None
        self._open[file] = handle
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return handle

    def close(self) -> None:
        """Closes the open files."""
        self._open.clear()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> str:
        """The safetensors dtype name (``F32``, ``BF16``, ``F16``...)."""
        return self._meta[name][1]

    def __contains__(self, name: str) -> bool:
        return name in self._meta

    def names(self) -> list[str]:
        return sorted(self._meta)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """``tensor[index]`` of one HF tensor, reading only that slice from disk."""
        try:
            return self._handle(self.files[name]).get_slice(name)[index]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"reading {name} from {self.files[name].name} failed ({e}); "
                                  "the file may be truncated: copy it again") from None


def read_core(folder: Folder, m: Mapping_, name: str, idx: tuple[slice, ...]) -> np.ndarray:
    """The block ``idx`` (slices of the parameter's core axes) of HF tensor ``name``
    mapped by ``m``: reads the rows covering it, then reshapes, slices and transposes."""
    view_idx: list[slice] = [slice(None)] * len(m.split)
    for i, s in enumerate(idx):
        view_idx[m.perm[i]] = s
    hf_idx, shape = [], []
    for group in m.groups:
        first, rest = group[0], [m.split[a] for a in group[1:]]
        s = view_idx[first]
        inner = math.prod(rest)
        hf_idx.append(slice(s.start * inner, s.stop * inner))
        shape += [s.stop - s.start, *rest]
        view_idx[first] = slice(None)
    block = folder.read(name, tuple(hf_idx)).reshape(shape)
    return np.transpose(block[tuple(view_idx)], m.perm)


def normalize(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """Slices with explicit start and stop (step 1)."""
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
