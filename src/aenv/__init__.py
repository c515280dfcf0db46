"""aenv: agent environments at scale, E2B-compatible, on gVisor."""

from importlib.metadata import PackageNotFoundError, version

# The distribution on PyPI (the import package and the command are `aenv`).
DISTRIBUTION = "aenv-sandbox"
try:
    # Written at install time from the git tag (setuptools-scm): an editable install keeps
    # the version it was installed with until it is installed again.
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0.0.0+unknown"
# The envd protocol level we implement; SDKs gate features on it (see e2b-protocol.md §3.5).
ENVD_VERSION = "0.6.4"
