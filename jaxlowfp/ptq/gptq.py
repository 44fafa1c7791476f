"""GPTQ (Frantar et al. 2022) with block-scaled formats: the input channels of a layer are quantized one at a time
and each one's rounding error is fed back into the channels not yet quantized, weighted by the inverse Hessian.

With ``W = kernel.T`` [out, in] (rows: outputs; columns: input channels, the NVFP4 block axis) and calibration
inputs X [n, in]::

    H     = 2/n X^T X + λ I,      λ = damp_percent/100 * mean(diag H)     (dead inputs: H_ii = 1, W[:, i] = 0)
    U     = chol(H^-1)^T          (upper; in act-order, columns sorted by decreasing H_ii first; float64 on the host,
                                   or float32 on the kernel's devices with ``factorization="device"``)
    for column j (in chunks of `block_size`, later chunks updated lazily, once per chunk):
        w_j   = the column as it stands (original minus the errors fed back so far)
        if j is the first column of its scale group reached: fix the group's scale from its columns as they stand
              (NVFP4: the E4M3 block scale and the 4-or-6 choice of `nvfp4.quantize`, with the global scale from
              the original weight amax; MXFP4: the E8M0 scale; HiF8: one per-tensor scale from the original amax)
        q_j   = the column rounded on that fixed grid
        e_j   = (w_j - q_j) / U_jj;        w_k -= e_j U_jk  for every later column k

``scales="original"`` instead fixes every group's scale before the loop from the original weights, as
llm-compressor 0.14 does (its observer's qparams, ``modifiers/gptq/base.py: compress_module_list``).

The settings mean what llm-compressor's ``GPTQModifier`` options mean: ``damp_percent = 100 * dampening_frac``
(λ = dampening_frac * mean(diag H), dead inputs set to 1 first, ``gptq/helpers.py: factorize_hessian``),
``block_size`` its ``block_size`` (lazy-update width) and ``act_order=True`` its ``actorder="weight"`` (alias
``"static"``, its default): columns by decreasing H_ii, scale groups still the contiguous original groups
(``g_idx`` gathered by the permutation in ``gptq_quantize.py``). Where the damped H is not positive definite
llm-compressor falls back to round-to-nearest; here λ is raised instead.

Only the chosen grid's error feeds back. With no correlation between inputs (H diagonal) nothing feeds back and the
result is round-to-nearest, bit for bit.

Rows never mix: every step above acts on each row of W alone, given U. So a kernel on a mesh (`jaxlowfp.sharding`)
is quantized where it lives: its rows are split over the mesh's devices (`jax.shard_map`, U replicated), each
device runs the loop on its own rows, and no device or host holds the whole kernel (`_row_mesh`).
"""
from __future__ import annotations

import dataclasses
import functools

import math

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlowfp import nvfp4, sharding
from jaxlowfp._core.placement import commit_tree
from jaxlowfp._core.format import Format, two_level_of
from jaxlowfp.ptq.formats import (MX_ELEMENTS, TWO_LEVEL, QuantizedWeight, block_global_scales,
                                  if4_column, if4_fix, mx_column, mx_fix, nvfp4_column, nvfp4_fix, pack_nvfp4,
                                  per_tensor_fake_quantize, per_tensor_scale)

_HI = lax.Precision.HIGHEST
SCALES = ("as-reached", "original")
FACTORIZATIONS = ("host", "device")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTQ:
    """GPTQ settings.

    Attributes:
      damp_percent: λ as a percentage of the mean Hessian diagonal (GPTQ's default 1 %); raised x10 (up to
        three times) if the Cholesky factorization fails.
      block_size: columns per lazy-update chunk (the result does not depend on it beyond float rounding).
      act_order: process input channels in order of decreasing H_ii (llm-compressor's actorder="weight").
      scales: "as-reached" (each scale group fixed when its first column is reached, from all its columns as they
        stand) or "original" (every group fixed from the original weights before the loop, as llm-compressor).
      factorization: where U = chol(H^-1)^T is computed: "host" (float64, LAPACK, one layer at a time) or "device"
        (float32 on the kernel's devices, replicated on its mesh, as the GPTQ reference code and llm-compressor
        factorize on the GPU: the n^3 flops leave the host; the codes can differ from "host" at near ties).
    """

    damp_percent: float = 1.0
    block_size: int = 128
    act_order: bool = False
    scales: str = "as-reached"
    factorization: str = "host"

    def __post_init__(self) -> None:
        d = self.damp_percent
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (0 < d < 100):
            raise ValueError(f"damp_percent must be a number in (0, 100); got {d!r}")
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"block_size must be a positive int; got {b!r}")
        if not isinstance(self.act_order, bool):
            raise TypeError(f"act_order must be a bool; got {self.act_order!r}")
        if self.scales not in SCALES:
            raise ValueError(f"scales={self.scales!r} is not supported; allowed: {', '.join(map(repr, SCALES))}")
        if self.factorization not in FACTORIZATIONS:
            raise ValueError(f"factorization={self.factorization!r} is not supported; allowed: "
                             f"{', '.join(map(repr, FACTORIZATIONS))}")

    name = "gptq"


