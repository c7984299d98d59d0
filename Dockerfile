# The ojs-bridge binary in a slim image (used by docker-compose.yml).
#
#   docker build -t ojs-bridge .                     # where a registry is reachable
#
# The runtime stage comes first and copies nothing from the build context,
# so it can be built alone (`--target runtime`) on any Debian bookworm base
# and given a binary built elsewhere: scripts/containers.sh does that on a
# machine with no registry (docs/testing.md, "Containers"). The classic
# builder builds every stage up to its target in order, which is why the
# runtime is not placed after the compiler's stage.
ARG BASE=debian:bookworm-slim
ARG RUST=rust:1-bookworm

FROM ${BASE} AS runtime
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# An unprivileged user owns the data directory; the daemon never runs as
# root, and needs nothing else writable (it runs with a read-only root
# file system and this directory mounted).
RUN useradd --system --uid 10001 --home-dir /var/lib/ojs-bridge --shell /usr/sbin/nologin ojs-bridge \
    && mkdir -p /var/lib/ojs-bridge && chown ojs-bridge /var/lib/ojs-bridge
USER 10001
WORKDIR /var/lib/ojs-bridge
# The embedded default listens on loopback; in a container, listen on all
# interfaces of the container's own network and let the port mapping decide
# who can reach it (set http.token_file when that is more than a scraper).
ENV OJS_BRIDGE_HTTP_LISTEN=0.0.0.0:9464
EXPOSE 9464
ENTRYPOINT ["ojs-bridge"]
CMD ["run"]

FROM ${RUST} AS build
# librdkafka is built from source by rdkafka-sys.
RUN apt-get update && apt-get install -y --no-install-recommends cmake && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p ojs-bridge

FROM runtime
COPY --from=build /src/target/release/ojs-bridge /usr/local/bin/ojs-bridge
COPY examples /etc/ojs-bridge/examples
