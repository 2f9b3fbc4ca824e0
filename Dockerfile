# inf2serve for Inferentia2: AWS's Neuron PyTorch inference container (DLC) of one Neuron SDK release, plus
# inf2serve and that release's Neuron wheels. NEURON_SDK is the one setting: it picks the base image and the
# wheel pins (deploy/neuron/sdk-<release>.txt). Compile artifacts with the same release; the server refuses
# an artifact whose compiler, runtime or library versions differ. See README, "Neuron stack".
# NEURON_BASE defaults to the py312 DLC of NEURON_SDK; a release whose DLC is named otherwise, or that has
# no pins here, stops at the first RUN with the fix (deploy/neuron/check-release.sh; run it beforehand to
# fail before any pull: `deploy/neuron/check-release.sh 2.28.0` prints the base image). 2.31.1 is withdrawn
# for Inf2 (its NxD Inference is refused at compile and load; its pins stay for Trn2 experiments) and is
# refused here.
#   docker build -t inf2serve:neuron .
#   docker run --device=/dev/neuron0 -p 8080:8080 -v /path/to/artifact:/opt/ml/model:ro inf2serve:neuron
ARG NEURON_SDK=2.28.0
ARG NEURON_BASE=public.ecr.aws/neuron/pytorch-inference-neuronx:2.9.0-neuronx-py312-sdk${NEURON_SDK}-ubuntu24.04
FROM ${NEURON_BASE}

ARG NEURON_SDK
ARG NEURON_BASE
LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true \
      org.opencontainers.image.title="inf2serve" \
      com.amazonaws.neuron.sdk-release="${NEURON_SDK}"
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    INF2SERVE_DEVICE=neuron

WORKDIR /opt/inf2serve
COPY deploy/neuron ./deploy/neuron
RUN deploy/neuron/check-release.sh "${NEURON_SDK}" "${NEURON_BASE}"
COPY pyproject.toml README.md ./
COPY app ./app
COPY compile ./compile
COPY deploy ./deploy
# The DLC already holds these wheels at the same versions; pinning them again makes a mismatch fail here.
RUN pip install --no-cache-dir --extra-index-url https://pip.repos.neuron.amazonaws.com \
        -r "deploy/neuron/sdk-${NEURON_SDK}.txt" /opt/inf2serve

EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=1800s --retries=3 \
    CMD ["/opt/inf2serve/deploy/docker/entrypoint.sh", "healthcheck"]
# Replaces the DLC's entrypoint, which would start TorchServe on `serve`.
ENTRYPOINT ["/opt/inf2serve/deploy/docker/entrypoint.sh"]
CMD ["serve"]
