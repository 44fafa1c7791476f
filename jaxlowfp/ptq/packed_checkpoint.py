"""`save_packed(model, directory)` / `restore_packed(directory)`: a packed model (`jaxlowfp.ptq.pack_model`)
through orbax-checkpoint into a fresh process, for every packed format (NVFP4, IF4, MXFP4, MXFP8, FP8, HiF8).

A packed model's tree is not the float model's: each quantized ``nnx.Linear`` is a `PackedLinear` whose kernel is a
`jaxlowfp.packed.PackedParam` holding a `PackedWeight` (a `QArray` of codes and scales), and the static part of that
tree (the format, the layer's backend and activation quantizer) is in the graph definition, not in the arrays. So
orbax alone cannot restore it: restoring into the float model fails on the tree, and a raw restore has no module to
go into. `save_packed` writes, next to orbax's state (``<directory>/state``), a JSON plan
(``<directory>/jaxlowfp_packed.json``): the model's class and config, and for every packed layer its format, the
static fields and leaf shapes of its `PackedWeight`, and its `PackedLinear` settings (backend, activation format,
PTQ activation quantizer). `restore_packed` builds the float model abstractly (``nnx.eval_shape``: no float weight
is ever allocated), puts abstract packed layers where the plan says, checks that this tree is the checkpoint's leaf
for leaf (paths, shapes, dtypes), and restores the arrays into it with orbax, bit for bit::

    report = ptq.pack_model(model, result)
    ptq.save_packed(model, "ckpt/")
    model2 = ptq.restore_packed("ckpt/")          # in another process: same class, config and packed layers

orbax-checkpoint is the ``train`` extra (imported only by these two functions). Models: the ``jaxlowfp.models``
decoders (``Llama(config, rngs=...)``, ``MoEDecoder``, with ``model.config``) with packed ``nnx.Linear`` layers
(`PackedLinear`) and packed mixture-of-experts weights (`PackedExperts`, with their PTQ activation quantizer
``quant_<name>``, a `RaggedActQuant`). Packed ``nnx.LinearGeneral`` / ``nnx.Einsum`` kernels (`PackedKernel`: no
``jaxlowfp.models`` decoder has such a layer, so none could be rebuilt) and fake-quantized layers left unpacked are
refused by `save_packed`, before anything is written.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlowfp import packed
from jaxlowfp._core.format import Format
from jaxlowfp._core.qarray import QArray
from jaxlowfp.packed_layer import PackedLinear, replace_modules
from jaxlowfp.ptq.layers import ActQuant, act_quant, quantizable_modules
from jaxlowfp.ptq.experts import RaggedActQuant
from jaxlowfp.ptq.packing import PackedExperts, PackedKernel
from jaxlowfp.rules import grouped_weights

__all__ = ["save_packed", "restore_packed", "plan_of", "PLAN_FILE", "PLAN_VERSION"]

PLAN_FILE = "jaxlowfp_packed.json"
PLAN_VERSION = 1
_MODEL_MODULES = ("jaxlowfp.models.",)  # the classes a plan may name (no arbitrary import from a file)


def _dtype(d: Any) -> str | None:
    return None if d is None else str(jnp.dtype(d))


def _fmt(f: Any, where: str) -> dict[str, Any] | None:
    if f is None:
        return None
    if not isinstance(f, Format):
        raise ValueError(f"{where}: save_packed records a jaxlowfp.Format; got a {type(f).__name__} ({f!r})")
    d = dataclasses.asdict(f)
    d["block_shape"] = None if f.block_shape is None else list(f.block_shape)
    return d


def _unfmt(d: dict[str, Any] | None) -> Format | None:
    if d is None:
        return None
    bs = d.get("block_shape")
    return Format(kind=d["kind"], rule=d.get("rule"), block_shape=None if bs is None else tuple(bs),
                  arithmetic=d.get("arithmetic"))


def _leaf(a: Any) -> dict[str, Any] | None:
    return None if a is None else {"shape": [int(s) for s in a.shape], "dtype": str(a.dtype)}


def _unleaf(d: dict[str, Any] | None) -> Any:  # an abstract leaf where the pytree holds a jax.Array
    return None if d is None else jax.ShapeDtypeStruct(tuple(d["shape"]), jnp.dtype(d["dtype"]))


def _weight(w: packed.PackedWeight, where: str) -> dict[str, Any]:
    """A `PackedWeight`'s static fields and leaf shapes (its pytree structure, without values)."""
    a = w.array
    return {"format": _fmt(w.format, where), "k": int(w.k), "n": int(w.n), "s_enc": _leaf(w.s_enc),
            "array": {"format": _fmt(a.format, where), "dtype": _dtype(a.dtype),
                      "shape": None if a.shape is None else [int(s) for s in a.shape],
                      "codes": _leaf(a.codes), "scales": _leaf(a.scales), "global_scale": _leaf(a.global_scale)}}


