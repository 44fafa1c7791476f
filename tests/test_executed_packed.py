"""The results JSON's ``executed`` record of a packed model: packed weights are parameters, not ops, so they are
listed by themselves (``executed.packed``), with their format, activation scale and backend, read from the model."""

import json

import pytest

from jaxlowfp import ptq
from jaxlowfp.harness import JaxLowFPLM
from jaxlowfp.models import load
from test_harness import CFG, _inst, random_weights, write_gguf


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("p") / "tiny.gguf"
    write_gguf(path, random_weights(CFG, seed=7))
    return path


@pytest.mark.parametrize("act_scale, weights_only, act", [("token", False, "token"),
                                                          ("token", True, "none (weights only)")])
def test_the_record_lists_the_packed_weights(tiny_path, act_scale, weights_only, act):
    model, tok = load(tiny_path)
    rule = ptq.Rule(path=r"blocks/1/mlp/\w+_proj", scheme=ptq.scheme("nvfp4-mse", weights_only=weights_only))
    res = ptq.quantize_model(model, [rule], progress=False, activation_scale=act_scale)
    ptq.pack_model(model, res)
    lm = JaxLowFPLM(model=model, tokenizer=tok, batch_size=1)
    lm.loglikelihood([_inst("loglikelihood", "the thin cat sat", " on the mat")])
    ex = lm.get_model_info()["quantization"]["executed"]
    assert ex["ops"] == 0  # the packed layers' quantizers are not ops of the model
    packed = ex["packed"]
    assert sorted(packed["per_weight"]) == [f"blocks/1/mlp/{n}_proj" for n in ("down", "gate", "up")]
    assert packed["weights"] == 3 and packed["by_kind"] == {f"nvfp4-mse | {act} | dequant": 3}
    assert json.loads(json.dumps(ex)) == ex
