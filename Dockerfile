# statebroker: build in a Rust image, run from a slim Debian one.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin statebroker

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 statebroker
COPY --from=build /src/target/release/statebroker /usr/local/bin/statebroker
COPY rumqttd.toml /etc/statebroker/rumqttd.toml
USER statebroker
EXPOSE 1883
ENTRYPOINT ["statebroker"]
CMD ["--config", "/etc/statebroker/rumqttd.toml"]
