"""Power and memory of each GPU model the instance catalogs name: the board's maximum power (TDP) in watts and its
memory in GB.

Usage: `from gpu_train.spec.catalog.gpus import tdp_watts, memory_gb; tdp_watts("H100")` -> 700, None when no figure
is published (AWS Trainium); `memory_gb("L4")` -> 24.

The carbon estimate (gpu_train/carbon/estimate.py) multiplies the job's GPUs by this figure: an upper bound
of what a GPU draws under a training load. Figures from the vendors' data sheets for the parts the clouds use:
- H100 SXM5: up to 700 W (https://www.nvidia.com/en-us/data-center/h100/, "Max thermal design power (TDP)");
- H200 SXM: up to 700 W (https://www.nvidia.com/en-us/data-center/h200/);
- A100 SXM4 40 GB and 80 GB: 400 W (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
  nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf);
- B200 (HGX B200): 1,000 W per GPU (https://www.nvidia.com/en-us/data-center/hgx/);
- L40S: 350 W (https://www.nvidia.com/en-us/data-center/l40s/);
- L4: 72 W (https://www.nvidia.com/en-us/data-center/l4/);
- A10G (AWS g5): 300 W (https://d1.awsstatic.com/product-marketing/ec2/NVIDIA_AWS_A10G_DataSheet_FINAL_02_17_2022.pdf).
AWS publishes no power figure for its Trainium chips, so jobs on trn1 get no energy estimate.

Memory (what the plan's per-GPU memory estimate, gpu_train/sizing/memory.py, is checked against) from the same data
sheets: H100 SXM5 80 GB, H200 141 GB, A100 40 or 80 GB, B200 180 GB (HGX B200: 1,440 GB over 8 GPUs), L40S 48 GB,
L4 24 GB, A10G 24 GB; a Trainium chip has 32 GB (trn1.32xlarge: 512 GB over 16 chips,
https://aws.amazon.com/ec2/instance-types/trn1/).
"""

from __future__ import annotations

GPU_TDP_W: dict[str, int] = {
    "H100": 700,
    "H200": 700,
    "A100-40GB": 400,
    "A100-80GB": 400,
    "B200": 1000,
    "L40S": 350,
    "L4": 72,
    "A10G": 300,
}


GPU_MEMORY_GB: dict[str, int] = {
    "H100": 80,
    "H200": 141,
    "A100-40GB": 40,
    "A100-80GB": 80,
    "B200": 180,
    "L40S": 48,
    "L4": 24,
    "A10G": 24,
    "Trainium": 32,
}


def memory_gb(gpu_type: str) -> int | None:
    """The GPU model's memory in GB (10^9 bytes, as the data sheets count); None for a model not in the table."""
    return GPU_MEMORY_GB.get(gpu_type)


def tdp_watts(gpu_type: str) -> int | None:
    """The GPU model's maximum power in watts; None for a model without a published figure."""
    return GPU_TDP_W.get(gpu_type)
