"""Template builds (E2B's `Template.build()`), OCI images as sandboxes, Dockerfiles.

spec.py        the build request (fromImage/fromTemplate, steps, startCmd/readyCmd) and
               the per-step cache key
store.py       SQLite under $AENV_HOME/builds.db: builds, their log entries, the step cache
files.py       uploaded COPY contexts ($AENV_HOME/build-files/<hash>) and signed upload URLs
stack.py       host-side reads of a layer stack (/etc/passwd) and user resolution
images.py      pulling images (registry settings, credentials) and booting sandboxes on a
               layer stack through a transient internal template (cold start)
steps.py       what one step does inside a build sandbox (RUN, COPY, WORKDIR, start/ready)
builder.py     build requests, records, status and logs; one background task per build
job.py         one build's base and steps: build sandboxes, the step cache, layer holds
finalize.py    the template a build ends in (cold, or a snapshot after startCmd/readyCmd)
tags.py        template tags: which build `name:tag` / `name:<build id>` / `name` creates
aliases.py     the image-alias table (`e2bdev/base` -> the local `base`, ...)
dockerfile.py  a Dockerfile parser that turns a Dockerfile into the same build request
base.py        the default template `base`: registering and checking it
base_rootfs.py its Debian rootfs (debootstrap recipe, machine-wide rootfs cache)
"""
