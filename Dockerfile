# One image for every Retina process: retina-trans, retina-server, retina-cdc,
# retina-catalog, retina-cluster. Choose the process with the command, e.g.
#   docker run retina retina-trans --config /etc/retina/retina.toml
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends etcd-client postgresql-client \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/retina
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY retina_common ./retina_common
COPY trans_gate ./trans_gate
COPY retina_server ./retina_server
COPY cdc_client ./cdc_client
COPY spark_jobs ./spark_jobs
# retina-cluster (a dev tool, not runtime) is in devtools; the image keeps it for local use.
COPY devtools ./devtools
RUN pip install --no-cache-dir "grpcio-tools>=1.60" \
 && python -m retina_common.codegen --force \
 && pip install --no-cache-dir . \
 && useradd --system --home /var/lib/retina --create-home retina

USER retina
ENV RETINA_CONFIG=/etc/retina/retina.toml
EXPOSE 18888 18890 9464 9465
CMD ["retina-trans"]
