"""Serving registered models: the model server for this machine, the weighted route, the promotion loop, the
registry's aliases, the cluster's serving objects, and the load generator (docs/serving.md)."""
