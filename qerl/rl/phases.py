"""Where an optimizer step's time goes, in the order it is spent: the trainer logs each as
``time/PHASE_s``, `qerl bench step` records them, and `qerl report` stacks them."""

PHASES = ("rollout", "score", "train", "optimizer")
