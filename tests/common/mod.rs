//! Shared helpers of the end-to-end tests: a broker on a free loopback port,
//! official SDK clients, and a small raw MQTT client on rumqttd's codecs for
//! what the SDK never sends.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use azure_iot_operations_mqtt::aio::connection_settings::MqttConnectionSettingsBuilder;
use azure_iot_operations_mqtt::session::{Session, SessionExitHandle, SessionOptionsBuilder};
use azure_iot_operations_protocol::application::ApplicationContextBuilder;
use azure_iot_operations_services::state_store;
use broker::{Broker, RunningBroker, Settings};

pub mod raw;

pub const TIMEOUT: Duration = Duration::from_secs(10);

/// A broker on 127.0.0.1 with a free port, default configuration.
pub async fn start_broker() -> RunningBroker {
    start_broker_with(|_| {}).await
}

/// A broker on 127.0.0.1 with a free port; `tweak` adjusts the settings.
pub async fn start_broker_with(tweak: impl FnOnce(&mut Settings)) -> RunningBroker {
    init_logging();
    let mut settings = Settings::listening_on("127.0.0.1:0".parse().unwrap());
    tweak(&mut settings);
    Broker::start(settings).await.expect("broker starts")
}

fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// An official SDK state store client, connected.
pub struct SdkClient {
    pub client: Arc<state_store::Client>,
    pub exit: SessionExitHandle,
    pub client_id: String,
}

impl SdkClient {
    pub async fn connect(addr: SocketAddr, client_id: &str) -> SdkClient {
        let connection_settings = MqttConnectionSettingsBuilder::default()
            .client_id(client_id)
            .hostname(addr.ip().to_string())
            .tcp_port(addr.port())
            .use_tls(false)
            .keep_alive(Duration::from_secs(10))
            .clean_start(true)
            .build()
            .unwrap();
        let session = Session::new(
            SessionOptionsBuilder::default()
                .connection_settings(connection_settings)
                .build()
                .unwrap(),
        )
        .unwrap();
        let app = ApplicationContextBuilder::default().build().unwrap();
        let client = state_store::Client::new(
            app,
            session.create_managed_client(),
            session.create_session_monitor(),
            state_store::ClientOptionsBuilder::default()
                .build()
                .unwrap(),
        )
        .unwrap();
        let monitor = session.create_session_monitor();
        let exit = session.create_exit_handle();
        tokio::spawn(session.run());
        tokio::time::timeout(TIMEOUT, monitor.connected())
            .await
            .expect("SDK session connects");
        SdkClient {
            client: Arc::new(client),
            exit,
            client_id: client_id.to_owned(),
        }
    }

    pub async fn close(self) {
        let _ = self.client.shutdown().await;
        let _ = self.exit.try_exit();
    }
}

/// A `statebroker` process started by a test.
pub struct BrokerProcess {
    pub child: tokio::process::Child,
    pub addr: SocketAddr,
    /// Its log lines so far.
    pub log: Arc<parking_lot::Mutex<Vec<String>>>,
}

/// Starts the `statebroker` binary on a free loopback port with its data in
/// `data_dir` (its address read from its log).
pub async fn spawn_broker(data_dir: &std::path::Path, extra: &[&str]) -> BrokerProcess {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_statebroker"))
        .args(["--listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(data_dir)
        .args(extra)
        .env_remove("RUST_LOG")
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let log = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let addr = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            log.lock().push(line.clone());
            if line.contains("listening")
                && let Some(rest) = line.split("addr=").nth(1)
            {
                return rest.split_whitespace().next().unwrap().parse().unwrap();
            }
        }
        panic!("the broker exited before listening: {:?}", log.lock());
    })
    .await
    .expect("the broker logs its address");
    let sink = Arc::clone(&log);
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            sink.lock().push(line);
        }
    });
    BrokerProcess { child, addr, log }
}

/// Waits for `cond` to hold, polling.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
