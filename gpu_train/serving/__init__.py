"""Serving registered models: the weighted route, the promotion loop, the registry's aliases, the cluster's serving
objects, `serve --local` (which starts trainer/model_server.py as its own process), and the load generator
(docs/serving.md)."""