def _unweight(d: dict[str, Any]) -> packed.PackedWeight:
    """The abstract `PackedWeight` (`jax.ShapeDtypeStruct` leaves) that `_weight` describes."""
    a = d["array"]
    arr_fmt, w_fmt = _unfmt(a["format"]), _unfmt(d["format"])
    if arr_fmt is None or w_fmt is None or a["shape"] is None:
        raise ValueError(f"the checkpoint's packed-model metadata describes a packed weight without its format or "
                         f"shape ({d!r}); it was not written by save_packed, or it was damaged")
    arr = QArray(codes=_unleaf(a["codes"]), scales=_unleaf(a["scales"]), global_scale=_unleaf(a["global_scale"]),
                 format=arr_fmt, dtype=None if a["dtype"] is None else jnp.dtype(a["dtype"]),
                 shape=tuple(a["shape"]))
    return packed.PackedWeight(array=arr, s_enc=_unleaf(d["s_enc"]), format=w_fmt, k=d["k"], n=d["n"])


def _hook(aq: Any, where: str) -> dict[str, Any] | None:
    """A PTQ activation quantizer (`ActQuant`) as its constructor arguments."""
    if aq is None:
        return None
    amax = aq.amax
    return {"fmt": _fmt(aq.fmt, where), "activation_scale": aq.activation_scale, "path": aq.path,
            "amax": (None if amax is None else [float(v) for v in amax] if isinstance(amax, (tuple, list))
                     else float(amax)),
            "amax_tuple": isinstance(amax, tuple)}


def _unamax(d: dict[str, Any]) -> Any:
    a = d["amax"]
    return tuple(a) if isinstance(a, list) and d["amax_tuple"] else a


def _config(model: nnx.Module) -> tuple[str, dict[str, Any]]:
    cls = type(model)
    name = f"{cls.__module__}.{cls.__qualname__}"
    cfg = getattr(model, "config", None)
    if not name.startswith(_MODEL_MODULES) or not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise ValueError(f"save_packed saves the jaxlowfp.models decoders (a model built as Cls(config, rngs=...) "
                         f"with a dataclass `config`); got a {name}"
                         f"{'' if cfg is None else f' with config {type(cfg).__name__}'}")
    conf = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return name, {"class": f"{type(cfg).__module__}.{type(cfg).__qualname__}",
                  "fields": json.loads(json.dumps(conf))}  # tuples -> lists (compared after the same trip)


def _import(name: str, what: str) -> Any:
    if not name.startswith(_MODEL_MODULES):
        raise ValueError(f"{what} {name!r}: restore_packed builds only classes of jaxlowfp.models")
    mod, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {name!r} is not in this jaxlowfp ({e})") from e


def _state_leaves(state: Any) -> list[list[Any]]:
    """[path, shape, dtype] of every leaf of an ``nnx.State`` (what restore compares before reading arrays)."""
    out = []
    for path, v in nnx.to_flat_state(state):
        for sub, leaf in jax.tree_util.tree_flatten_with_path(v)[0]:
            out.append(["/".join(map(str, path)) + jax.tree_util.keystr(sub), [int(s) for s in leaf.shape],
                        str(leaf.dtype)])
    return out


