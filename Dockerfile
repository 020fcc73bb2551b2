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
# The data directory belongs to the unprivileged user the broker runs as.
RUN useradd --system --uid 10001 --home-dir /var/lib/statebroker statebroker \
 && mkdir -p /var/lib/statebroker \
 && chown statebroker:statebroker /var/lib/statebroker
COPY --from=build /statebroker /usr/local/bin/statebroker
COPY rumqttd.toml /etc/statebroker/rumqttd.toml
USER statebroker
WORKDIR /var/lib/statebroker
# Persisted keys, retained messages and persistent sessions.
VOLUME /var/lib/statebroker
# 1883: MQTT. 9883: /metrics, /healthz, /readyz.
EXPOSE 1883 9883
# Ready once persisted state is restored and the listeners are up. bash's
# /dev/tcp: the slim image has no curl, and needs none.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9883 && printf 'GET /readyz HTTP/1.0\\r\\n\\r\\n' >&3 && grep -q '^ready' <&3"]
ENTRYPOINT ["statebroker"]
# Inside a container the listeners must face the container's network: the
# broker's own defaults keep the HTTP endpoint on loopback. Anonymous clients
# are refused on 0.0.0.0: mount a password file and set
# STATEBROKER__BROKER__PASSWORD_FILE, or append --allow-anonymous.
CMD ["--config", "/etc/statebroker/rumqttd.toml", "--data-dir", "/var/lib/statebroker", \
     "--listen", "0.0.0.0:1883", "--http", "0.0.0.0:9883"]
