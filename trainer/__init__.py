"""Elastic PyTorch trainer: ``python -m trainer --help`` (launched by torchrun)."""
