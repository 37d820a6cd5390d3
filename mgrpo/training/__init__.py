"""The trainer ranks' code: megatron-core stages, forward/loss steps, optimizer, checkpoints."""

from mgrpo.training.cpu_compat import eager_megatron_fusers

eager_megatron_fusers()  # before any module of this package imports megatron-core (CPU only)
