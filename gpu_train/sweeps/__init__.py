"""Hyperparameter sweeps whose trials are ordinary jobs (docs/sweeps.md): the sweep spec, Optuna's samplers and
pruners through ask-and-tell, the journal, the controller and its backends, the report. `python -m gpu_train.sweeps`
is the in-cluster controller that `gpu-train sweep submit` starts."""
