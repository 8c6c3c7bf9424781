# One image for every Retina process: retina-trans, retina-server, retina-cdc,
# retina-catalog, retina-query, retina-admin tools. Choose the process with the command, e.g.
#   docker run retina retina-trans --config /etc/retina/retina.toml
#
# BASE_IMAGE: the pinned official Python image by default. The registry-free local
# build (deploy/docker-compose.local.yml, `make compose-base`) passes
# retina-base:bookworm, a debootstrapped Debian bookworm, whose python3 is 3.11 too.
ARG BASE_IMAGE=python:3.11.10-slim-bookworm
FROM ${BASE_IMAGE}

# PIP_CERT: pip trusts the system CA store (with any CA the base image added) rather
# than its own bundled copy.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
# python3-venv only where the base has no Python of its own (the Debian base).
RUN apt-get update \
 && apt-get install -y --no-install-recommends etcd-client postgresql-client \
        $(command -v python3 >/dev/null || echo python3 python3-venv) \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /opt/retina
# Dependencies and build requirements first, from pyproject.toml alone, at the versions
# constraints.txt pins (the ones the tests ran with): a source change then rebuilds only
# the layers below (seconds, no downloads).
COPY pyproject.toml constraints.txt ./
RUN python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
print('\n'.join(p['project']['dependencies'] + p['build-system']['requires']))" \
        > /tmp/requirements.txt \
 && pip install --no-cache-dir -c constraints.txt --upgrade pip \
 && pip install --no-cache-dir -c constraints.txt -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
# setup.py generates the gRPC modules from proto/ while the package is built.
COPY README.md setup.py MANIFEST.in LICENSE ./
COPY proto ./proto
COPY retina_common ./retina_common
COPY trans_gate ./trans_gate
COPY retina_server ./retina_server
COPY cdc_client ./cdc_client
COPY spark_jobs ./spark_jobs
# retina-cluster (a dev tool, not runtime) is in devtools; the image keeps it for local use.
COPY devtools ./devtools
# No Spark: the compose services do not run Spark jobs (install ".[spark]" in an image
# that does). Named volumes mounted on the two directories start out owned by retina,
# as in the image.
# grpcio-tools was needed only to build (the gRPC modules are generated now).
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
 && pip uninstall -y -q grpcio-tools \
 && useradd --system --home /var/lib/retina --create-home retina \
 && mkdir -p /var/lib/retina/state /var/lib/retina/data \
 && chown -R retina:retina /var/lib/retina
COPY deploy/images/healthcheck.py /usr/local/bin/retina-healthcheck
COPY deploy/images/cdc-entrypoint.sh /usr/local/bin/retina-cdc-container
RUN sed -i '1i #!/opt/venv/bin/python' /usr/local/bin/retina-healthcheck \
 && chmod 755 /usr/local/bin/retina-healthcheck /usr/local/bin/retina-cdc-container

USER retina
ENV RETINA_CONFIG=/etc/retina/retina.toml
EXPOSE 18888 18890 9464 9465 9466
CMD ["retina-trans"]
