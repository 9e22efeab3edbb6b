"""What a trainer configuration needs from the hardware, torch-free, for plan and submit time and for the trainer:
its FLOPs per token and the GPUs' peaks (flops.py)."""
