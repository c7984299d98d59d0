# The ojs-bridge binary in a slim image (used by docker-compose.yml).
FROM rust:1-bookworm AS build
# librdkafka is built from source by rdkafka-sys.
RUN apt-get update && apt-get install -y --no-install-recommends cmake && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p ojs-bridge

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/ojs-bridge /usr/local/bin/ojs-bridge
COPY examples /etc/ojs-bridge/examples
# An unprivileged user owns the data directory; the daemon never runs as root.
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
