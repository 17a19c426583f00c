"""qerl: reproduce and benchmark QeRL (NVFP4 weights + LoRA reinforcement learning)."""

__version__ = "0.1.0"
