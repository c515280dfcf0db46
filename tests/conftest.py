"""Settings shared by every test suite."""

from __future__ import annotations

from hypothesis import settings

# Property tests check what is generated, not how fast: on a loaded 2-core machine one
# example can take 10x its usual time, and a per-example deadline then fails a correct test.
settings.register_profile("aenv", deadline=None)
settings.load_profile("aenv")

