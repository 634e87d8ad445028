"""An RL run: its config, the trainer that builds it and runs the iterations, resuming, and what a run checks and
logs around the RL algorithm of :mod:`vla_rl.rl` (metrics, preflight warnings, the memory plan)."""
