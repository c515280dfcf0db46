"""envd: the agent that runs inside every sandbox.

It serves the E2B envd data plane (Connect-RPC ``process.Process`` and
``filesystem.Filesystem``, ``/files``, ``/health``, ``/init``, ``/envs``,
``/metrics``) on TCP port 49983.

Constraints (see ``__main__``): standard library only, relative imports only
(the package is copied into the runtime bundle as ``aenv_envd``), and a small
import footprint because it is on the sandbox create path.
"""