def plan_of(model: nnx.Module) -> dict[str, Any]:
    """The JSON plan `save_packed` writes for `model` (module docstring); a ValueError for what it cannot record."""
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module; got {type(model).__name__}")
    name, cfg = _config(model)
    layers: list[dict[str, Any]] = []
    own_hooks: set[int] = set()
    for p, m in nnx.iter_graph(model):
        path = "/".join(map(str, p))
        if isinstance(m, PackedLinear):
            if m.act_fn is not None:
                raise ValueError(f"{path}: this layer quantizes its activations with a foreign checkpoint's "
                                 f"quantizer (act_fn, a packed ptq.load / models.load); save_packed cannot record "
                                 f"it: load that checkpoint again instead")
            if m.act_quant is not None:
                own_hooks.add(id(m.act_quant))
            layers.append({"path": path, "type": "linear", "weight": _weight(m.kernel.get_value(), path),
                           "bias": m.bias is not None, "activation": _fmt(m.activation, path),
                           "act_quant": _hook(m.act_quant, path), "gemm": m.backend, "dtype": _dtype(m.dtype),
                           "param_dtype": _dtype(m.param_dtype)})
    for path, mod, wname in grouped_weights(model):  # mixture-of-experts weights [E, K, N]
        var, hook = getattr(mod, wname), getattr(mod, "quant_" + wname, None)
        if hook is not None and not isinstance(hook, RaggedActQuant):
            raise ValueError(f"{path}: this expert weight is quantized by a {type(hook).__name__} (QAT); "
                             f"save_packed records PTQ'd and packed expert weights only")
        if not isinstance(var, PackedExperts):
            if hook is not None:
                raise ValueError(f"{path}: this expert weight is fake-quantized, not packed; save_packed records "
                                 f"packed layers only: pack it too (ptq.pack_model without paths=)")
            continue
        layers.append({"path": path, "type": "experts", "weight": _weight(var.get_value(), path),
                       "kernel_dtype": _dtype(var.kernel_dtype), "act_quant": _hook(hook, path)})
    for path, mod in quantizable_modules(model).items():
        if isinstance(getattr(mod, "kernel", None), PackedKernel):
            raise ValueError(f"{path}: save_packed does not record packed nnx.LinearGeneral / nnx.Einsum kernels "
                             f"(PackedKernel): restore_packed builds jaxlowfp.models decoders, none of which has "
                             f"such a layer; save this model with orbax against a model built the same way, or "
                             f"use ptq.export")
    if not layers:
        raise ValueError("save_packed: this model has no packed layer (run jaxlowfp.ptq.pack_model first; a float "
                         "or fake-quant model is saved with orbax directly)")
    stray = ["/".join(map(str, p)) for p, m in nnx.iter_graph(model) if isinstance(m, ActQuant)
             and id(m) not in own_hooks]
    if stray:
        raise ValueError(f"save_packed: the layers owning the PTQ activation quantizers {stray[:3]}"
                         f"{' ...' if len(stray) > 3 else ''} are fake-quantized, not packed; save_packed records "
                         f"packed layers only: pack them too (ptq.pack_model without paths=)")
    return {"jaxlowfp_packed": PLAN_VERSION, "model": name, "config": cfg, "layers": layers}


def _same_config(plan: dict[str, Any], model: nnx.Module) -> None:
    name, cfg = _config(model)
    if name != plan["model"] or cfg != plan["config"]:
        raise ValueError(f"restore_packed: the checkpoint is a {plan['model']} with config "
                         f"{plan['config']['fields']}; the model given is a {name} with config {cfg['fields']}")


def _build(plan: dict[str, Any], model: nnx.Module | None) -> nnx.Module:
    """The abstract packed model of `plan` (into `model`, a float model of the same class and config, if given)."""
    cls = _import(plan["model"], "model class")
    ccls = _import(plan["config"]["class"], "config class")
    fields = dict(plan["config"]["fields"])
    types = {f.name: f for f in dataclasses.fields(ccls)}
    for k, v in fields.items():  # JSON lists back to the tuples the config holds
        if isinstance(v, list) and k in types:
            fields[k] = tuple(v)
    config = ccls(**fields)
    if model is None:
        model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
    else:
        _same_config(plan, model)
    mods = quantizable_modules(model)
    grouped = {p: (m, n) for p, m, n in grouped_weights(model)}
    for e in plan["layers"]:
        if e["type"] != "experts":
            continue
        if e["path"] not in grouped:
            raise ValueError(f"restore_packed: the checkpoint's packed expert weight {e['path']!r} is not an expert "
                             f"weight of this {plan['model']}")
        gmod, name = grouped[e["path"]]
        aq = e["act_quant"]
        setattr(gmod, name, PackedExperts(_unweight(e["weight"]), kernel_dtype=jnp.dtype(e["kernel_dtype"])))
        if aq is not None:
            setattr(gmod, "quant_" + name, nnx.data(RaggedActQuant(_unfmt(aq["fmt"]), aq["activation_scale"],
                                                                   _unamax(aq), aq["path"])))
    new: dict[str, tuple[nnx.Module, nnx.Module]] = {}
    for e in plan["layers"]:
        path, w = e["path"], _unweight(e["weight"])
        if e["type"] == "experts":
            continue
        mod = mods.get(path)
        if mod is None:
            raise ValueError(f"restore_packed: the checkpoint's packed layer {path!r} is not a layer of this "
                             f"{plan['model']}")
        aq = e["act_quant"]
        hook = None if aq is None else act_quant(mod, _unfmt(aq["fmt"]), activation_scale=aq["activation_scale"],
                                                 amax=_unamax(aq), path=aq["path"])
        if e["type"] == "linear":
            layer = PackedLinear(w, mod.bias if e["bias"] else None, activation=_unfmt(e["activation"]),  # type: ignore[attr-defined]
                                 gemm=e["gemm"], dtype=e["dtype"], param_dtype=e["param_dtype"], path=path,
                                 act_quant=hook)
            new[path] = (mod, layer)
        else:
            raise ValueError(f"restore_packed: unknown packed layer type {e['type']!r} at {path!r}")
    replace_modules(model, new)
    return model


