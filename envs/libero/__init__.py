"""LIBERO in one package: the robosuite adapter (:mod:`.robosuite_env`) and the batched MuJoCo Warp backend
(:mod:`.warp_env`) behind the one env interface, and what they share: the scene read from robosuite's model
(:mod:`.scene`), BDDL goal predicates (:mod:`.predicates`), the OSC controller (:mod:`.osc`), physics substeps with
one forward pass (:mod:`.substeps`), the scripted expert (:mod:`.expert`), shaped rewards (:mod:`.reward`), the
env settings a policy folder needs (:mod:`.settings`) and the measurements of Warp against robosuite
(:mod:`.fidelity`). Its demonstration recorder writes datasets, so it lives with the other collectors
(:mod:`vla_rl.data.libero_demos`). Nothing here imports a simulator until an env is made.
"""
