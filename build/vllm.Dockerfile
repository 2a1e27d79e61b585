# vLLM backend: vLLM's release image with the kit installed (engine builder and launcher; the kit's vLLM plugin travels
# inside each engine as vllm/plugin). v0.32.0 is the release whose CPU build the kit's vLLM tier runs. Build from the
# repo root:
#   docker build -f build/vllm.Dockerfile -t specdec:0.1.0-vllm .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="specdec (vLLM)" \
      org.opencontainers.image.description="vLLM with the specdec kit: engine builder, launcher and draft plugin" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://example.invalid/specdec"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HOME=/tmp
WORKDIR /opt/specdec/src
COPY pyproject.toml README.md ./
COPY specdec_kit ./specdec_kit
COPY runtime ./runtime
COPY export ./export
COPY serving ./serving
COPY loadtest ./loadtest
COPY train ./train
COPY bench ./bench
# --no-deps: keep vLLM's own torch and CUDA stack; the kit's vLLM path needs nothing else
RUN pip install --no-deps . && \
    useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin specdec
USER 10001
WORKDIR /opt/specdec
EXPOSE 8000
ENTRYPOINT ["specdec-serve"]
