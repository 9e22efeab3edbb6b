"""Hyperparameter sweeps whose trials are ordinary jobs (docs/sweeps.md): Optuna's samplers and pruners
through ask-and-tell, the journal, the controller and its backends, the report; the sweep spec they run is
gpu_train/spec/sweep.py. `python -m gpu_train.sweeps` is the in-cluster controller that `gpu-train sweep submit`
starts."""
