"""RL training: tasks, verifiable rewards, and GRPO/DAPO on TRL with the embedded engine."""
