//! `statebroker`: an MQTT 5 / 3.1.1 broker with the Azure IoT Operations
//! state store inside.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use broker::config::{Mode, PersistenceSettings};
use broker::{Broker, Settings};
use clap::Parser;

/// An MQTT 5 and 3.1.1 broker (rumqttd's router) with the Azure IoT
/// Operations state store built in: key/value requests over MQTT with RESP3
/// payloads, HLC versions, fencing tokens, expiry, KEYNOTIFY and SCAN.
///
/// Without arguments it listens on 0.0.0.0:1883 with the embedded default
/// configuration (the repository's rumqttd.toml). Log level: RUST_LOG
/// (default "info,rumqttd=warn"), e.g. RUST_LOG=debug or RUST_LOG=broker=debug.
#[derive(Parser, Debug)]
#[command(version, about, long_about)]
struct Cli {
    /// Configuration file in rumqttd.toml format, layered over the defaults.
    /// Environment variables STATEBROKER__<SECTION>__<KEY> override it.
    #[arg(short, long, value_name = "FILE", env = "STATEBROKER_CONFIG")]
    config: Option<PathBuf>,

    /// Listen on this address instead of the configured listeners.
    #[arg(short, long, value_name = "ADDR")]
    listen: Option<SocketAddr>,

    /// Keep persisted keys, retained messages and persistent sessions in
    /// this directory (default: `statebroker-data` next to the config file,
    /// or in the working directory).
    #[arg(short, long, value_name = "DIR", conflicts_with = "in_memory")]
    data_dir: Option<PathBuf>,

    /// Keep everything in memory only (no data directory), whatever the
    /// configuration says.
    #[arg(long)]
    in_memory: bool,

    /// Serve /metrics, /healthz and /readyz on this address instead of the
    /// configured `[http] listen` (default 127.0.0.1:9883).
    #[arg(long, value_name = "ADDR", conflicts_with = "no_http")]
    http: Option<SocketAddr>,

    /// No HTTP endpoint (no metrics, no health checks).
    #[arg(long)]
    no_http: bool,

    /// Print the embedded default configuration and exit.
    #[arg(long)]
    print_default_config: bool,
}

/// Default log filter: info, without rumqttd's per-connection lines, with
/// the storage engine's journal recovery (it only logs when it repairs).
const DEFAULT_LOG: &str =
    "info,rumqttd=warn,fjall::journal::reader=debug,fjall::journal::batch_reader=debug";

fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.print_default_config {
        print!("{}", broker::config::DEFAULT_CONFIG);
        return ExitCode::SUCCESS;
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG)),
        )
        .init();
    let mut settings = match Settings::load(cli.config.as_deref(), cli.listen) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("statebroker: {e}");
            return ExitCode::from(2);
        }
    };
    if cli.in_memory {
        settings.persistence = None;
    }
    if cli.no_http {
        settings.http = None;
    } else if let Some(addr) = cli.http {
        settings.http = Some(addr);
    }
    if let Some(dir) = cli.data_dir {
        let mode = settings
            .persistence
            .as_ref()
            .map_or(Mode::Fsync, |p| p.mode);
        settings.persistence = Some(PersistenceSettings {
            data_dir: dir,
            mode,
        });
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("statebroker: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run(settings))
}

async fn run(settings: Settings) -> ExitCode {
    let running = match Broker::start(settings).await {
        Ok(running) => running,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("statebroker: {e}");
            return ExitCode::FAILURE;
        }
    };
    let signal = wait_for_signal().await;
    tracing::info!(signal, "stopping");
    running.shutdown(Duration::from_secs(5)).await;
    tracing::info!("stopped");
    ExitCode::SUCCESS
}

/// Waits for Ctrl-C or SIGTERM.
async fn wait_for_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(term) => term,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return "SIGINT";
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl-C"
    }
}
