"""The trainer ranks' code: megatron-core stages, forward/loss steps, optimizer, checkpoints."""

from mgrpo.training.cpu_compat import lean_megatron_import

lean_megatron_import()  # before any module of this package imports megatron-core (CPU only)
