"""What a trainer configuration needs from the hardware, torch-free, for plan and submit time and for the trainer:
the parallel layout at a world size (layout.py), the memory a GPU needs under it (memory.py), a job's fit to its
pool's GPUs (job.py), and the FLOPs per token and the GPUs' peaks (flops.py)."""
