"""The shipped demo (``petr-stability demo``): a PETR-shaped detector from MMCV's bricks (:mod:`.model`), its
MMEngine pieces with a CPU stand-in for ``AmpOptimWrapper`` (:mod:`.amp`), and the runs (:mod:`.run`). Importing it
registers nothing: the demo registers what it builds when it runs."""
