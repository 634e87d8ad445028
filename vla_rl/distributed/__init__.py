"""Scale-out on Ray (``runtime: ray``): env actors, data-parallel learner actors, placement. Imports Ray only
when a Ray runtime is built."""
