"""Pure functions from a job spec and a platform contract to what runs: the JobSet, the launcher, the fit."""