def save_packed(model: nnx.Module, directory: str | os.PathLike) -> Path:
    """Save a packed `model` (`jaxlowfp.ptq.pack_model`) to `directory` (new, or empty): orbax's state in
    ``<directory>/state`` and the plan `restore_packed` rebuilds the model from in ``<directory>/jaxlowfp_packed.json``
    (module docstring). Every check runs before anything is written. Returns the directory."""
    import orbax.checkpoint as ocp

    plan = plan_of(model)
    state = nnx.state(model)
    plan["leaves"] = _state_leaves(state)
    d = Path(directory).absolute()
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise ValueError(f"save_packed: {d} exists and is not an empty directory")
    d.mkdir(parents=True, exist_ok=True)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(d / "state", state)
    ckpt.wait_until_finished()
    tmp = d / (PLAN_FILE + ".tmp")
    tmp.write_text(json.dumps(plan, indent=1))
    tmp.replace(d / PLAN_FILE)  # the plan is written last: a directory without it is not a whole checkpoint
    return d


def restore_packed(directory: str | os.PathLike, model: nnx.Module | None = None) -> nnx.Module:
    """The packed model `save_packed` wrote to `directory`, in this process: built abstractly from the checkpoint's
    own plan (class, config, packed layers), checked leaf for leaf against the saved state, then restored with orbax.

    model: optional, a float model (concrete or ``nnx.eval_shape``) to restore into, in place; it must be of the
      checkpoint's class and config (a ValueError says both otherwise). Default: a new one is built.
    Every check runs before `model` changes: a refusal leaves it as it was.
    """
    import orbax.checkpoint as ocp

    d = Path(directory).absolute()
    f = d / PLAN_FILE
    if not f.is_file() or not (d / "state").is_dir():
        raise ValueError(f"restore_packed: {d} is not a save_packed checkpoint (no {PLAN_FILE} and state/; a "
                         f"directory without the plan was not completely written)")
    plan = json.loads(f.read_text())
    version = plan.get("jaxlowfp_packed") if isinstance(plan, dict) else None
    if version != PLAN_VERSION:
        raise ValueError(f"restore_packed: {f} is plan version {version!r}; this jaxlowfp reads version "
                         f"{PLAN_VERSION}")
    if model is not None:
        _same_config(plan, model)
    built = _build(plan, None)  # abstract; `model` changes only once the plan is known to fit the saved state
    have = _state_leaves(nnx.state(built))
    if have != plan["leaves"]:
        want = {p: (s, t) for p, s, t in plan["leaves"]}
        got = {p: (s, t) for p, s, t in have}
        diff = sorted(set(want) ^ set(got)) or [p for p in want if want[p] != got[p]]
        raise ValueError(f"restore_packed: the model built from the plan does not match the saved state at "
                         f"{diff[:4]}{' ...' if len(diff) > 4 else ''} (checkpoint: "
                         f"{[want.get(p) for p in diff[:2]]}, built: {[got.get(p) for p in diff[:2]]}); was it "
                         f"written by another jaxlowfp version, or edited?")
    model = built if model is None else _build(plan, model)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(model))
    restored = ocp.StandardCheckpointer().restore(d / "state", abstract)
    nnx.update(model, restored)
    return model
