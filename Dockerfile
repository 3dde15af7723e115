# kvgate container image: the gateway (`kvgate serve`, the default command), emulated vLLM
# engines (`kvgate emulate ...`) and the load generator (`kvgate load ...`) from one image.
#
#   docker build -t kvgate .
#   docker run --rm -p 8000:8000 -e KVGATE_ENGINES='[{"url": "http://10.0.0.5:8000"}]' kvgate
#   docker run --rm -p 8000:8000 -v "$PWD/kvgate.yaml:/etc/kvgate/config.yaml:ro" kvgate
#   docker run --rm kvgate emulate --host 0.0.0.0 --port 8000 --model my-model
#
# Settings: the YAML file at /etc/kvgate/config.yaml (the image ships an empty one), then
# KVGATE_* environment variables, then flags; see docs/gateway.md and docs/deployment.md.

ARG PYTHON_VERSION=3.12

# --- build: the kvgate wheel, installed with its dependencies into a self-contained venv -----
# The epp extra (`kvgate epp`, Envoy's API from xds-protos) and the tracing extra (OpenTelemetry)
# are both in. xds-protos ships an old copy of opentelemetry-proto's modules over that package's
# files, so opentelemetry-proto is reinstalled after it and both imports are checked.
FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
 && python -m venv /opt/kvgate \
 && /opt/kvgate/bin/pip install "$(ls /wheels/kvgate-*.whl)[epp,tracing]" \
 && /opt/kvgate/bin/pip install --force-reinstall --no-deps \
        "opentelemetry-proto==$(/opt/kvgate/bin/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')" \
 && /opt/kvgate/bin/python -c "from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope" \
 && /opt/kvgate/bin/python -c "import envoy.service.ext_proc.v3.external_processor_pb2" \
 && /opt/kvgate/bin/kvgate --help > /dev/null

# --- runtime: the venv only, run as an unprivileged user -------------------------------------
FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="kvgate" \
      org.opencontainers.image.description="KV-cache-aware routing gateway for vLLM engines" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/kvgate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=build /opt/kvgate /opt/kvgate
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/kvgate \
        --shell /usr/sbin/nologin kvgate \
 && mkdir -p /etc/kvgate \
 && printf '%s\n' \
        '# kvgate settings. Mount your own file here, or leave this one empty and set' \
        '# KVGATE_* variables, e.g. KVGATE_ENGINES=[{"url": "http://vllm-0:8000"}]' \
        > /etc/kvgate/config.yaml
USER 10001:10001
WORKDIR /home/kvgate
EXPOSE 8000
# Liveness of whatever kvgate server runs in the container (gateway or emulator) on
# $KVGATE_PORT (default 8000); slim images have no curl, so Python asks.
HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('KVGATE_PORT', '8000') + '/health', timeout=4)"]
ENTRYPOINT ["kvgate"]
CMD ["serve", "--config", "/etc/kvgate/config.yaml", "--host", "0.0.0.0"]
