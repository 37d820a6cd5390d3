"""mgrpo: GRPO-family RL for Qwen3 on Megatron-Core, SGLang and Ray."""
