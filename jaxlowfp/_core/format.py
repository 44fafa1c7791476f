"""One tensor format: :class:`Format` (frozen, hashable) and the registry of named formats, :data:`FORMATS`.

A format says how a tensor becomes codes: the element type, how many values share a scale (the block, along the
last axis: the GEMM's contraction axis), the scale's type, whether an FP32 tensor scale sits above the block scales,
and, for the two-level formats, the block-scale rule (Four Over Six among them)::

    kind    elements            block scale          tensor scale         rule
    nvfp4   E2M1                E4M3 per 16          FP32, amax/(M*E)     static_6 (standard), static_4, 4/6 (mse,
                                                                          mae, abs_max), search
    if4     E2M1 or INT4        E4M3 per 16 (flag)   FP32                 mse | mae | abs_max (the FP-or-INT choice)
    mxfp4   E2M1                E8M0 per 32          none                 floor (OCP) | ceil (RCEIL)
    mxfp8   E4M3                E8M0 per 32          none                 floor | ceil
    fp8     E4M3                none                 FP32, amax/448       -
    hif8    HiF8                none                 FP32, amax/15        -

and, for the arrays of the per-format modules only (not in :data:`FORMATS`, the CLI or PTQ lists, :data:`KINDS`)::

    if6_e2m3, if6_e3m2, if3   FP6 / FP3 or INT6 / INT3   as if4 (``jaxlowfp.if4.quantize(format=...)``)
    mxfp8_e5m2                E5M2                       as mxfp8 (``jaxlowfp.mx.quantize(format="e5m2")``)

Names (:data:`FORMATS`, what every command line, the lm-eval backend's ``quantize=`` and the docs list): ``nvfp4``
is standard NVFP4 (rule static_6); Four Over Six and the other rules are always named: ``nvfp4-mse``,
``nvfp4-mae``, ``nvfp4-abs_max``, ``nvfp4-static_4``, ``nvfp4-search``; ``-16x16`` names 16x16 weight tiles.
``arithmetic`` says in which order NVFP4 is decoded: ``"jaxlowfp"`` ``(q * s) * (1 / g)``, or
``"compressed-tensors"`` ``q * (s / g)`` (llm-compressor's RTN, static_6 1x16 only).

This module is data only (no quantizer): ``jaxlowfp.quantize(x, fmt)`` and friends dispatch on it.

>>> Format.parse("nvfp4").rule, Format.parse("nvfp4-mse").name, Format(kind="mxfp4").group
('static_6', 'nvfp4-mse', 32)
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxlowfp._core import names

__all__ = ["Format", "FORMATS", "KINDS", "ARRAY_KINDS", "ARITHMETICS", "as_format"]

KINDS = ("nvfp4", "if4", "mxfp4", "mxfp8", "fp8", "hif8")  # the kinds PTQ, pack and the command lines take
IF_KINDS = names.IF_FORMATS  # jaxlowfp.if4.quantize(format=...): "if4", "if6_e2m3", "if6_e3m2", "if3"
MX_KINDS = ("mxfp4", "mxfp8", "mxfp8_e5m2")  # jaxlowfp.mx.quantize(format="e2m1" | "e4m3" | "e5m2")
ARRAY_KINDS = (*KINDS, *(k for k in IF_KINDS if k not in KINDS), "mxfp8_e5m2")  # every kind a jaxlowfp.QArray has
TWO_LEVEL = ("nvfp4", "if4")  # E4M3 block scales under an FP32 tensor scale (the kinds of KINDS)
MX = ("mxfp4", "mxfp8")
PER_TENSOR = {"fp8": ("e4m3", 448.0), "hif8": ("hif8", 15.0)}  # element, the value the amax maps to (clip bound)
ELEMENT = {"nvfp4": "e2m1", "if4": "e2m1", "mxfp4": "e2m1", "mxfp8": "e4m3", "fp8": "e4m3", "hif8": "hif8",
           "if6_e2m3": "e2m3", "if6_e3m2": "e3m2", "if3": "e2m0", "mxfp8_e5m2": "e5m2"}
MX_ELEMENT = {"mxfp4": "e2m1", "mxfp8": "e4m3", "mxfp8_e5m2": "e5m2"}  # jaxlowfp.mx's format= of each MX kind
GROUP = {"nvfp4": 16, **{k: 16 for k in IF_KINDS}, **{k: 32 for k in MX_KINDS}}
ARITHMETICS = ("jaxlowfp", "compressed-tensors")
_DEFAULT_RULE = {"nvfp4": "static_6", **{k: "mse" for k in IF_KINDS}, **{k: "floor" for k in MX_KINDS}}
_RULES = {"nvfp4": names.NVFP4_RULES, **{k: names.IF_RULES for k in IF_KINDS}, **{k: names.MX_RULES for k in MX_KINDS}}
_BLOCK_SHAPED = ("nvfp4", *IF_KINDS)  # (1, 16) blocks or (16, 16) tiles
_TARGET = {"if6_e2m3": 7.5, "if6_e3m2": 28.0, "if3": 4.0, "mxfp8": 448.0, "mxfp8_e5m2": 57344.0}  # the FP grid's max


def _one_of(value: Any, allowed: tuple, what: str) -> None:
    if value not in allowed:
        raise ValueError(f"{what}={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Format:
    """How a tensor is quantized (module docstring). Frozen and hashable, so it is static configuration under jit.

    Attributes:
      kind: "nvfp4", "if4", "mxfp4", "mxfp8", "fp8" (E4M3, one scale amax / 448) or "hif8" (one scale amax / 15);
        the arrays of the per-format modules also "if6_e2m3", "if6_e3m2", "if3" and "mxfp8_e5m2" (module docstring).
      rule: the block-scale rule: NVFP4 "static_6" (default, standard NVFP4), "static_4", the Four Over Six rules
        "mse", "mae", "abs_max", or "search"; IF4 "mse" (default), "mae", "abs_max"; MX "floor" (default, OCP) or
        "ceil". None for the per-tensor formats.
      block_shape: NVFP4 / IF4: (1, 16) (default) or (16, 16) tiles over the last two axes (weights). None otherwise.
      arithmetic: NVFP4 only: "jaxlowfp" (default) or "compressed-tensors", the order of the decode (and quantize)
        arithmetic; see the module docstring.
    """

    kind: str
    rule: str | None = None
    block_shape: tuple[int, int] | None = None
    arithmetic: str | None = None

    def __post_init__(self) -> None:
        _one_of(self.kind, ARRAY_KINDS, "kind")
        if self.kind in _RULES:
            rule = _DEFAULT_RULE[self.kind] if self.rule is None else self.rule
            _one_of(rule, tuple(_RULES[self.kind]), "rule")
            object.__setattr__(self, "rule", rule)
        elif self.rule is not None:
            raise ValueError(f"rule={self.rule!r} applies to the block-scaled formats (nvfp4, if4, mxfp4, mxfp8); "
                             f"got kind={self.kind!r}")
        if self.kind in _BLOCK_SHAPED:
            bs: Any = (1, 16) if self.block_shape is None else self.block_shape
            bs = tuple(bs) if isinstance(bs, (list, tuple)) else bs
            _one_of(bs, tuple(names.NVFP4_BLOCK_SHAPES), "block_shape")
            object.__setattr__(self, "block_shape", bs)
        elif self.block_shape is not None:
            raise ValueError(f"block_shape={self.block_shape!r} applies to kind 'nvfp4' or the IF kinds ('if4', "
                             f"'if6_e2m3', 'if6_e3m2', 'if3') only; got "
                             f"kind={self.kind!r}")
        if self.kind == "nvfp4":
            arith = "jaxlowfp" if self.arithmetic is None else self.arithmetic
            _one_of(arith, ARITHMETICS, "arithmetic")
            if arith == "compressed-tensors" and (self.rule != "static_6" or self.block_shape != (1, 16)):
                raise ValueError(f"arithmetic='compressed-tensors' is NVFP4 static_6 with 1x16 blocks "
                                 f"(llm-compressor's RTN); got rule={self.rule!r}, block_shape={self.block_shape}")
            object.__setattr__(self, "arithmetic", arith)
        elif self.arithmetic is not None:
            raise ValueError(f"arithmetic={self.arithmetic!r} applies to kind 'nvfp4' only; got kind={self.kind!r}")

    def _key(self) -> tuple:
        return (self.kind, self.rule, self.block_shape, self.arithmetic)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Format) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Format({self.name!r})"

    @classmethod
    def parse(cls, name: str) -> Format:
        """The format of a name: ``kind`` or ``kind-rule``, optionally ending in ``-16x16`` (NVFP4 / IF4 tiles)
        and ``-ct`` (NVFP4's compressed-tensors arithmetic), e.g. "nvfp4", "nvfp4-mse", "nvfp4-mse-16x16",
        "if4-mae", "mxfp4", "mxfp4-ceil", "fp8", "hif8"."""
        if not isinstance(name, str):
            raise TypeError(f"a format name must be a str; got {type(name).__name__}: {name!r}")
        kind, _, rest = name.lower().partition("-")
        arith = None
        if rest.endswith("ct") and (rest == "ct" or rest.endswith("-ct")):
            arith, rest = "compressed-tensors", rest[:-2].rstrip("-")
        bs = None
        if rest == "16x16" or rest.endswith("-16x16"):
            bs, rest = (16, 16), rest[:-len("16x16")].rstrip("-")
        if kind not in ARRAY_KINDS:
            raise ValueError(f"unknown format {name!r} (kind={kind!r} is not one of {', '.join(ARRAY_KINDS)}); allowed "
                             f"names: {', '.join(FORMATS)}, and -16x16 tiles for nvfp4 / if4")
        return cls(kind=kind, rule=rest or None, block_shape=bs, arithmetic=arith)

    @property
    def name(self) -> str:
        """The registry name: the kind, then the rule where it is not the default standard one ("nvfp4" is
        static_6; "if4" always names its rule, as do the 4/6 rules), "-16x16" for tiles, "-ct" for the
        compressed-tensors arithmetic."""
        if self.kind == "nvfp4":
            base = "nvfp4" if self.rule == "static_6" else f"nvfp4-{self.rule}"
        elif self.kind in IF_KINDS:
            base = f"{self.kind}-{self.rule}"
        elif self.kind in MX_KINDS:
            base = self.kind if self.rule == "floor" else f"{self.kind}-{self.rule}"
        else:
            base = self.kind
        return base + ("-16x16" if self.rows == 16 else "") + ("-ct" if self.arithmetic == "compressed-tensors"
                                                               else "")

    @property
    def element(self) -> str:
        """The element format's name: "e2m1", "e4m3", "e5m2" or "hif8" (``jaxlowfp.formats.get`` gives their
        descriptors); the FP grid of IF6 / IF3: "e2m3", "e3m2", "e2m0"."""
        return ELEMENT[self.kind]

    @property
    def two_level(self) -> bool:
        """E4M3 block scales under an FP32 tensor scale (NVFP4, IF4, IF6, IF3)."""
        return self.kind in _BLOCK_SHAPED

    @property
    def is_mx(self) -> bool:
        """OCP MX: E8M0 block scales, no tensor scale."""
        return self.kind in MX_KINDS

    @property
    def per_tensor(self) -> bool:
        """One FP32 scale for the whole tensor (FP8, HiF8)."""
        return self.kind in PER_TENSOR

    @property
    def four_over_six(self) -> bool:
        """Whether each NVFP4 block chooses between max -> 6 and max -> 4 (the 4/6 rules and the scale search)."""
        return self.kind == "nvfp4" and self.rule in (*names.NVFP4_FOUR_OVER_SIX, "search")

    @property
    def target(self) -> float:
        """The value a tensor's amax maps to: 6 (E2M1's max) for NVFP4 / IF4 / MXFP4, 448 for FP8 and MXFP8, 15 for
        HiF8 (the Max-Window paper's target, which keeps HiF8's 3-bit-mantissa band)."""
        if self.kind in PER_TENSOR:
            return PER_TENSOR[self.kind][1]
        return _TARGET.get(self.kind, 6.0)

    @property
    def group(self) -> int | None:
        """Values per scale along the last axis (None: one scale per tensor)."""
        return GROUP.get(self.kind)

    @property
    def rows(self) -> int:
        """Rows per scale tile across the last axis (16 for 16x16 tiles, else 1)."""
        return self.block_shape[0] if self.block_shape is not None else 1

    @property
    def bits(self) -> float:
        """Storage bits per element, block scales included (the tensor scale left out)."""
        elem = 4 if self.element == "e2m1" else 8  # IF6 / IF3 codes take a byte each
        return elem + (8 / (self.group * self.rows) if self.group else 0.0)


def _registry() -> dict[str, Format]:
    out = [Format(kind="nvfp4", rule=r) for r in names.NVFP4_RULES]
    out += [Format(kind="if4", rule=r) for r in names.IF_RULES]
    out += [Format(kind=k, rule=r) for k in MX for r in names.MX_RULES]
    out += [Format(kind="fp8"), Format(kind="hif8")]
    return {f.name: f for f in out}


FORMATS: dict[str, Format] = _registry()  # every named format (1x16 blocks, jaxlowfp arithmetic)


def two_level_of(fmt: Format) -> tuple[str, tuple[int, int]]:
    """A two-level format's (NVFP4, IF) block rule and block shape, which ``__post_init__`` sets for them only."""
    if fmt.rule is None or fmt.block_shape is None:
        raise ValueError(f"{fmt!r} has no block rule and block shape (the two-level formats NVFP4 and IF have)")
    return fmt.rule, fmt.block_shape


def as_format(fmt: Any, what: str = "format") -> Format:
    """A :class:`Format` from itself or from a name (:meth:`Format.parse`)."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str):
        return Format.parse(fmt)
    raise TypeError(f"{what} must be a jaxlowfp.Format or a format name such as 'nvfp4' or 'nvfp4-mse' "
                    f"({', '.join(FORMATS)}); got {type(fmt).__name__}: {fmt!r}")
