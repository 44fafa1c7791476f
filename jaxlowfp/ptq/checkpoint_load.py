"""Load a `jaxlowfp.ptq.export` directory into a model (`load`): every tensor's SHA-256 checked against what the
export recorded, the header and float tensors validated, NVFP4 layers decoded in the arithmetic they were made in
(or kept packed, ``packed=True``), FP8 layers, grouped experts, and each W4A4 layer's activation quantizer rebuilt.
The layout it reads is `jaxlowfp.ptq.export_layout`'s."""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax import lax

from jaxlowfp import packed as packing
from jaxlowfp._core.deprecation import renamed_kwarg
from jaxlowfp._core.format import Format
from jaxlowfp._core.placement import commit_state
from jaxlowfp._core.qarray import QArray
from jaxlowfp.ptq import serving
from jaxlowfp.ptq.calibrate import linear_modules
from jaxlowfp.ptq.export_layout import (META_FILE, WEIGHTS_FILE, expected_tensors, format_from_json, model_params,
                                        read_safetensors, tensor_digests)
from jaxlowfp.ptq.formats import Scheme
from jaxlowfp.ptq.layers import act_quant

__all__ = ["load"]

def _fp8_weight(m: str, tensors: Mapping[str, np.ndarray]) -> Any:
    """The `PackedWeight` of FP8 module `m` as written: E4M3 codes ``{m}.weight`` [out, in] and the per-tensor
    ``{m}.weight_scale``; it decodes as compressed-tensors does, ``f32(q) * s``."""
    codes, scale = tensors[f"{m}.weight"], np.asarray(tensors[f"{m}.weight_scale"], np.float32).reshape(-1)
    if codes.dtype != ml_dtypes.float8_e4m3fn or codes.ndim != 2:
        raise ValueError(f"{m}.weight: an FP8 weight is a 2-D float8_e4m3fn tensor; got {codes.dtype} "
                         f"{codes.shape}")
    if scale.size != 1 or not (np.isfinite(scale[0]) and scale[0] > 0):
        raise ValueError(f"{m}.weight_scale: one finite value > 0 per tensor; got {scale.tolist()[:4]}")
    arr = QArray(codes=jnp.asarray(codes), scales=None, global_scale=jnp.float32(scale[0]), format=Format(kind="fp8"),
                 dtype=jnp.dtype(jnp.float32), shape=tuple(codes.shape))
    return packing.PackedWeight(array=arr, s_enc=None, format=packing.Format(kind="fp8"),
                                k=int(codes.shape[1]), n=int(codes.shape[0]))


