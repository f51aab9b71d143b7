"""The RL loop (rl_trainer), its driver-side steps, entry points, metrics tracking and checkpoints."""
