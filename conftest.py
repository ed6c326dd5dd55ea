"""pytest's settings for the whole checkout (``make test``, ``pytest``, ``pytest notebooks/``).

nbval runs the notebooks in their short mode, ``SMOKE_TEST=1``: the same cells and checks on
less data. ``SMOKE_TEST=0 make test`` runs them in full mode, as ``make notebooks`` runs them
for the committed outputs.
"""

import os

os.environ.setdefault("SMOKE_TEST", "1")
