"""A tiny Llama (Q8_0 GGUF) and SmolLM2-135M on 8 simulated CPU devices (``fsdp=4,tensor=2``) against one device,
each in a subprocess of its own (tests/eight_devices_child.py: this run has 4 devices, conftest): sharded load bit
for bit, per-device bytes falling as 1/n over 1 / 2 / 4 / 8 devices, perplexity and greedy generation within
float32 rounding (tests/test_sharded_eval.py says why and how far), GPTQ NVFP4 4/6 with the kernels in their shards,
and the compressed-tensors export written from the shards.

GPTQ's codes: the mesh sums each Hessian's rows per device, then all-reduces, so its float32 sums run in another
order than one device's. A code whose GPTQ-updated weight lies near a rounding boundary of E2M1 (or a block whose two
4/6 candidates have nearly equal error) can then go either way, and that change feeds the rest of the row's column
loop. The child measures how many codes the order alone moves: one device, the same rows permuted. Measured at
LLVM -O0 on this VM (SmolLM2, block 0's MLP, 8 x 32 rows): 5,749 of 2,654,208 codes (0.22 %) differ on the mesh,
6,426 in the control (scales: 424 and 482); on the tiny Llama none in either. The test allows the mesh twice the
control plus 0.05 % of the codes (another CPU, another LLVM level, another order). The export must differ from the
one-device export exactly there: in those layers' ``weight_packed`` (the same count of codes) and
``weight_scale``, nowhere else."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_sharding import _write
from conftest import child_xla_flags

ROOT = Path(__file__).resolve().parents[1]
_ATOL_PER_TOKEN = 1e-5  # per scored token, as tests/test_sharded_eval.py
_SLACK = 1e-4  # a generated token that differs must be greedy within this (a near tie of the one-device logits)


def _child(model: str, ptq_layers: str, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FLAGS")} | {
        "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": child_xla_flags()}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "eight_devices_child.py"), model, str(out),
                           "--ptq-layers", ptq_layers], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("which", ["tiny-llama", "smollm2"])
def test_eight_devices_equal_one_device(which, tmp_path):
    if which == "tiny-llama":
        model, layers = str(_write(tmp_path, "gguf-q8_0")), r"blocks/\d+/(attn|mlp)/\w+_proj"
    else:  # every projection of SmolLM2's 30 blocks would take minutes here: block 0's MLP (2.6 M codes)
        model, layers = "smollm2-135m", r"blocks/0/mlp/\w+_proj"
    out = _child(model, layers, tmp_path / "out")
    assert out["devices"] == 8
    assert out["params_equal"]
    assert out["placed"]["blocks/0/mlp/up_proj/kernel"] == "P('fsdp', 'tensor')"
    assert out["placed"]["blocks/0/mlp/down_proj/kernel"] == "P('tensor', 'fsdp')"
    per = out["device_bytes"]
    # the replicated norms are the only bytes every device holds: 2.3 % of the tiny model's shard on 8 devices,
    # 0.2 % of SmolLM2's
    bound = 1.05 if which == "tiny-llama" else 1.01
    for n in (2, 4, 8):
        assert per["1"] / n <= per[str(n)] < bound * per["1"] / n, (n, per)

    ppl = out["perplexity"]
    assert ppl["tokens"][0] == ppl["tokens"][1] > 0
    assert abs(ppl["log_likelihood"][0] - ppl["log_likelihood"][1]) <= _ATOL_PER_TOKEN * ppl["tokens"][0], ppl
    assert all(g["equal"] or g["slack"] <= _SLACK for g in out["generate"]), out["generate"]

    q = out["gptq"]
    assert q["same_layers"] and len(q["layers"]) == (14 if which == "tiny-llama" else 3)
    # GPTQ ran with the kernels in their shards and left them there
    assert all(spec == out["placed"][p + "/kernel"] for p, spec in q["kernel_specs"].items()), q["kernel_specs"]
    assert q["codes_differ"] <= 2 * q["control_codes_differ"] + 5e-4 * q["codes"], q
    assert q["scales_differ"] <= 2 * q["control_scales_differ"] + 5e-4 * q["scales"], q
    differ = out["export"]["differ"]
    assert out["export"]["tensors"] > 3 * len(q["layers"])
    quantized = {f"{p.replace('blocks/', 'model.layers.').replace('/mlp/', '.mlp.').replace('/attn/', '.self_attn.')}"
                 for p in q["layers"]}
    assert all(name.rsplit(".", 1)[0] in quantized and name.endswith((".weight_packed", ".weight_scale"))
               and n > 0 for name, n in differ.items()), differ
    assert sum(n for name, n in differ.items() if name.endswith(".weight_packed")) == q["codes_differ"]
    assert sum(n for name, n in differ.items() if name.endswith(".weight_scale")) == q["scales_differ"]
