"""Checkpoints on disk: folders written atomically (:mod:`.folders`), policy folders (:mod:`.policy`), the training
checkpoints of a run (:mod:`.training`) and LeRobot policy folders (π0 / π0.5, SmolVLA) read as our policy
(:mod:`.lerobot`)."""
