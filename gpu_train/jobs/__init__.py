"""Pure functions from a job spec and a platform contract to what runs: the JobSet, the launch (torchrun's
arguments and environment), the fit."""
