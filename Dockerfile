# The agent-outbox image: one image, one console script. Every process of a deployment (relay,
# worker, beat, flower, metrics, `db upgrade`, `ops …`) is `outbox <command>`; see compose.yaml
# and docs/deploy.md.

# Build stage: the package as a wheel (setuptools is fetched into an isolated build env).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY outbox ./outbox
RUN python -m pip wheel --no-cache-dir --disable-pip-version-check --no-deps \
        --wheel-dir /wheels .

# Runtime stage: the wheel and its dependencies (no dev extras), run as an unprivileged user.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OUTBOX_HOME=/var/lib/outbox
RUN groupadd --system --gid 10001 outbox \
    && useradd --system --uid 10001 --gid outbox --home-dir /var/lib/outbox --no-create-home \
        --shell /usr/sbin/nologin outbox \
    && install -d -o outbox -g outbox -m 0750 /var/lib/outbox
COPY --from=build /wheels /tmp/wheels
RUN python -m pip install "$(ls /tmp/wheels/*.whl)[all]" && rm -rf /tmp/wheels

USER outbox
WORKDIR /var/lib/outbox
ENTRYPOINT ["outbox"]
CMD ["--help"]
