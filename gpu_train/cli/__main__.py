"""python -m gpu_train.cli: the same as the `gpu-train` console script."""

from gpu_train.cli.main import main

raise SystemExit(main())
