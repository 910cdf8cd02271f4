"""Compiled kernels for XLA:CPU, called from inside jitted programs as XLA FFI custom calls
(the CPU counterpart of ``pallas_kernels/``: each kernel in its own folder beside its jnp
reference; needs only jax and numpy at run time, a C++ compiler at install)."""
