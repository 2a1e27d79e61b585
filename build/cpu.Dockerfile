# CPU image: the embedded runtime serving the demo engine (GRIFFIN on the demo zoo, ONNX Runtime).
# For CPU-only clusters and for installing the chart anywhere. Build from the repository root:
#   docker build -f build/cpu.Dockerfile -t specdec:0.1.0-cpu .
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# CPU wheel of PyTorch, pinned (a looser requirement would pull the CUDA wheels)
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY specdec_kit ./specdec_kit
COPY runtime ./runtime
COPY export ./export
COPY serving ./serving
COPY loadtest ./loadtest
COPY train ./train
COPY bench ./bench
COPY zoo ./zoo
# a non-editable install: the demo zoo is named by SPECDEC_ZOO (tests/test_install.py runs these commands)
ENV SPECDEC_ZOO=/src/zoo
RUN pip install . && \
    specdec-build-engine --draft griffin --output /opt/specdec/engines/griffin-onnxruntime

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="specdec (CPU)" \
      org.opencontainers.image.description="specdec embedded runtime with the demo GRIFFIN engine (ONNX Runtime, CPU)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://example.invalid/specdec"
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp \
    SPECDEC_ENGINE=/opt/specdec/engines/griffin-onnxruntime
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/specdec /opt/specdec
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin specdec
USER 10001
WORKDIR /opt/specdec
EXPOSE 8000
ENTRYPOINT ["specdec-serve"]
CMD ["--engine", "/opt/specdec/engines/griffin-onnxruntime", "--host", "0.0.0.0", "--port", "8000"]
