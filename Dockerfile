# ragspec REST service: `ragspec serve` (OpenAI-compatible completions and chat,
# /v1/summarize, /metrics, /health) on CPU.
#
#   docker compose up            (see docker-compose.yml: fetches the model into the cache
#                                 volume once, then serves on port 8000)
#
# The model is not baked into the image: it lives in the RAGSPEC_CACHE volume (/data/cache),
# filled by `ragspec model fetch`; datastores are mounted under /data/datastores and named
# with --datastore NAME=/data/datastores/DIR (requests use the NAME, never a path).
FROM python:3.11-slim

# torch first and pinned; pass TORCH_PIP_ARGS (e.g. an --index-url of CPU wheels) to choose
# the build, as the Makefile does on the development machines
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_PIP_ARGS=""
# optional extras of ragspec, e.g. "[ray]" for Ray Serve (docker-compose.ray.yml)
ARG RAGSPEC_EXTRAS=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAGSPEC_CACHE=/data/cache \
    TRANSFORMERS_VERBOSITY=error \
    HF_HUB_OFFLINE=1

WORKDIR /app
# a C++ compiler and ninja build ragspec's CPU decoding kernel (ragspec/backend/cpu/kernels.py; without
# them torch's slower kernels are used)
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ ninja-build \
    && rm -rf /var/lib/apt/lists/*
RUN pip install ${TORCH_PIP_ARGS} "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY ragspec ./ragspec
RUN pip install ".${RAGSPEC_EXTRAS}" \
    && useradd --create-home --uid 10001 ragspec \
    && mkdir -p /data/cache /data/datastores \
    && chown -R ragspec /data

USER ragspec
# compile ragspec's CPU kernels into the image's cache (/data/cache/kernels, about a minute on
# a fast host, a few on 2 cores) instead of at the first start, and check the fast path:
# `ragspec doctor` prints what runs and, with --require-kernels, fails the build unless the
# compiled kernels load (it names the cause: no AVX2 on the build host, sources missing, no
# compiler, a compile error). CHECK_KERNELS=0 builds anyway (the container then compiles
# them at its first start, if it can, else runs torch's slower kernels with a warning).
ARG CHECK_KERNELS=1
RUN ragspec doctor --json $([ "$CHECK_KERNELS" = 1 ] && echo --require-kernels)
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=4)"]

# bind all interfaces inside the container; the host decides what to publish
CMD ["ragspec", "serve", "--host", "0.0.0.0", "--port", "8000"]
