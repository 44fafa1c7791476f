# One HiF8 W8A8 QAT step with max-window delayed scaling on a Flax NNX model (runs in seconds on a CPU)
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxlowfp import qat, qnnx, training

model = nnx.Sequential(nnx.Linear(64, 256, rngs=nnx.Rngs(0)), jax.nn.gelu, nnx.Linear(256, 64, rngs=nnx.Rngs(1)))
report = qnnx.quantize_model(model, [qnnx.Rule(path=r"layers/\d+", recipe=qat.hif8_w8a8())])  # max of 64 amaxes
loss_fn = lambda m, batch: (jnp.mean((m(batch["x"]) - batch["y"]) ** 2), {})                # -> (loss, aux)
tx = optax.adam(1e-3)
graphdef, state = training.init(model, tx)                     # params, amax histories, optimizer state, step
step = jax.jit(training.make_step(graphdef, tx, loss_fn, warmup=qat.Warmup(steps=0)))
x = jax.random.normal(jax.random.key(0), (32, 64))
for _ in range(3):
    state, metrics = step(state, {"x": x, "y": jnp.sin(x)})
print(report.quantized, float(metrics["loss"]), float(metrics["max_saturated_fraction"]))
