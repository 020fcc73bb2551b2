//! The README's first session, as a complete program: the official SDK's
//! state store client sets a key and reads it back.
//!
//! ```text
//! cargo run --release                                  # the broker, in one shell
//! cargo run --release --example first_session          # this, in another
//! cargo run --release --example first_session -- 127.0.0.1:1884
//! ```
//!
//! In a crate of your own it needs `tokio` (features `macros`,
//! `rt-multi-thread`), `azure_iot_operations_services` (feature
//! `state_store`), `azure_iot_operations_mqtt` and
//! `azure_iot_operations_protocol` (versions as in this repository's
//! `Cargo.toml`).

use std::time::Duration;

use azure_iot_operations_mqtt::aio::connection_settings::MqttConnectionSettingsBuilder;
use azure_iot_operations_mqtt::session::{Session, SessionOptionsBuilder};
use azure_iot_operations_protocol::application::ApplicationContextBuilder;
use azure_iot_operations_services::state_store::{self, SetOptions};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The broker's address: the first argument, or the default listener.
    let addr = std::env::args().nth(1).unwrap_or("localhost:1883".into());
    let (host, port) = addr.rsplit_once(':').ok_or("ADDR as host:port")?;

    let settings = MqttConnectionSettingsBuilder::default()
        .client_id("my-app")
        .hostname(host)
        .tcp_port(port.parse::<u16>()?)
        .use_tls(false)
        .build()?;
    let session = Session::new(
        SessionOptionsBuilder::default()
            .connection_settings(settings)
            .build()?,
    )?;
    let client = state_store::Client::new(
        ApplicationContextBuilder::default().build()?,
        session.create_managed_client(),
        session.create_session_monitor(),
        state_store::ClientOptionsBuilder::default().build()?,
    )?;
    let exit = session.create_exit_handle();
    let running = tokio::spawn(session.run());

    let t = Duration::from_secs(5);
    client
        .set(
            b"door".to_vec(),
            b"open".to_vec(),
            t,
            None,
            SetOptions::default(),
        )
        .await?;
    let door = client.get(b"door".to_vec(), t).await?;
    // The value, and the version the broker gave it.
    println!(
        "door = {:?} (version {:?})",
        door.response
            .map(|v| String::from_utf8_lossy(&v).into_owned()),
        door.version.map(|v| v.to_string())
    );

    client.shutdown().await?;
    exit.try_exit()?;
    running.await??;
    Ok(())
}
