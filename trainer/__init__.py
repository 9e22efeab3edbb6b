"""gpt-train's elastic PyTorch trainer: `python -m trainer --help` (or under torchrun, see docs/trainer.md)."""
