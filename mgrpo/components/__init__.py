"""The parts the GRPO loop assembles, one job each: the actor client (data-parallel sharding over the
Megatron ranks), the weight sync, the checkpointer, the observer (every run file), stop signals, and
the assembly that builds and takes them down in order."""
