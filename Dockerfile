# syntax=docker/dockerfile:1
# statebroker: build in a Rust image, run from a slim Debian one.
#   docker build -t statebroker .
#   docker run -p 1883:1883 -p 9883:9883 -v statebroker-data:/var/lib/statebroker statebroker
FROM rust:1.95-bookworm AS build
# etcd's client (clustering, `--features cluster`) is built with protoc.
RUN apt-get update && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The registry and the target directory are cached between builds
# (BuildKit cache mounts): a source change rebuilds statebroker, not its
# dependencies. No debug info and stripped symbols: the binary shrinks from
# ~60 MB (the repository's release profile keeps line tables for perf) to
# the size quoted in the README.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols \
    cargo build --release --locked --bin statebroker --features cluster \
 && cp target/release/statebroker /statebroker

FROM debian:bookworm-slim
# The data directory belongs to the unprivileged user the broker runs as
# (uid 10001): a bind-mounted directory must be writable by it (chown -R
# 10001 DIR on the host), or the container run as the directory's owner
# (docker run --user, compose's `user:`); the broker's error says so.
RUN useradd --system --uid 10001 --home-dir /var/lib/statebroker statebroker \
 && mkdir -p /var/lib/statebroker \
 && chown statebroker:statebroker /var/lib/statebroker
COPY --from=build /statebroker /usr/local/bin/statebroker
COPY rumqttd.toml /etc/statebroker/rumqttd.toml
USER statebroker
WORKDIR /var/lib/statebroker
# Persisted keys, retained messages and persistent sessions.
VOLUME /var/lib/statebroker
# 1883: MQTT. 9883: /metrics, /healthz, /readyz, the web view (on this
# non-loopback address it asks for a user of the password file, or with
# STATEBROKER__HTTP__ALLOW_ANONYMOUS=true shows its reads to anyone).
EXPOSE 1883 9883
# Ready once persisted state is restored and the listeners are up. The
# broker writes to STATEBROKER_HEALTH_FILE where to ask (its HTTP endpoint's
# /readyz on whatever port it was given, or with --no-http its MQTT
# listener) and `statebroker healthcheck` asks there: no curl needed.
ENV STATEBROKER_HEALTH_FILE=/tmp/statebroker.health
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["statebroker", "healthcheck"]
ENTRYPOINT ["statebroker"]
# Inside a container the listeners must face the container's network: the
# broker's own defaults keep the HTTP endpoint on loopback. Anonymous clients
# are refused on 0.0.0.0: mount a password file and set
# STATEBROKER__BROKER__PASSWORD_FILE, or append --allow-anonymous.
CMD ["--config", "/etc/statebroker/rumqttd.toml", "--data-dir", "/var/lib/statebroker", \
     "--listen", "0.0.0.0:1883", "--http", "0.0.0.0:9883"]
