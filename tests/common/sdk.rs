//! An in-process broker on a free loopback port and official SDK clients:
//! shared by the end-to-end tests and `examples/sdk_latency.rs`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use azure_iot_operations_mqtt::aio::connection_settings::MqttConnectionSettingsBuilder;
use azure_iot_operations_mqtt::session::{Session, SessionExitHandle, SessionOptionsBuilder};
use azure_iot_operations_protocol::application::ApplicationContextBuilder;
use azure_iot_operations_services::state_store;
use broker::{Broker, RunningBroker, Settings};

pub const TIMEOUT: Duration = Duration::from_secs(10);

/// The timeout the tests give each SDK request.
pub const T: Duration = Duration::from_secs(5);

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
        SdkClient::connect_with(connection_settings, client_id).await
    }

    /// Over TLS (server certificate checked against `ca_file`), with a
    /// username and the password in `password_file`.
    pub async fn connect_tls(
        addr: SocketAddr,
        client_id: &str,
        ca_file: &std::path::Path,
        username: &str,
        password_file: &std::path::Path,
    ) -> SdkClient {
        let connection_settings = MqttConnectionSettingsBuilder::default()
            .client_id(client_id)
            .hostname("localhost")
            .tcp_port(addr.port())
            .use_tls(true)
            .ca_file(Some(ca_file.display().to_string()))
            .username(Some(username.to_owned()))
            .password_file(Some(password_file.display().to_string()))
            .keep_alive(Duration::from_secs(10))
            .clean_start(true)
            .build()
            .unwrap();
        SdkClient::connect_with(connection_settings, client_id).await
    }

    async fn connect_with(
        connection_settings: azure_iot_operations_mqtt::aio::connection_settings::MqttConnectionSettings,
        client_id: &str,
    ) -> SdkClient {
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

    /// A plain SET (no condition, no fencing token, no expiry); panics on error.
    pub async fn set(&self, key: &[u8], value: &[u8]) -> state_store::Response<bool> {
        self.client
            .set(
                key.to_vec(),
                value.to_vec(),
                T,
                None,
                state_store::SetOptions::default(),
            )
            .await
            .expect("SET")
    }

    pub async fn close(self) {
        let _ = self.client.shutdown().await;
        let _ = self.exit.try_exit();
    }
}

/// The SDK's lock client of `key` for `holder`, over `c`'s state store
/// client.
pub fn lock_client(
    c: &SdkClient,
    key: &str,
    holder: &str,
) -> azure_iot_operations_services::leased_lock::lock::Client {
    azure_iot_operations_services::leased_lock::lock::Client::new(
        Arc::clone(&c.client),
        key.as_bytes().to_vec(),
        holder.as_bytes().to_vec(),
    )
    .unwrap()
}

/// The SDK's lease client of `key` for `holder`, over `c`'s state store
/// client.
pub fn lease_client(
    c: &SdkClient,
    key: &str,
    holder: &str,
) -> azure_iot_operations_services::leased_lock::lease::Client {
    azure_iot_operations_services::leased_lock::lease::Client::new(
        Arc::clone(&c.client),
        key.as_bytes().to_vec(),
        holder.as_bytes().to_vec(),
    )
    .unwrap()
}

/// The next notification of `observation`, within [`TIMEOUT`].
pub async fn next_notification(
    observation: &mut state_store::KeyObservation,
) -> state_store::KeyNotification {
    tokio::time::timeout(TIMEOUT, observation.recv_notification())
        .await
        .expect("a notification in time")
        .expect("the observation is open")
        .0
}
