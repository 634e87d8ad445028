"""The ground floor: what every room uses and that imports nothing of the project.

- :mod:`~vla_rl.core.ranges`, :mod:`~vla_rl.core.schema`: the config schema (typed dataclasses, declared ranges,
  field docs, ``from_dict`` / ``to_dict``, ``--help-config``);
- :mod:`~vla_rl.core.errors`: the errors every floor raises and the command line reports in one line;
- :mod:`~vla_rl.core.shapes`: tensor shapes in signatures (jaxtyping where installed);
- :mod:`~vla_rl.core.keyed_random`: random numbers that are a function of a key (an episode's seed);
- :mod:`~vla_rl.core.outputs`: what a command may write over; :mod:`~vla_rl.core.progress`: progress bars;
- :mod:`~vla_rl.core.threads`: how many torch threads a job takes; :mod:`~vla_rl.core.paths`: the checkout and
  the simulators' setup folder.
"""
