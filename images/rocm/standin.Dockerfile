# CI stand-in for AMD's rocm/pytorch image: the local Debian base (`make base-local`) with torch
# installed the way rocm/pytorch ships it, in a venv at /opt/venv that is first on PATH. The CPU
# torch wheel stands in for AMD's ROCm build. No registry, no index: the context holds the wheels.
# No default: the local base has no registry digest to pin, so the build names it (build_standin_base).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY lock.txt /build/lock.txt
COPY wheels/ /build/wheels/
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/python -m pip install --no-index --no-deps --require-hashes --no-cache-dir \
      --disable-pip-version-check --find-links /build/wheels -r /build/lock.txt \
 && rm -rf /build
ENV PATH=/opt/venv/bin:${PATH}
