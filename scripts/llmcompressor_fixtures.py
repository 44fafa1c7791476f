"""Fixtures from llm-compressor's own PTQ code for tests/test_ptq_sequential.py (CI has no PyTorch):

    /work/venvs/lc/bin/python scripts/llmcompressor_fixtures.py     # writes tests/fixtures/llmcompressor_ptq.npz

Made with llmcompressor 0.14.0.1, compressed-tensors 0.19.0, torch 2.13.0+cpu (Python 3.11; the venv as in
scripts/llmcompressor_ptq.py). Contents:

- GPTQ: a random layer W [32, 64] (float32, N(0, 0.1^2)) and H = 2/n X^T X of correlated inputs X [512, 64] with four
  outlier channels; llm-compressor's NVFP4 weight observer (``memoryless_minmax``, the preset's TENSOR_GROUP args:
  global scale 448*6/amax, E4M3 block scales from the original weights), then its
  ``modifiers/gptq/gptq_quantize.py: quantize_weight`` (block_size 128, dampening_frac 0.01) with actorder
  ``"weight"`` (``gptq_weight``) and without (``gptq_none``): the dequantized Q [32, 64], and the observer's block
  scales (``scales``, E4M3 values as float32) and global scale (``global_scale``, the encode scale).
- AWQ: ``AWQModifier._get_grid_search_params`` for n_grid 20 with duo_scaling True / False / "both" (``grid_*``: rows
  of (ratio, duo)), and ``_compute_layer_means`` of two random NVFP4 layers [48, 64] and [32, 64] (``w_mean``,
  inputs ``awq_w0``, ``awq_w1`` in PyTorch's [out, in]).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import NVFP4
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
from llmcompressor.modifiers.transform.awq import AWQModifier
from llmcompressor.observers.base import Observer

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "llmcompressor_ptq.npz"


def main() -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((32, 64)) * 0.1).astype(np.float32)
    x = rng.standard_normal((512, 64)) @ rng.standard_normal((64, 64)) * 0.3
    x[:, :4] *= 8.0
    x = x.astype(np.float32)
    h = (2.0 * x.T.astype(np.float64) @ x / len(x)).astype(np.float32)
    out = {"w": w, "h": h}
    for order in ("weight", None):
        args = NVFP4["weights"].model_copy(deep=True)
        args.actorder = order
        obs = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
        obs(torch.from_numpy(w))
        qp = obs.get_qparams()
        q, _, fallback = quantize_weight(torch.from_numpy(w)[None].clone(), torch.from_numpy(h)[None].clone(),
                                         qp["scale"][None], qp["zero_point"][None],
                                         qp["global_scale"].reshape(-1)[:1], args, blocksize=128, percdamp=0.01)
        assert not bool(fallback.any())
        out[f"gptq_{order or 'none'}"] = q[0].numpy().astype(np.float32)
        out["scales"] = qp["scale"].float().numpy()
        out["global_scale"] = qp["global_scale"].float().numpy().reshape(-1)
    for duo in (True, False, "both"):
        params = AWQModifier(n_grid=20, duo_scaling=duo)._get_grid_search_params()
        out[f"grid_{duo}"] = np.array([(r, float(d)) for r, d in params], np.float64)
    layers = []
    for i, shape in enumerate(((48, 64), (32, 64))):
        lin = torch.nn.Linear(shape[1], shape[0], bias=False)
        wi = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        wi[:, 3] *= 10.0
        lin.weight.data = torch.from_numpy(wi)
        lin.quantization_scheme = QuantizationScheme(targets=["Linear"], weights=NVFP4["weights"])
        out[f"awq_w{i}"] = wi
        layers.append(lin)
    out["w_mean"] = AWQModifier._compute_layer_means(layers).detach().float().numpy()
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT}: {', '.join(f'{k} {v.shape}' for k, v in out.items())}")


if __name__ == "__main__":
    main()