def _nvfp4_array(m: str, tensors: Mapping[str, np.ndarray], w_fmt: Format) -> tuple[QArray, jax.Array]:
    """The NVFP4 codes and scales of packed module `m` as written ([out, in]), and its encode scale S_enc."""
    codes, scales = tensors[f"{m}.weight_packed"], tensors[f"{m}.weight_scale"]
    g = tensors[f"{m}.weight_global_scale"]
    if codes.dtype != np.uint8 or codes.ndim != 2 or scales.dtype != ml_dtypes.float8_e4m3fn:
        raise ValueError(f"{m}: NVFP4 needs 2-D uint8 weight_packed and float8_e4m3fn weight_scale; got "
                         f"{codes.dtype} {codes.shape}, {scales.dtype} {scales.shape}")
    if scales.shape != (codes.shape[0], codes.shape[1] * 2 // 16) or codes.shape[1] % 8 or g.size != 1:
        raise ValueError(f"{m}: weight_scale {scales.shape} and weight_global_scale {g.shape} do not fit "
                         f"weight_packed {codes.shape} (one E4M3 scale per 16 values, one global scale)")
    s_enc = jnp.asarray(g.reshape(-1)[0], jnp.float32)
    if w_fmt.rows > 1:
        scales = scales[:: w_fmt.rows]
    out, half = codes.shape
    arr = QArray(codes=jnp.asarray(codes), scales=jnp.asarray(scales), global_scale=1.0 / s_enc, format=w_fmt,
                 dtype=jnp.dtype(jnp.float32), shape=(out, 2 * half))
    return arr, s_enc


def _decode(m: str, tensors: Mapping[str, np.ndarray], w_fmt: Format, convention: str) -> jax.Array:
    """The float32 [out, in] weight of packed module `m` (codes, block scales, global scale) as it was evaluated."""
    arr, s_enc = _nvfp4_array(m, tensors, w_fmt)
    return serving.decode(arr, s_enc, convention)


def _load_experts(model: nnx.Module, path: str, var: Any, names: list[str], meta: Mapping[str, Any],
                  tensors: Mapping[str, np.ndarray], packed: bool = False) -> Scheme | None:
    """Stack the per-expert tensors of `path` into its [E, in, out] parameter; quantized experts decoded in their
    convention (``packed``: kept as codes and scales, a `jaxlowfp.ptq.PackedExperts`), with the run-time
    activation quantizer of W4A4 experts (`jaxlowfp.ptq.experts.RaggedActQuant`)."""
    from jaxlowfp import ops
    from jaxlowfp import packed as packing
    from jaxlowfp.ptq.experts import RaggedActQuant, grouped_weights

    info = meta["layers"].get(path)
    mod, name = next((m, n) for p, m, n in grouped_weights(model) if p == path)
    convention = meta.get("convention", "jaxlowfp")
    if info is None:
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"tensors {missing[:3]} ({path}) are missing")
        value = np.stack([tensors[n].T for n in names])
    elif packed:
        from jaxlowfp.ptq.packing import PackedExperts

        w_fmt = format_from_json(info["weight"])
        if w_fmt.kind != "nvfp4":
            raise NotImplementedError(f"{path}: packed=True loads NVFP4 experts; these are {w_fmt.name}")
        ws = [packing.from_nvfp4(*_nvfp4_array(m, tensors, w_fmt), arithmetic=convention) for m in info["names"]]
        shape = (len(ws), ws[0].k, ws[0].n)
        if shape != tuple(var.shape):
            raise ValueError(f"{path}: the per-expert packed tensors stack to {shape}; the parameter is "
                             f"{tuple(var.shape)}")
        setattr(mod, name, PackedExperts.stack(ws, kernel_dtype=var.dtype))
    else:
        w_fmt = format_from_json(info["weight"])
        value = np.stack([np.asarray(_decode(m, tensors, w_fmt, convention)).T for m in info["names"]])
    if info is None or not packed:
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"{path}: the per-expert tensors stack to {value.shape}; the parameter is {var.shape}")
        var.set_value(jnp.asarray(value, var.dtype))
    if info is None:
        return None
    a_fmt = format_from_json(info["activation"])
    if a_fmt is not None:
        amax = info.get("input_amax")
        setattr(mod, "quant_" + name, RaggedActQuant(a_fmt, info.get("activation_scale") or "token",
                                                     None if amax is None else tuple(amax), path,
                                                     ops.new_op_key(path)))
    return Scheme(weight=format_from_json(info["weight"]), activation=a_fmt)


