# SGLang backend: SGLang's release image with the kit and its GRIFFIN model plugin installed.
# v0.5.23 is the SGLang the kit's launch commands and refusals are checked against (its images ship CUDA 13: the
# nodes need a CUDA 13 driver, R580 or later). Nodes with a CUDA 12 driver need SGLang's last CUDA 12 image instead,
#   build/build.sh sglang --build-arg SGLANG_IMAGE=lmsysorg/sglang:v0.5.19-cu129
# whose argument code the kit has not been checked against: the engine's launcher says so at start-up.
# Build from the repo root:
#   docker build -f build/sglang.Dockerfile -t specdec:0.1.0-sglang .
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
FROM ${SGLANG_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="specdec (SGLang)" \
      org.opencontainers.image.description="SGLang with the specdec kit: engine builder, launcher and GRIFFIN plugin" \
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
# --no-deps: keep SGLang's own torch and CUDA stack; the kit's SGLang path needs nothing else
RUN pip install --no-deps . && \
    useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin specdec
USER 10001
WORKDIR /opt/specdec
EXPOSE 8000
ENTRYPOINT ["specdec-serve"]
