"""The seam between the model and the kernels: a pure-jnp reference per op, dispatched by `impl`.

'xla' is the reference (pure jnp, runs everywhere); 'pallas' routes to `pallas_kernels` (Triton lowering on GPU,
interpret mode on the CPU); 'cudnn' (attention only) is NVIDIA's fused attention through jax.nn.
"""
