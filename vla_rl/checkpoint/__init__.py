"""Checkpoints on disk: folders written atomically (:mod:`.folders`), policy folders (:mod:`.policy`), the training
checkpoints of a run (:mod:`.training`) and LeRobot π0 / π0.5 checkpoints read as our policy (:mod:`.lerobot_pi`)."""
