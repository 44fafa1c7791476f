"""One vocabulary (issue 27 item 3): the public names of every public module, read with ``dir()`` as a user does.

A name that two public modules both define means one thing: the same object, an equal constant, or one of the
per-module names documented below (one meaning, each module's own instance: ``nvfp4.quantize`` and ``mx.quantize``
both return codes). The verbs are checked by what they return, old names warn and still work, and every name list
is the registry's."""
import dataclasses
import importlib
import inspect
import re
import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlowfp
from jaxlowfp import if4, mx, nvfp4, registry

ROOT = Path(__file__).resolve().parents[1]

PUBLIC_MODULES = [
    "jaxlowfp", "jaxlowfp.formats", "jaxlowfp.hif8", "jaxlowfp.nvfp4", "jaxlowfp.mx", "jaxlowfp.if4",
    "jaxlowfp.hadamard", "jaxlowfp.scaling", "jaxlowfp.dispatch", "jaxlowfp.rules", "jaxlowfp.registry",
    "jaxlowfp.training", "jaxlowfp.qat", "jaxlowfp.qnnx", "jaxlowfp.qlinen", "jaxlowfp.owg", "jaxlowfp.qwix_provider",
    "jaxlowfp.harness", "jaxlowfp.eval_quantize", "jaxlowfp.eval_record", "jaxlowfp.lm_eval_tasks",
    "jaxlowfp.lm_eval_cli", "jaxlowfp.evaluation", "jaxlowfp.models", "jaxlowfp.ptq", "jaxlowfp.packed",
    "jaxlowfp.backends", "jaxlowfp.ops", "jaxlowfp.execution", "jaxlowfp.sharding", "jaxlowfp.packed_layer",
]

# The names that several modules define on purpose, each module its own object, with the one meaning they share.
PER_MODULE = {
    "quantize": "x -> codes (a jaxlowfp.QArray) in the module's format",
    "fake_quantize": "x -> dequantize(quantize(x)) in x's dtype, in the module's format",
    "quantize_model": "quantize a model's layers in place by path rules and report what was done: qnnx with QAT "
                      "recipes (fake-quant layers that train), ptq with PTQ schemes (weights quantized once)",
    "dequantize": "codes -> values, in the module's format",
    "global_scales": "the two-level format's (S_enc, S_dec) from a tensor amax",
    "FORMATS": "the format names of the module's family (jaxlowfp.formats: the element-format descriptors by name)",
    "RULES": "the block-scale rules the module accepts",
    "ROUNDINGS": "the rounding modes the module accepts (hif8: its tie rules ta / hybrid)",
    "QuantEinsum": "the quantized einsum layer of the module's framework (qnnx: Flax NNX, qlinen: Flax Linen)",
    "collect_stats": "the quantized layers' last statistics, in the module's framework",
    "set_observe_only": "switch the quantized layers to observe-only, in the module's framework",
    "load": "read a checkpoint: models.load builds the model (and tokenizer) from a checkpoint, ptq.load fills "
            "a given model from a directory written by ptq.export",
}
# names that are the same object in several modules on purpose (a re-export) need no entry: _same() accepts them


