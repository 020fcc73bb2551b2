//! SIGHUP on the real binary: each setting a reload can change is applied
//! (enabled, changed, disabled), and each it cannot is refused with an
//! ERROR line naming it, the running value kept. A reload never says
//! "reloaded" for a change that did not happen.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::raw::{Raw, v5};
use common::tls;
use v5::ConnectReturnCode as Code;

/// A broker process started with `--config config`, listening where its
/// configuration says (its first listener's address read from its log).
struct Process {
    child: tokio::process::Child,
    addr: SocketAddr,
    log: Arc<parking_lot::Mutex<Vec<String>>>,
}

impl Process {
    async fn start(dir: &Path, config: &Path, listen: bool) -> Process {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_statebroker"));
        if listen {
            command.args(["--listen", "127.0.0.1:0"]);
        }
        command
            .args(["--http", "127.0.0.1:0", "--data-dir"])
            .arg(dir.join("data"))
            .arg("--config")
            .arg(config);
        let (child, addr, log) = common::spawn_command(command).await;
        Process { child, addr, log }
    }

    /// Sends SIGHUP and waits for the reload's summary line.
    async fn reload(&self) {
        let before = self.count("SIGHUP: configuration");
        let pid = self.child.id().unwrap().to_string();
        let sent = std::process::Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap();
        assert!(sent.success());
        common::eventually("the reload's summary", || {
            self.count("SIGHUP: configuration") > before
        })
        .await;
    }

