"""aenv: agent environments at scale, E2B-compatible, on gVisor."""

__version__ = "0.1.0"
# The envd protocol level we implement; SDKs gate features on it (see e2b-protocol.md §3.5).
ENVD_VERSION = "0.6.4"
