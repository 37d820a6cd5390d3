"""The Megatron ranks' code: megatron-core stages, forward/loss steps, optimizer, checkpoints."""