def _public(module):
    """{name: object} of ``dir(module)``: not underscored, not a module, and defined by jaxlowfp (a constant has no
    ``__module__`` and counts; a re-exported jax/typing object does not)."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # dir() must never list a deprecated name
        for name in dir(module):
            if name.startswith("_"):
                continue
            obj = getattr(module, name)
            origin = getattr(obj, "__module__", None)
            if isinstance(obj, types.ModuleType) or (origin is not None and not str(origin).startswith("jaxlowfp")):
                continue
            out[name] = obj
    return out


def _same(a, b) -> bool:
    if a is b:
        return True
    try:
        return isinstance(a, tuple | int | str | float) and type(a) is type(b) and a == b
    except Exception:
        return False


def test_no_two_public_names_mean_different_things():
    seen: dict[str, list[tuple[str, object]]] = {}
    for m in PUBLIC_MODULES:
        for name, obj in _public(importlib.import_module(m)).items():
            seen.setdefault(name, []).append((m, obj))
    clashes = {name: [m for m, _ in where] for name, where in seen.items()
               if len(where) > 1 and not all(_same(where[0][1], o) for _, o in where[1:]) and name not in PER_MODULE}
    assert not clashes, f"one name, different objects, no documented meaning: {clashes}"
    unused = sorted(n for n in PER_MODULE if len(seen.get(n, ())) < 2)
    assert not unused, f"documented per-module names that no longer clash: {unused}"


HELPERS = {"one_of", "float_input", "float_dtype", "pytree_dataclass", "deprecated_getattr", "renamed_kwarg",
           "annotations", "Any", "Callable", "Sequence", "Mapping", "Literal", "NamedTuple", "ArrayLike", "DTypeLike",
           "Path", "dataclasses", "functools", "np", "jnp", "jax", "nnx", "lax"}


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_dir_shows_the_api_only(name):
    """``dir()`` of every public module is its ``__all__``: no helper import, no typing name, no deprecated name;
    every listed name resolves without a DeprecationWarning."""
    mod = importlib.import_module(name)
    listed = set(mod.__all__)
    shown = {n for n in dir(mod) if not n.startswith("__")}
    assert shown == listed, (name, sorted(shown - listed), sorted(listed - shown))
    assert not shown & HELPERS, (name, sorted(shown & HELPERS))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for n in listed:
            getattr(mod, n)


# Keywords whose meaning is fixed across the whole public API (issue 42: one keyword per meaning).
KEYWORDS = {
    "gemm": "the GEMM backend a quantized product runs on (QAT recipes, the lm-eval backend)",
    "pallas_backend": "the Pallas backend of a kernel: 'triton' or 'mosaic'",
    "impl": "Pallas kernel or XLA: 'auto', 'xla', 'pallas'",
    "arithmetic": "the NVFP4 decode order: 'jaxlowfp' or 'compressed-tensors'",
}


def _public_callables():
    seen = set()
    for m in PUBLIC_MODULES:
        for obj in _public(importlib.import_module(m)).values():
            if callable(obj) and id(obj) not in seen:
                seen.add(id(obj))
                try:
                    yield m, obj, inspect.signature(obj)
                except (TypeError, ValueError):
                    continue


def test_one_keyword_one_meaning():
    """A Pallas backend is never passed as ``backend=`` (``pallas_backend=``), and the NVFP4 decode order is never
    ``convention=`` (``arithmetic=``; ``convention=`` is a peer's scaling convention, DelayedScaling's). Deprecated
    spellings take None by default and warn."""
    bad = []
    for m, obj, sig in _public_callables():
        ps = sig.parameters
        for kw in ("backend", "convention"):
            p = ps.get(kw)
            if p is None:
                continue
            pallas = "pallas_backend" in ps or p.default in ("triton", "mosaic")
            nvfp4_order = "arithmetic" in ps or p.default in ("jaxlowfp", "compressed-tensors")
            if (kw == "backend" and pallas or kw == "convention" and nvfp4_order) and p.default is not None:
                bad.append(f"{m}.{getattr(obj, '__name__', obj)}({kw}=)")
    assert not bad, f"keywords with another meaning than elsewhere: {bad}"


def test_one_format_type():
    """One tensor format type, named by one registry; "nvfp4" is standard NVFP4 everywhere, 4/6 is named."""
    import jaxlowfp
    from jaxlowfp import ptq, qat

    assert jaxlowfp.Format.parse("nvfp4") == jaxlowfp.Format(kind="nvfp4", rule="static_6")
    assert jaxlowfp.Format.parse("nvfp4-static_6").name == "nvfp4"
    assert qat.QuantSpec(format="nvfp4").rule == "static_6" and ptq.scheme("nvfp4").weight.rule == "static_6"
    assert qat.named_recipe("nvfp4").weight.rule == "static_6" and qat.named_recipe("nvfp4-mse").weight.rule == "mse"
    assert qat.QuantSpec(format=jaxlowfp.Format.parse("nvfp4-mse-16x16")).block_shape == (16, 16)
    assert set(registry.FORMATS) == set(jaxlowfp.FORMATS) and len(set(registry.FORMATS)) == len(registry.FORMATS)
    for name, fmt in jaxlowfp.FORMATS.items():
        assert (jaxlowfp.Format.parse(name) == fmt and fmt.name == name
                and hash(fmt) == hash(jaxlowfp.Format.parse(name)))
    with pytest.warns(DeprecationWarning):
        legacy = ptq.TensorFormat(kind="nvfp4")
    assert legacy == jaxlowfp.Format.parse("nvfp4-mse")  # the old name keeps its old default, and is the one type
    with pytest.raises(ValueError, match="allowed"):
        jaxlowfp.Format.parse("nvfp8")


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4-mse", "if4-mse", "mxfp4", "mxfp8", "fp8", "hif8",
                                  "nvfp4-ct"])
def test_top_level_quantize_dispatches_on_the_format(name):
    """``jaxlowfp.quantize(x, fmt)`` gives the per-format module's codes, ``dequantize`` their values, and
    ``fake_quantize`` is ``dequantize(quantize(x))`` bit for bit, under jit too."""
    import jaxlowfp

    q = jaxlowfp.quantize(X, name)
    y = np.asarray(jaxlowfp.dequantize(q))
    assert y.shape == X.shape and q.shape == X.shape
    if not name.endswith("-ct"):
        np.testing.assert_array_equal(np.asarray(jaxlowfp.fake_quantize(X, name)), y)
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: jaxlowfp.fake_quantize(v, name))(X)), y)
    if name.startswith("nvfp4") and not name.endswith("-ct"):
        f = jaxlowfp.Format.parse(name)
        ref = nvfp4.quantize(X, rule=f.rule, block_shape=f.block_shape)
        np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(ref.codes))
    assert float(np.max(np.abs(y - np.asarray(X)))) < 0.5 * float(np.max(np.abs(np.asarray(X))))


def test_rule_is_one_type():
    from jaxlowfp import ptq, qnnx, rules

    import jaxlowfp

    for m in PUBLIC_MODULES:
        obj = _public(importlib.import_module(m)).get("Rule")
        assert obj is None or obj is rules.Rule, m
    assert jaxlowfp.Rule is qnnx.Rule is ptq.Rule is rules.Rule
    assert inspect.isclass(rules.Rule)


X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32) * 3.0)


@pytest.mark.parametrize("module", [nvfp4, if4, mx], ids=lambda m: m.__name__)
def test_quantize_returns_codes_fake_quantize_values(module):
    q = module.quantize(X)
    assert q.codes.dtype == jnp.uint8 and q.codes.shape[:-1] == X.shape[:-1]  # codes, packed along the last axis
    y = module.fake_quantize(X)
    assert y.shape == X.shape and y.dtype == X.dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(module.dequantize(q, X.dtype)))


def test_model_level_calls_say_so():
    from jaxlowfp import harness, ptq, qnnx

    for module in (qnnx, ptq, harness):
        names = _public(module)
        assert "quantize" not in names and "fake_quantize" not in names, module.__name__
    assert "model" in inspect.signature(qnnx.quantize_model).parameters
    assert "model" in inspect.signature(ptq.quantize_model).parameters
    assert "model" in inspect.signature(harness.fake_quantize_model).parameters


def test_format_modules_share_keyword_names():
    """The same meaning, the same keyword: format= (which format of the family), rule= (how a block picks its
    scale or grid); rounding=, block_shape=, global_amax=, key= where the module has them."""
    vocabulary = {"format", "rule", "block_shape", "global_amax", "rounding", "key", "impl", "pallas_backend"}
    deprecated = {"elem", "scale_rule", "backend"}
    for module in (nvfp4, if4, mx):
        for fn in (module.quantize, module.fake_quantize):
            kw = {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
            assert kw - deprecated <= vocabulary, (fn.__module__, fn.__name__, kw - vocabulary)
            assert "rule" in kw
    assert {"format", "rule"} <= set(inspect.signature(mx.quantize).parameters)
    assert {"format", "rule"} <= set(inspect.signature(if4.quantize).parameters)


def test_nvfp4_quantize_defaults_to_the_standard_format():
    """The default is standard NVFP4 (rule static_6): S_dec = amax / (6 * 448) (NVIDIA's two-level scaling), every
    block mapped to 6; 4/6 is asked for by name."""
    q = nvfp4.quantize(X)
    assert q.rule == "static_6"
    amax = np.float32(np.max(np.abs(np.asarray(X))))
    assert float(q.global_scale) == float(np.float32(1) / np.float32(np.float32(2688.0) / amax))
    assert not np.asarray(nvfp4.selected_map4(X, rule="static_6")).any()
    assert nvfp4.fake_quantize(X).tolist() == nvfp4.fake_quantize(X, rule="static_6").tolist()
    assert inspect.signature(nvfp4.fake_quantize).parameters["rule"].default == "static_6"


def test_name_lists_come_from_the_registry():
    from jaxlowfp import harness, ptq, qat
    from jaxlowfp.ptq import formats as ptq_formats
    from train import eval_cli, ptq_cli

    assert "search" in nvfp4.RULES and nvfp4.RULES == registry.NVFP4_RULES
    assert set(nvfp4.KERNEL_RULES) == set(nvfp4.RULES) - {"search"}
    assert if4.RULES == registry.IF_RULES and if4.FORMATS == registry.IF_FORMATS
    assert mx.RULES == registry.MX_RULES and mx.FORMATS == registry.MX_FORMATS
    assert qat.QuantSpec.__module__ and registry.QAT_FORMATS == importlib.import_module("jaxlowfp.qat.spec").FORMATS
    assert harness.QUANTIZE is registry.EVAL_QUANTIZE and eval_cli.QUANT_CHOICES is registry.EVAL_QUANTIZE
    assert ptq_cli.FORMATS is registry.PTQ_FORMATS and ptq_formats.SCHEMES is registry.PTQ_FORMATS
    assert {f"if4-{r}" for r in registry.IF_RULES} <= set(harness.QUANTIZE)  # the harness knows IF4 and search
    assert "nvfp4-search" in harness.QUANTIZE
    for name in registry.EVAL_QUANTIZE[1:]:  # every name builds what it says
        r = qat.named_recipe(name)
        assert isinstance(r, qat.Recipe)
        if name.startswith(("nvfp4", "if4-")):
            kind, rule = name.split("-", 1) if "-" in name else (name, "static_6")
            assert (r.weight.format, r.weight.rule) == (kind, rule)
    for name in registry.PTQ_FORMATS:
        assert ptq.scheme(name).weight.kind == name.split("-")[0]
        assert ptq.scheme(name).weight.name == name  # the registry's name is the format's own


def _deprecated():
    """(module, old name, new name, getter) of every deprecated module attribute."""
    out = []
    for m in PUBLIC_MODULES:
        mod = importlib.import_module(m)
        aliases = getattr(getattr(mod, "__getattr__", None), "aliases", {})
        out += [(m, old, new, get) for old, (new, get) in aliases.items()]
    return out


# old names whose object is a shim with the old defaults (NVFP4 rule "mse") that builds the new type
LEGACY_SHIMS = {("jaxlowfp.packed", "PackedFormat"), ("jaxlowfp.ptq", "TensorFormat")}
# old names that keep their old object (the new name is a different, broader one)
KEPT = {("jaxlowfp.qat", "dot_general")}
# the old quantized-array types: constructors (old keywords) that build a jaxlowfp.QArray; isinstance by format kind
LEGACY_ARRAYS = {("jaxlowfp.nvfp4", "NVFP4Array"), ("jaxlowfp.if4", "IFArray"), ("jaxlowfp.mx", "MXArray"),
                 ("jaxlowfp.packed", "ScaledArray")}
# the loaders' modules behind jaxlowfp.models (public through their __all__, called by the models package)
LOADER_MODULES = ["jaxlowfp.models.gguf_loader", "jaxlowfp.models.quantized", "jaxlowfp.models.common",
                  "jaxlowfp.models.exported", "jaxlowfp.models.config"]
# a `backend` that is JAX's platform ("cpu", "gpu", "tpu": jax.default_backend()), not a GEMM nor a Pallas backend
JAX_PLATFORM = {"compute_dtype_for_backend"}
# records whose field `backend` reports the GEMM that was chosen or ran (read, never passed to choose one)
BACKEND_RECORDS = {"Plan", "QuantizedOp"}


def test_backend_is_never_the_new_name():
    """The GEMM backend is ``gemm=`` and the Pallas backend ``pallas_backend=`` in every public function, the model
    loaders' modules included: a ``backend=`` left is a deprecated spelling (default None) next to its new name."""
    bad = []
    mods = [(m, _public(importlib.import_module(m))) for m in PUBLIC_MODULES]
    mods += [(m, {n: getattr(importlib.import_module(m), n) for n in importlib.import_module(m).__all__})
             for m in LOADER_MODULES]
    for m, names in mods:
        for name, obj in names.items():
            if not callable(obj) or name in JAX_PLATFORM | BACKEND_RECORDS:
                continue
            try:
                ps = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                continue
            p = ps.get("backend")
            if p is not None and (p.default is not None or not ({"gemm", "pallas_backend"} & set(ps))):
                bad.append(f"{m}.{name}(backend={p.default!r})")
    assert not bad, f"backend= as a current keyword (use gemm= or pallas_backend=): {bad}"


def test_the_loaders_old_backend_keyword_warns_and_still_works(tmp_path):
    """``backend=`` of the loaders behind `jaxlowfp.models.load` is ``gemm=``'s deprecated spelling: it warns, names
    the new keyword, and is still taken; both at once is a TypeError."""
    from flax import nnx

    from jaxlowfp.models import CheckpointError, common, gguf_loader, quantized

    for fn, arg in ((gguf_loader.load_gguf, tmp_path / "none.gguf"), (quantized.load_quantized, tmp_path)):
        with pytest.warns(DeprecationWarning, match=re.escape(f"{fn.__name__}(backend=...) is deprecated") + ".*gemm="):
            with pytest.raises(CheckpointError):  # the keyword is read first, then the missing checkpoint refused
                fn(arg, backend="dequant")
        with pytest.raises(TypeError, match="pass gemm= only"):
            fn(arg, gemm="fp8", backend="dequant")
    model = nnx.Sequential(nnx.Linear(16, 16, rngs=nnx.Rngs(0)))
    with pytest.warns(DeprecationWarning, match=r"install_packed\(backend=\.\.\.\) is deprecated.*gemm="):
        common.install_packed(model, {}, backend="dequant")  # no weight: nothing to replace
    assert isinstance(model.layers[0], nnx.Linear)


# a PTQ result record, no longer public: rtn_weight / gptq_weight return it (its .packed is a jaxlowfp.QArray)
RESULT_RECORDS = {("jaxlowfp.ptq", "QuantizedWeight")}


def test_deprecated_names_warn_and_still_work():
    found = _deprecated()
    assert {(m, old) for m, old, _, _ in found} >= {
        ("jaxlowfp.nvfp4", "Rule"), ("jaxlowfp.nvfp4", "ALL_RULES"), ("jaxlowfp.if4", "Rule"),
        ("jaxlowfp.if4", "Format"), ("jaxlowfp.mx", "ELEMENTS"), ("jaxlowfp.mx", "SCALE_RULES"),
        ("jaxlowfp.harness", "fake_quantize"), ("jaxlowfp.qnnx", "quantize"), ("jaxlowfp.ptq", "quantize"),
        ("jaxlowfp.owg", "encode"), ("jaxlowfp.owg", "decode"),
        ("jaxlowfp.owg", "init"), ("jaxlowfp.ptq", "TensorFormat"), ("jaxlowfp.packed", "PackedFormat"),
        ("jaxlowfp.formats", "Format"), ("jaxlowfp.ptq", "pack"), ("jaxlowfp.dispatch", "BACKENDS"),
        ("jaxlowfp.sharding", "resolve"), ("jaxlowfp.qat", "dot_general"), *LEGACY_ARRAYS, *RESULT_RECORDS}
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for m, old, new, get in found:
        mod = importlib.import_module(m)
        assert old not in dir(mod)
        with pytest.warns(DeprecationWarning, match=re.escape(f"{m}.{old} is deprecated") + ".*" + re.escape(new)):
            obj = getattr(mod, old)
        assert obj is get()
        new_module, new_name = new.rsplit(".", 1)
        new_obj = getattr(importlib.import_module(new_module), new_name)  # the new name is public
        if (m, old) in LEGACY_SHIMS:  # the old name keeps its old defaults and builds the new type
            assert isinstance(obj(kind="nvfp4"), new_obj)
        elif (m, old) in KEPT or (m, old) in RESULT_RECORDS:
            assert callable(obj) and callable(new_obj) and obj is not new_obj
        elif (m, old) in LEGACY_ARRAYS:
            assert new_obj is jaxlowfp.QArray and obj is not new_obj
        else:
            assert obj is new_obj
        assert f"`{m}.{old}`" in changelog and f"`{new}`" in changelog, f"CHANGELOG.md does not list {m}.{old}"
    with pytest.warns(DeprecationWarning):
        from jaxlowfp.nvfp4 import Rule  # noqa: F401  (from-imports go through the module __getattr__ too)
    with pytest.raises(AttributeError, match="has no attribute 'Rul'"):
        nvfp4.Rul  # noqa: B018


def test_the_qat_function_is_not_shadowed_by_a_module():
    from jaxlowfp import qat

    import jaxlowfp.qat.scaled_quant  # noqa: F401  (importing every submodule leaves the function in place)

    assert callable(qat.fake_quant) and not isinstance(qat.fake_quant, types.ModuleType)
    assert not (ROOT / "jaxlowfp" / "qat" / "fake_quant.py").exists()


def test_one_public_quantized_array_type():
    """Every public class holding codes is jaxlowfp.QArray (PackedWeight holds one as .array: a GEMM weight
    container, not a second array type); the old array types are deprecated names only (not in any dir())."""
    arrays = {}
    for m in PUBLIC_MODULES:
        for name, obj in _public(importlib.import_module(m)).items():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and "codes" in {
                    f.name for f in dataclasses.fields(obj)}:
                arrays[f"{m}.{name}"] = obj
    assert set(arrays.values()) == {jaxlowfp.QArray}, arrays
    assert "QArray" in dir(jaxlowfp) and "NVFP4Array" not in dir(jaxlowfp)
    for m, old in LEGACY_ARRAYS | RESULT_RECORDS:
        assert old not in dir(importlib.import_module(m))
