"""Settings shared by every test directory (core and backends)."""

import os

from hypothesis import settings

# CI replays the same examples on every run, so a red build is reproducible; elsewhere the
# property tests keep exploring new examples.
# No deadline there: CI machines are shared, and the simulator's runs share them with the suite.
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