def _inverse_cholesky(h: np.ndarray, damp: float) -> np.ndarray | None:
    """Upper U with U^T U = (H + damp * mean(diag H) I)^-1, in float64 on the host (LAPACK); None if the damped H is
    not positive definite. One factorization: with J the reversal, chol(J H J) = M gives H = R R^T, R = J M J
    upper, so U = R^-1."""
    h = h.astype(np.float64) + np.eye(len(h)) * (damp * np.mean(np.diag(h)))
    try:
        m = np.linalg.cholesky(h[::-1, ::-1])
    except np.linalg.LinAlgError:
        return None
    r = np.ascontiguousarray(m[::-1, ::-1])
    return scipy.linalg.solve_triangular(r, np.eye(len(h)), lower=False).astype(np.float32)


@jax.jit
def _device_inverse_cholesky(h: jax.Array, damp: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`_inverse_cholesky` in float32 where `h` lives: (U, whether every entry of U is finite; a damped H that is
    not positive definite gives NaN)."""
    n = h.shape[0]
    eye = jnp.eye(n, dtype=jnp.float32)
    h = h.astype(jnp.float32) + eye * (damp * jnp.mean(jnp.diag(h)))
    r = jnp.linalg.cholesky(h[::-1, ::-1])[::-1, ::-1]
    u = jax.scipy.linalg.solve_triangular(r, eye, lower=False)
    return u, jnp.all(jnp.isfinite(u))


def _column_loop(w: jax.Array, u: jax.Array, group_of: jax.Array, first: jax.Array, group_cols: jax.Array,
                 amax: jax.Array, *, fmt: Format, chunk: int, original: bool):
    """The column loop in processing order, on any subset of W's rows. w [out, n] and u [n, n] are permuted;
    group_of [n] is each column's scale group, first [n] whether it is the group's first column reached, group_cols
    [groups, g] the processing positions of each group's columns. `original`: every group's scale fixed from the
    original rows before the loop (HiF8: always, one per-tensor scale)."""
    out, n = w.shape
    if fmt.kind in TWO_LEVEL:
        s_dec = block_global_scales(fmt, amax)[1]
    if fmt.per_tensor:
        params0 = jnp.full((1, out), per_tensor_scale(amax, fmt.kind), jnp.float32)
    elif original:
        params0 = _original_scales(w[:, group_cols.reshape(-1)], amax, fmt=fmt, g=group_cols.shape[1])  # original order
    else:
        params0 = jnp.zeros((group_cols.shape[0], out), jnp.float32)

    def fix(cols):
        if fmt.kind == "nvfp4":
            return nvfp4_fix(cols, fmt, amax)
        if fmt.kind == "if4":  # the scale, negated for an INT4 block
            return if4_fix(cols, fmt, amax)
        return mx_fix(cols, fmt.kind)

    def column(col, p):
        if fmt.kind == "nvfp4":
            return nvfp4_column(col, p, s_dec)
        if fmt.kind == "if4":
            return if4_column(col, p, s_dec)
        if fmt.kind in MX_ELEMENTS:
            return mx_column(col, p, fmt.kind)
        deq = per_tensor_fake_quantize(col, fmt.kind, p[0])
        return deq, deq

    def chunk_body(c, carry):
        w, qv, deq, params = carry
        c1 = c * chunk
        uc = lax.dynamic_slice_in_dim(u, c1, chunk, axis=0)  # [chunk, n]: rows of this chunk's columns
        err = jnp.zeros((out, chunk), jnp.float32)

        def current(cols, err):  # columns (positions >= the current one) as they stand
            return w[:, cols] - jnp.matmul(err, uc[:, cols], precision=_HI)

        def col_body(i, inner):
            err, qv, deq, params = inner
            j = c1 + i
            wj = current(j[None], err)[:, 0]
            g = group_of[j]
            if not fmt.per_tensor:
                params = lax.cond(first[j], lambda p: p.at[g].set(fix(current(group_cols[g], err))),
                                  lambda p: p, params)
            q, d = column(wj, params[g])
            err = err.at[:, i].set((wj - d) / u[j, j])
            return err, qv.at[:, j].set(q), deq.at[:, j].set(d), params

        err, qv, deq, params = lax.fori_loop(0, chunk, col_body, (err, qv, deq, params))
        later = (jnp.arange(n) >= c1 + chunk)[None, :]
        w = w - jnp.where(later, jnp.matmul(err, uc, precision=_HI), 0.0)
        return w, qv, deq, params

    zeros = jnp.zeros((out, n), jnp.float32)
    _, qv, deq, params = lax.fori_loop(0, n // chunk, chunk_body, (w, zeros, zeros, params0))
    return qv, deq, params


_STATIC = ("fmt", "chunk", "original")
_gptq = jax.jit(_column_loop, static_argnames=_STATIC)


@functools.lru_cache(maxsize=64)
def _sharded_loop(mesh: Mesh, axes: tuple[str, ...], fmt: Format, chunk: int, original: bool):
    """`_column_loop` with W's rows (and the scales' columns) over `axes` of `mesh`, everything else replicated."""
    rows, rep = P(axes, None), P()
    body = functools.partial(_column_loop, fmt=fmt, chunk=chunk, original=original)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(rows, rep, rep, rep, rep, rep),
                                 out_specs=(rows, rows, P(None, axes)), check_vma=False))


def _row_mesh(kernel: jax.Array, out: int) -> tuple[Mesh, tuple[str, ...]] | None:
    """The mesh and axes over which the column loop splits the `out` rows of a kernel on a mesh: all of the kernel's
    mesh axes when their device count divides `out`, else the axes that shard the kernel's output dimension, else
    None (one device runs the loop)."""
    s = getattr(kernel, "sharding", None)
    if not isinstance(s, NamedSharding) or not isinstance(s.mesh, Mesh) or s.mesh.size == 1:
        return None
    spec = tuple(s.spec) + (None,) * (2 - len(s.spec))
    for axes in (tuple(a for a in s.mesh.axis_names if s.mesh.shape[a] > 1), sharding.axes_of(spec[1])):
        n = math.prod(s.mesh.shape[a] for a in axes)
        if axes and out % n == 0:
            return s.mesh, tuple(str(a) for a in axes)
    return None


def gptq_weight(kernel: jax.Array, hessian: jax.Array, fmt: Format, cfg: GPTQ = GPTQ(), *,
                where: str = "layer", global_amax: jax.Array | None = None) -> QuantizedWeight:
    """GPTQ-quantize a kernel [in, out] given the Hessian H = 2/n X^T X [in, in] of its inputs (module docstring).
    `global_amax` (NVFP4): the amax the global scale is made from, default the kernel's own (a fused group's
    shared amax, `jaxlowfp.ptq.serving`)."""
    n_in, out = kernel.shape
    h = np.array(hessian, np.float32)
    if h.shape != (n_in, n_in):
        raise ValueError(f"{where}: the Hessian must be [in, in] = {(n_in, n_in)}; got {h.shape}")
    if not np.isfinite(h).all():
        raise ValueError(f"{where}: the Hessian has non-finite values (calibration activations overflowed?)")
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    perm = np.argsort(-np.diag(h), kind="stable") if cfg.act_order else np.arange(n_in)
    pos = np.argsort(perm)  # processing position of each original column
    hp = h[perm][:, perm]
    on = _row_mesh(kernel, out)
    if on is None:
        put = jnp.asarray
    else:  # the kernel's own devices; the small host arrays replicated on the mesh
        put = functools.partial(sharding.shard, shardings=NamedSharding(on[0], P()))  # noqa: E731
    damp = cfg.damp_percent / 100.0
    hd = put(hp) if cfg.factorization == "device" else None
    for _ in range(4):
        if hd is not None:
            ud, ok = _device_inverse_cholesky(hd, jnp.float32(damp))
            u = ud if bool(ok) else None
        else:
            u = _inverse_cholesky(hp, damp)
            u = u if u is not None and np.isfinite(u).all() else None
        if u is not None:
            break
        damp *= 10.0
    else:
        raise ValueError(f"{where}: the damped Hessian is not positive definite even with damp_percent="
                         f"{100 * damp / 10:g}; use more calibration data")
    del hd

    g = fmt.group or n_in
    n_groups = n_in // g
    group_cols = pos.reshape(n_groups, g)  # processing positions of each group's columns
    group_of = perm // g
    first = np.zeros(n_in, bool)
    first[group_cols.min(axis=1)] = True
    original = fmt.per_tensor or cfg.scales == "original"
    if original:  # every group fixed before the loop, from the original weights; never again
        first[:] = False
    chunk = int(np.gcd(n_in, cfg.block_size))
    if on is None:  # one device: a kernel spanning other processes is taken whole first
        kernel = jnp.asarray(sharding.to_host(kernel) if sharding.is_global(kernel) else kernel, jnp.float32)
        loop = functools.partial(_gptq, fmt=fmt, chunk=chunk, original=original)
    else:  # the kernel's own devices, rows split over them
        mesh, axes = on
        kernel = kernel.astype(jnp.float32)
        loop = _sharded_loop(mesh, axes, fmt, chunk, original)
    # the original weights' amax
    amax = jnp.max(jnp.abs(kernel)) if global_amax is None else put(np.asarray(sharding.to_host(global_amax),
                                                                                np.float32))
    w = _prepare(kernel, put(dead), put(perm.astype(np.int32)))
    u = u if isinstance(u, jax.Array) else put(u)  # the device factorization's U is already in place
    # committed together (`placement.commit_tree`): one compiled loop whichever of them came uncommitted
    args = commit_tree((w, u, put(group_of.astype(np.int32)), put(first), put(group_cols.astype(np.int32)), amax))
    qv, deq, params = loop(*args)
    return QuantizedWeight(*_finish(qv, deq, params, put(pos.astype(np.int32)), amax, fmt=fmt))


@jax.jit
def _prepare(kernel: jax.Array, dead: jax.Array, perm: jax.Array) -> jax.Array:
    """W = kernel^T [out, in] with its dead input columns zeroed, columns in processing order."""
    return jnp.where(dead[None, :], 0.0, kernel.T)[:, perm]


@functools.partial(jax.jit, static_argnames=("fmt", "g"))
def _original_scales(w: jax.Array, amax: jax.Array, *, fmt: Format, g: int) -> jax.Array:
    """[groups, out] scales of every group of the original W [out, in] (the fixes of the column loop)."""
    cols = jnp.swapaxes(w.reshape(w.shape[0], -1, g), 0, 1)  # [groups, out, g]
    if fmt.kind == "nvfp4":
        return jax.vmap(lambda c: nvfp4_fix(c, fmt, amax))(cols)
    if fmt.kind in MX_ELEMENTS:
        return jax.vmap(lambda c: mx_fix(c, fmt.kind))(cols)
    raise ValueError(f"GPTQ(scales='original') supports nvfp4, mxfp4, mxfp8, hif8 and fp8 weights; got "
                     f"{fmt.kind!r}")


@functools.partial(jax.jit, static_argnames=("fmt",))
def _finish(qv, deq, params, pos, amax, *, fmt: Format):
    """Columns back in the original order; NVFP4: the packed array (the kernel is its dequantization)."""
    qv, deq = qv[:, pos], deq[:, pos]
    if fmt.kind != "nvfp4":
        return deq.T, None, None
    s_enc, s_dec = nvfp4.global_scales(amax, two_level_of(fmt)[0])
    arr = pack_nvfp4(qv, params.T, s_dec, fmt)
    return arr.dequantize(jnp.float32).T, arr, s_enc
