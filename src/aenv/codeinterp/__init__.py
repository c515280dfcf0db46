"""The code interpreter: the server on port 49999 of template `code-interpreter-v1`.

It speaks the protocol of the `e2b-code-interpreter` SDK (``POST /execute`` streaming NDJSON,
``/contexts``, ``/health``) and runs code in contexts: IPython kernels (Debian's
python3-ipykernel, driven with python3-jupyter-client) and persistent bash processes.

Runs inside the sandbox on the image's own Debian python3, so: standard library plus
jupyter_client only, relative imports only (the template copies this package and
``aenv/envd/httpserver.py`` into the image, see ``aenv/builds/code_interpreter.py``), and
the pure parts (``events``) import nothing beyond the standard library so the host's unit
tests can run them.
"""
