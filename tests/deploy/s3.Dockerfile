# The S3 server for the compose test: moto's server from PyPI in a venv, on port 5000 as
# the compose file expects of motoserver/moto.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=secret,id=ca,required=false \
    if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && python3 -m venv /opt/moto \
    && /opt/moto/bin/pip install --no-cache-dir --disable-pip-version-check 'moto[server]>=5'
EXPOSE 5000
ENTRYPOINT ["/opt/moto/bin/moto_server", "-H", "0.0.0.0", "-p", "5000"]