    fn count(&self, needle: &str) -> usize {
        self.log
            .lock()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// The lines of the last reload.
    fn last_reload(&self) -> Vec<String> {
        let log = self.log.lock();
        let start = log
            .iter()
            .rposition(|l| l.contains("SIGHUP: configuration"))
            .unwrap_or(0);
        let first = log[..start]
            .iter()
            .rposition(|l| l.contains("SIGHUP: configuration"))
            .map_or(0, |i| i + 1);
        log[first..=start].to_vec()
    }

    /// A connection as `client_id`, with `login`: the CONNACK's code.
    async fn connect(&self, client_id: &str, login: Option<(&str, &str)>) -> Code {
        let login = login.map(|(user, password)| v5::Login::new(user, password));
        let (_c, ack) = Raw::connect_with(self.addr, client_id, move |c| c.2 = login).await;
        ack.code
    }
}

fn write_config(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

fn password_file(dir: &Path, name: &str, users: &[(&str, &str)]) -> PathBuf {
    let mut text = String::new();
    for (user, password) in users {
        text = broker::passwords::set_user(&text, user, password.as_bytes()).unwrap();
    }
    tls::write(dir, name, &text)
}

/// A policy that lets only `client` connect.
fn policy(dir: &Path, name: &str, client: &str) -> PathBuf {
    tls::write(
        dir,
        name,
        &format!(
            "rules: [{{ principals: {{ clientIds: [{client}] }}, brokerResources: [{{ method: Connect }}] }}]"
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_file_is_enabled_changed_and_disabled_by_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.toml");
    write_config(&config, "[broker]\npassword_file = \"\"\n");
    let broker = Process::start(dir.path(), &config, true).await;
    let alice = Some(("alice", "right"));
    let wrong = Some(("alice", "wrong"));
    assert_eq!(broker.connect("c0", wrong).await, Code::Success, "no file");

    // Enabled: a wrong password is refused from now on.
    password_file(dir.path(), "first", &[("alice", "right")]);
    write_config(&config, "[broker]\npassword_file = \"first\"\n");
    broker.reload().await;
    assert!(
        broker
            .last_reload()
            .iter()
            .any(|l| l.contains("password file enabled")),
        "{:#?}",
        broker.last_reload()
    );
    assert_eq!(broker.connect("c1", wrong).await, Code::BadUserNamePassword);
    assert_eq!(broker.connect("c2", alice).await, Code::Success);

    // A file that does not exist is refused, named, and the one in use stays.
    write_config(&config, "[broker]\npassword_file = \"missing\"\n");
    broker.reload().await;
    let lines = broker.last_reload();
    assert!(
        lines.iter().any(|l| l.contains(" ERROR ")
            && l.contains("[broker] password_file")
            && l.contains("missing")),
        "{lines:#?}"
    );
    assert!(
        !lines.iter().any(|l| l.contains("configuration reloaded\"")
            || l.ends_with("SIGHUP: configuration reloaded"))
    );
    assert_eq!(
        broker.connect("c3", alice).await,
        Code::Success,
        "still first"
    );

    // Changed: another file, other users.
    password_file(dir.path(), "second", &[("bob", "other")]);
    write_config(&config, "[broker]\npassword_file = \"second\"\n");
    broker.reload().await;
    assert!(
        broker
            .last_reload()
            .iter()
            .any(|l| l.contains("password file changed"))
    );
    assert_eq!(
        broker.connect("c4", Some(("bob", "other"))).await,
        Code::Success
    );
    assert_eq!(broker.connect("c5", alice).await, Code::BadUserNamePassword);

    // Disabled: credentials are no longer checked.
    write_config(&config, "[broker]\npassword_file = \"\"\n");
    broker.reload().await;
    assert!(
        broker
            .last_reload()
            .iter()
            .any(|l| l.contains("password file disabled"))
    );
    assert_eq!(broker.connect("c6", wrong).await, Code::Success);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_is_enabled_changed_and_disabled_by_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.toml");
    write_config(&config, "[log]\nlevel = \"info\"\n");
    let broker = Process::start(dir.path(), &config, true).await;
    assert_eq!(broker.connect("anyone", None).await, Code::Success);

    policy(dir.path(), "first.yaml", "first");
    write_config(&config, "[broker]\nauthorization = \"first.yaml\"\n");
    broker.reload().await;
    assert!(
        broker
            .last_reload()
            .iter()
            .any(|l| l.contains("authorization policy enabled"))
    );
    assert_eq!(broker.connect("anyone", None).await, Code::NotAuthorized);
    assert_eq!(broker.connect("first", None).await, Code::Success);

    policy(dir.path(), "second.yaml", "second");
    write_config(&config, "[broker]\nauthorization = \"second.yaml\"\n");
    broker.reload().await;
    assert!(
        broker
            .last_reload()
            .iter()
            .any(|l| l.contains("authorization policy changed"))
    );
    assert_eq!(broker.connect("first", None).await, Code::NotAuthorized);
    assert_eq!(broker.connect("second", None).await, Code::Success);

    // A broken policy is refused with the file named; the one in use stays.
    tls::write(dir.path(), "second.yaml", "rules: [{ principals: {} }]");
    broker.reload().await;
    assert!(
        broker
            .last_reload()
            .iter()
            .any(|l| l.contains(" ERROR ") && l.contains("second.yaml")),
        "{:#?}",
        broker.last_reload()
    );
    assert_eq!(broker.connect("second", None).await, Code::Success);

    write_config(&config, "[broker]\nauthorization = \"\"\n");
    broker.reload().await;
    assert!(
        broker
            .last_reload()
            .iter()
            .any(|l| l.contains("authorization policy disabled"))
    );
    assert_eq!(broker.connect("anyone", None).await, Code::Success);
}

/// A TLS listener in a configuration file (every field given).
fn tls_config(cert: &str, key: &str) -> String {
    format!(
        "[v5.1]\nname = \"tls\"\nlisten = \"127.0.0.1:0\"\nnext_connection_delay_ms = 0\n\
         [v5.1.connections]\nconnection_timeout_ms = 10000\nmax_payload_size = 1048576\n\
         max_inflight_count = 1000\ndynamic_filters = true\n\
         [v5.1.tls]\ncertpath = \"{cert}\"\nkeypath = \"{key}\"\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_are_read_again_and_a_new_listener_needs_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let first = tls::Ca::new("first CA");
    let server = first.server();
    tls::write(dir.path(), "server.pem", &server.cert_pem);
    tls::write(dir.path(), "server.key", &server.key_pem);
    let config = dir.path().join("c.toml");
    write_config(&config, &tls_config("server.pem", "server.key"));
    let broker = Process::start(dir.path(), &config, false).await;
    let handshake = |ca: String| {
        let addr = broker.addr;
        async move {
            tls::tls_stream(addr, &tls::connector(&ca, None))
                .await
                .is_ok()
        }
    };
    assert!(handshake(first.pem()).await);

    // New content in the same files: served from now on.
    let second = tls::Ca::new("second CA");
    let server = second.server();
    tls::write(dir.path(), "server.pem", &server.cert_pem);
    tls::write(dir.path(), "server.key", &server.key_pem);
    broker.reload().await;
    assert!(
        broker
            .last_reload()
            .iter()
            .any(|l| l.contains("TLS certificate") && l.contains("read again")),
        "{:#?}",
        broker.last_reload()
    );
    assert!(handshake(second.pem()).await);
    assert!(!handshake(first.pem()).await, "the old certificate is gone");

    // Other files for the listener (or TLS on or off) rebind it: refused,
    // named, and the certificate in use stays.
    tls::write(dir.path(), "other.pem", &server.cert_pem);
    write_config(&config, &tls_config("other.pem", "server.key"));
    broker.reload().await;
    let lines = broker.last_reload();
    assert!(
        lines
            .iter()
            .any(|l| l.contains(" ERROR ") && l.contains("listeners") && l.contains("restart")),
        "{lines:#?}"
    );
    assert!(
        lines.iter().any(|l| l.contains("reloaded in part")),
        "{lines:#?}"
    );
    assert!(handshake(second.pem()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_level_follows_sighup_and_other_settings_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.toml");
    write_config(&config, "[log]\nlevel = \"info\"\n");
    let broker = Process::start(dir.path(), &config, true).await;
    let debug_lines = || broker.count(" DEBUG ");

    write_config(&config, "[log]\nlevel = \"debug\"\n");
    broker.reload().await;
    broker.connect("chatty", None).await;
    common::eventually("DEBUG lines once the level is debug", || debug_lines() > 0).await;

    // The broker's own lines at warn, the binary's (the reload's summary
    // among them) at info: a connection logs nothing any more.
    write_config(&config, "[log]\nlevel = \"warn,statebroker=info\"\n");
    broker.reload().await;
    let (debug, connected) = (debug_lines(), broker.count("client connected"));
    let mut quiet = Raw::connect(broker.addr, "quiet").await;
    // A publish the broker refuses with a WARN line: once that line is in,
    // every line logged before it is too.
    let refused = broker.count("publish refused");
    common::mqtt::publish_complete(
        &mut quiet,
        "$SYS/x",
        b"x",
        rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
        false,
    )
    .await;
    common::eventually("the WARN line", || {
        broker.count("publish refused") > refused
    })
    .await;
    assert_eq!(debug_lines(), debug, "no DEBUG at warn");
    assert_eq!(
        broker.count("client connected"),
        connected,
        "no INFO at warn"
    );

    // A setting that needs a restart: an ERROR line names it, and the
    // summary says the reload was partial.
    write_config(
        &config,
        "[log]\nlevel = \"info\"\n[statestore]\nnode_id = \"other\"\n",
    );
    broker.reload().await;
    let lines = broker.last_reload();
    assert!(
        lines
            .iter()
            .any(|l| l.contains(" ERROR ") && l.contains("[statestore]") && l.contains("restart")),
        "{lines:#?}"
    );
    assert!(
        lines.iter().any(|l| l.contains("reloaded in part")),
        "{lines:#?}"
    );
}
