"""Settings shared by every test suite.

The CLI reads stored credentials from `$XDG_CONFIG_HOME/aenv/credentials` before the node's
own defaults: the suite gets a config directory of its own, so a developer's (or a
machine's) `aenv auth` never points a test's CLI at another server."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

from hypothesis import settings

os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="aenv-test-config-")
atexit.register(functools.partial(shutil.rmtree, os.environ["XDG_CONFIG_HOME"], True))

# Property tests check what is generated, not how fast: on a loaded 2-core machine one
# example can take 10x its usual time, and a per-example deadline then fails a correct test.
settings.register_profile("aenv", deadline=None)
settings.load_profile("aenv")