def load(model: nnx.Module, directory: str | Path, *, packed: bool = False, gemm: str = "auto",
         backend: str | None = None) -> dict[str, Scheme]:
    """Load a directory written by `export` into `model` (same architecture), in place: every parameter, NVFP4
    kernels decoded in the convention they were made in (``(q * s) * (1 / S_enc)`` or ``q * (s / S_enc)``), and the
    activation quantization of W4A4 layers. Returns {path: Scheme} of the quantized layers.

    ``packed=True``: each NVFP4 layer becomes a `jaxlowfp.ptq.PackedLinear` holding the file's codes, E4M3 block
    scales and global scale as they are (`jaxlowfp.packed.from_nvfp4`; nothing is decoded), run on `gemm`
    (`jaxlowfp.backends`; ``backend=`` is its deprecated name), with the activation quantizer the float load sets.
    `model` may be abstract (``nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))``): then no float copy of the
    quantized kernels is ever made, and the other parameters are filled from the file."""
    backend = renamed_kwarg("ptq.load", "backend", backend, "gemm", gemm, "auto")
    from jaxlowfp import packed as packing
    from jaxlowfp.ptq.packing import PackedLinear, replace_modules

    replaced: dict[str, tuple[nnx.Module, nnx.Module]] = {}
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory}: no {META_FILE} (not written by jaxlowfp.ptq.export)")
    from jaxlowfp._core.errors import CheckpointError
    from jaxlowfp._core.safetensors_read import check_scales

    try:
        meta = json.loads(meta_path.read_text())
        names = meta["tensor_names"]
        if not (isinstance(names, dict) and isinstance(meta["layers"], dict)):
            raise TypeError("tensor_names and layers must be JSON objects")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_path}: corrupt ({type(e).__name__}: {e})") from None
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: file not found")
    digests = meta.get("sha256")
    if digests is not None:  # written by export: every tensor's bytes as they were written
        got = tensor_digests(weights)
        bad = sorted(n for n in set(got) | set(digests) if got.get(n) != digests.get(n))
        if bad:
            raise CheckpointError(f"{weights}: tensor {bad[0]} (and {len(bad) - 1} more) "
                                  f"{'differs from' if bad[0] in got and bad[0] in digests else 'is not in'} what "
                                  f"export wrote ({META_FILE} records a SHA-256 of each tensor): the file is damaged "
                                  f"or from another export")
    tensors = read_safetensors(weights)  # header checked against the file, every float tensor finite
    check_scales(weights, tensors)
    params = model_params(model)
    linears = linear_modules(model)
    missing = sorted(set(params) - set(names))
    if missing:
        raise CheckpointError(f"{directory}: the model has parameters the checkpoint does not name: {missing[:5]} "
                              f"(config.json and the weights do not belong together?)")
    need, optional = expected_tensors(params, names, meta, linears)
    absent = sorted(need - set(tensors))
    if absent:
        raise CheckpointError(f"{weights}: tensors {absent[:5]} are missing ({len(absent)} in all)")
    extra = sorted(set(tensors) - need - optional)
    if extra:
        more = " ..." if len(extra) > 5 else ""
        raise CheckpointError(f"{weights}: tensors this model does not have: {extra[:5]}{more}"
                              f" ({len(extra)} in all; config.json describes a smaller model than the weights, or the "
                              f"directory mixes two exports)")
    for path, info in meta["layers"].items():
        amax = info.get("input_amax")
        vals = np.asarray([] if amax is None else amax, np.float64).reshape(-1)
        if not (np.isfinite(vals).all() and (vals >= 0).all()):
            raise CheckpointError(f"{meta_path}: layer {path} has input_amax {amax}; it must be finite and >= 0")
    schemes = {}
    for path, var in params.items():
        mod_path, leaf = path.rsplit("/", 1) if "/" in path else ("", path)
        if isinstance(names.get(path), list):  # a grouped expert weight [E, in, out], one tensor per expert
            sch = _load_experts(model, path, var, names[path], meta, tensors, packed)
            if sch is not None:
                schemes[path] = sch
            continue
        if mod_path in meta["layers"] and leaf == "kernel":
            info = meta["layers"][mod_path]
            w_fmt, a_fmt = format_from_json(info["weight"]), format_from_json(info["activation"])
            m = info["name"]
            lin = linears[mod_path]
            aq = None if a_fmt is None else act_quant(lin, a_fmt, activation_scale=info.get("activation_scale",
                                                                                             "tensor"),
                                                      amax=info.get("input_amax"), path=mod_path)
            schemes[mod_path] = Scheme(weight=w_fmt, activation=a_fmt)
            if w_fmt.kind == "fp8":
                w8 = _fp8_weight(m, tensors)
                if (w8.k, w8.n) != tuple(var.shape):
                    raise ValueError(f"{m}: FP8 weight is {(w8.n, w8.k)} (PyTorch [out, in]); the model's kernel "
                                     f"{path} is {tuple(var.shape)}")
                if packed:
                    act = None if a_fmt is None else packing.as_format(a_fmt, f"{mod_path} activation")
                    replaced[mod_path] = (lin, PackedLinear(w8, lin.bias, activation=act, gemm=backend,
                                                            dtype=lin.dtype, param_dtype=var.dtype, path=mod_path,
                                                            act_quant=aq))
                else:
                    var.set_value(w8.dequantize(jnp.float32).astype(var.dtype))
                    lin.dot_general = lax.dot_general if aq is None else nnx.data(aq)  # a Module: its record is state
                continue
            arr, s_enc = _nvfp4_array(m, tensors, w_fmt)
            out, half = arr.shape[0], arr.shape[1] // 2
            if packed:
                if (2 * half, out) != tuple(var.shape):
                    raise ValueError(f"{m}: packed weight is {(out, 2 * half)} (PyTorch [out, in]); the model's "
                                     f"kernel {path} is {tuple(var.shape)}")
                w = packing.from_nvfp4(arr, s_enc, arithmetic=meta.get("convention", "jaxlowfp"))
                act = None if a_fmt is None else packing.as_format(a_fmt, f"{mod_path} activation")
                replaced[mod_path] = (lin, PackedLinear(w, lin.bias, activation=act, gemm=backend,
                                                        dtype=lin.dtype, param_dtype=var.dtype, path=mod_path,
                                                        act_quant=aq))
                continue
            kernel = serving.decode(arr, s_enc, meta.get("convention", "jaxlowfp")).T
            if kernel.shape != var.shape:
                raise ValueError(f"{m}: packed weight is {kernel.shape[::-1]} (PyTorch [out, in]); the model's "
                                 f"kernel {path} is {var.shape}")
            var.set_value(kernel.astype(var.dtype))
            lin.dot_general = lax.dot_general if aq is None else nnx.data(aq)  # a Module: its record is state
            continue
        name = names[path]
        if name not in tensors:
            raise ValueError(f"{directory}: tensor {name} ({path}) is missing")
        value = tensors[name]
        if leaf == "kernel" and mod_path in linears:
            value = value.T
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"{name}: shape {value.shape} does not fit {path} {var.shape}")
        var.set_value(jnp.asarray(value, var.dtype))
    replace_modules(model, replaced)
    commit_state(model)  # the first jitted call compiles what every later one runs
    return schemes
