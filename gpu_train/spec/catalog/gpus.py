"""Power of each GPU model the instance catalogs name: the board's maximum power (TDP) in watts.

Usage: `from gpu_train.spec.catalog.gpus import tdp_watts; tdp_watts("H100")` -> 700, None when no figure is
published (AWS Trainium).

The carbon estimate (gpu_train/spec/carbon/estimate.py) multiplies the job's GPUs by this figure: an upper bound
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


def tdp_watts(gpu_type: str) -> int | None:
    """The GPU model's maximum power in watts; None for a model without a published figure."""
    return GPU_TDP_W.get(gpu_type)
