# TensorRT-LLM backend: NVIDIA's release image with the kit (engine builder, launcher, the drafter package for
# EAGLE-1/2, HASS and GRIFFIN). A 1.3 release: its PyTorch backend is the one the kit's exports target (the
# TensorRT engine backend and trtllm-build are gone after 1.2).
# Build from the repository root:
#   docker build -f build/tensorrt-llm.Dockerfile -t specdec:0.1.0-tensorrt-llm .
ARG TRTLLM_IMAGE=nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc24
FROM ${TRTLLM_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="specdec (TensorRT-LLM)" \
      org.opencontainers.image.description="TensorRT-LLM with the specdec kit: engine builder, launcher and drafter package" \
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
# --no-deps: keep TensorRT-LLM's own torch, transformers and CUDA stack
RUN pip install --no-deps . && \
    useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin specdec
USER 10001
WORKDIR /opt/specdec
EXPOSE 8000
ENTRYPOINT ["specdec-serve"]
