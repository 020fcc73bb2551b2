//! What a client developer's own test helpers look like: connect the
//! official Rust SDK's state store client to a
//! [`statebroker::testing::TestBroker`]. The tests in `tests/` use it the
//! way a user's crate would (see the README's "Testing your client
//! against statebroker").

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use azure_iot_operations_mqtt::aio::connection_settings::MqttConnectionSettingsBuilder;
use azure_iot_operations_mqtt::session::{
    Session, SessionExitHandle, SessionMonitor, SessionOptionsBuilder,
};
use azure_iot_operations_protocol::application::ApplicationContextBuilder;
use azure_iot_operations_services::state_store;

/// An SDK state store client and its MQTT session.
pub struct Sdk {
    /// The state store client.
    pub client: Arc<state_store::Client>,
    /// Watches the session's connection.
    pub monitor: SessionMonitor,
    exit: SessionExitHandle,
}

impl Sdk {
    /// Connects `client_id` to the broker at `addr` (plain TCP, clean start).
    pub async fn connect(addr: SocketAddr, client_id: &str) -> Sdk {
        let connection_settings = MqttConnectionSettingsBuilder::default()
            .client_id(client_id)
            .hostname(addr.ip().to_string())
            .tcp_port(addr.port())
            .use_tls(false)
            .keep_alive(Duration::from_secs(10))
            .clean_start(true)
            .build()
            .expect("connection settings");
        let session = Session::new(
            SessionOptionsBuilder::default()
                .connection_settings(connection_settings)
                .build()
                .expect("session options"),
        )
        .expect("session");
        let client = state_store::Client::new(
            ApplicationContextBuilder::default()
                .build()
                .expect("context"),
            session.create_managed_client(),
            session.create_session_monitor(),
            state_store::ClientOptionsBuilder::default()
                .build()
                .expect("client options"),
        )
        .expect("state store client");
        let monitor = session.create_session_monitor();
        let exit = session.create_exit_handle();
        tokio::spawn(session.run());
        tokio::time::timeout(Duration::from_secs(10), monitor.connected())
            .await
            .expect("the SDK session connects");
        Sdk {
            client: Arc::new(client),
            monitor,
            exit,
        }
    }

    /// Shuts the client and its session down.
    pub async fn close(self) {
        let _ = self.client.shutdown().await;
        let _ = self.exit.try_exit();
    }
}
