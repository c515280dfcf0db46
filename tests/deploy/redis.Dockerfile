# Redis for the compose test, from the same local Debian root as the aenv images (no Docker
# Hub here): Debian's redis-server, with redis-cli for the compose file's healthcheck.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
CMD ["redis-server"]
