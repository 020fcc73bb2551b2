//! SIGHUP on the real binary: each setting a reload can change is applied
//! (enabled, changed, disabled), and each it cannot is refused with an
//! ERROR line naming it, the running value kept. A configuration with any
//! error (a missing password file, a broken policy, an unreadable
//! certificate, a bad log filter) is refused as a whole: nothing of it
//! applies. A reload never says "reloaded" for a change that did not
//! happen, nor when nothing changed.

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
        Process::start_with_env(dir, config, listen, &[]).await
    }

    async fn start_with_env(
        dir: &Path,
        config: &Path,
        listen: bool,
        env: &[(&str, &str)],
    ) -> Process {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_statebroker"));
        command.envs(env.iter().copied());
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

    /// Whether a line of the last reload contains every one of `needles`.
    fn reload_said(&self, needles: &[&str]) -> bool {
        self.last_reload()
            .iter()
            .any(|l| needles.iter().all(|n| l.contains(n)))
    }

    /// Asserts the last reload was refused as a whole, naming `setting`
    /// and `why` in an ERROR line, and never said "reloaded".
    fn assert_refused(&self, setting: &str, why: &str) {
        let lines = self.last_reload();
        assert!(
            self.reload_said(&[" ERROR ", setting, why]),
            "an ERROR naming {setting} and {why}: {lines:#?}"
        );
        assert!(
            self.reload_said(&[" ERROR ", "SIGHUP: configuration refused, nothing applied"]),
            "{lines:#?}"
        );
        assert!(!lines.iter().any(|l| l.contains("reloaded")), "{lines:#?}");
    }

    /// Asserts the last reload applied everything and names `changed`.
    fn assert_reloaded(&self, changed: &str) {
        let lines = self.last_reload();
        let summary = lines.last().unwrap();
        assert!(
            summary.contains(" INFO ")
                && summary.contains(&format!("SIGHUP: configuration reloaded: {changed}")),
            "{lines:#?}"
        );
        assert!(!lines.iter().any(|l| l.contains(" ERROR ")), "{lines:#?}");
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
    broker.assert_reloaded("password_file");
    assert!(broker.reload_said(&["[broker] password_file enabled", "first", "1 users"]));
    assert_eq!(broker.connect("c1", wrong).await, Code::BadUserNamePassword);
    assert_eq!(broker.connect("c2", alice).await, Code::Success);
    assert_eq!(
        broker.connect("c2n", Some(("nobody", "right"))).await,
        Code::BadUserNamePassword
    );

    // A file that does not exist is refused, named, and the one in use stays.
    write_config(&config, "[broker]\npassword_file = \"missing\"\n");
    broker.reload().await;
    broker.assert_refused("[broker] password_file", "missing");
    assert_eq!(
        broker.connect("c3", alice).await,
        Code::Success,
        "still first"
    );
    assert_eq!(
        broker.connect("c3w", wrong).await,
        Code::BadUserNamePassword
    );

    // New content in the same file: read again.
    password_file(dir.path(), "first", &[("alice", "right"), ("carol", "c")]);
    write_config(&config, "[broker]\npassword_file = \"first\"\n");
    broker.reload().await;
    broker.assert_reloaded("password_file");
    assert!(broker.reload_said(&["password_file read again", "2 users"]));
    assert_eq!(
        broker.connect("c3c", Some(("carol", "c"))).await,
        Code::Success
    );

    // Changed: another file, other users.
    password_file(dir.path(), "second", &[("bob", "other")]);
    write_config(&config, "[broker]\npassword_file = \"second\"\n");
    broker.reload().await;
    broker.assert_reloaded("password_file");
    assert!(broker.reload_said(&["[broker] password_file changed", "second"]));
    assert_eq!(
        broker.connect("c4", Some(("bob", "other"))).await,
        Code::Success
    );
    assert_eq!(broker.connect("c5", alice).await, Code::BadUserNamePassword);

    // Disabled: credentials are no longer checked (a loopback listener
    // lets anonymous clients in).
    write_config(&config, "[broker]\npassword_file = \"\"\n");
    broker.reload().await;
    broker.assert_reloaded("password_file");
    assert!(broker.reload_said(&["[broker] password_file disabled"]));
    assert_eq!(broker.connect("c6", wrong).await, Code::Success);

    // The same configuration again: nothing to apply, and it says so.
    broker.reload().await;
    let lines = broker.last_reload();
    assert!(
        lines
            .last()
            .unwrap()
            .contains("SIGHUP: configuration unchanged"),
        "{lines:#?}"
    );
    assert!(!lines.iter().any(|l| l.contains("reloaded")), "{lines:#?}");
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
    broker.assert_reloaded("authorization");
    assert!(broker.reload_said(&["[broker] authorization enabled", "first.yaml", "1 rules"]));
    assert_eq!(broker.connect("anyone", None).await, Code::NotAuthorized);
    assert_eq!(broker.connect("first", None).await, Code::Success);

    policy(dir.path(), "second.yaml", "second");
    write_config(&config, "[broker]\nauthorization = \"second.yaml\"\n");
    broker.reload().await;
    broker.assert_reloaded("authorization");
    assert!(broker.reload_said(&["[broker] authorization changed", "second.yaml"]));
    assert_eq!(broker.connect("first", None).await, Code::NotAuthorized);
    assert_eq!(broker.connect("second", None).await, Code::Success);

    // A broken policy is refused with the file named; the one in use stays.
    tls::write(dir.path(), "second.yaml", "rules: [{ principals: {} }]");
    broker.reload().await;
    broker.assert_refused("[broker] authorization", "second.yaml");
    assert_eq!(broker.connect("second", None).await, Code::Success);
    assert_eq!(broker.connect("first", None).await, Code::NotAuthorized);

    // A missing one too.
    write_config(&config, "[broker]\nauthorization = \"nowhere.yaml\"\n");
    broker.reload().await;
    broker.assert_refused("[broker] authorization", "nowhere.yaml");
    assert_eq!(broker.connect("second", None).await, Code::Success);

    write_config(&config, "[broker]\nauthorization = \"\"\n");
    broker.reload().await;
    broker.assert_reloaded("authorization");
    assert!(broker.reload_said(&["[broker] authorization disabled"]));
    assert_eq!(broker.connect("anyone", None).await, Code::Success);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_with_any_error_is_refused_as_a_whole() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.toml");
    password_file(dir.path(), "first", &[("alice", "right")]);
    write_config(
        &config,
        "[log]\nlevel = \"info\"\n[broker]\npassword_file = \"first\"\n",
    );
    let broker = Process::start(dir.path(), &config, true).await;
    let alice = Some(("alice", "right"));
    let bob = Some(("bob", "new"));

    // Good password file and log level, broken policy: none of it applies.
    password_file(dir.path(), "second", &[("bob", "new")]);
    tls::write(dir.path(), "broken.yaml", "rules: [{ principals: {} }]");
    write_config(
        &config,
        "[log]\nlevel = \"debug\"\n[broker]\npassword_file = \"second\"\n\
         authorization = \"broken.yaml\"\n",
    );
    broker.reload().await;
    broker.assert_refused("[broker] authorization", "broken.yaml");
    assert_eq!(
        broker.connect("a1", alice).await,
        Code::Success,
        "first stays"
    );
    assert_eq!(broker.connect("b1", bob).await, Code::BadUserNamePassword);
    assert_eq!(
        broker.connect("open", None).await,
        Code::Success,
        "no policy"
    );

    // Good policy and password file, bad log filter: none of it applies.
    policy(dir.path(), "only-x.yaml", "x");
    write_config(
        &config,
        "[log]\nlevel = \"info,[bad\"\n[broker]\npassword_file = \"second\"\n\
         authorization = \"only-x.yaml\"\n",
    );
    broker.reload().await;
    broker.assert_refused("[log] level", "info,[bad");
    assert_eq!(broker.connect("a2", alice).await, Code::Success);
    assert_eq!(broker.connect("open2", None).await, Code::Success);

    // A password file that does not exist with a good policy: neither.
    write_config(
        &config,
        "[broker]\npassword_file = \"gone\"\nauthorization = \"only-x.yaml\"\n",
    );
    broker.reload().await;
    broker.assert_refused("[broker] password_file", "gone");
    assert_eq!(broker.connect("open3", None).await, Code::Success);
    assert_eq!(broker.connect("a3", alice).await, Code::Success);

    // The level stayed at info all along: a connection logs no DEBUG line
    // (its INFO line comes after the handshake's DEBUG ones would).
    let connected = broker.count("client connected");
    broker.connect("quiet", None).await;
    common::eventually("the connection's INFO line", || {
        broker.count("client connected") > connected
    })
    .await;
    assert_eq!(broker.count(" DEBUG "), 0, "the level stayed at info");
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
async fn certificates_are_swapped_by_sighup_and_bad_ones_refused() {
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
    broker.assert_reloaded("v5.1.tls");
    assert!(broker.reload_said(&["v5.1.tls read again"]));
    assert!(handshake(second.pem()).await);
    assert!(!handshake(first.pem()).await, "the old certificate is gone");

    // Other files for the same listener: served from now on too.
    let third = tls::Ca::new("third CA");
    let server = third.server();
    tls::write(dir.path(), "third.pem", &server.cert_pem);
    tls::write(dir.path(), "third.key", &server.key_pem);
    write_config(&config, &tls_config("third.pem", "third.key"));
    broker.reload().await;
    broker.assert_reloaded("v5.1.tls");
    assert!(broker.reload_said(&["v5.1.tls changed", "third.pem"]));
    assert!(handshake(third.pem()).await);
    assert!(!handshake(second.pem()).await, "the second is gone");

    // A certificate that does not exist, or a key of another certificate:
    // refused as a whole, named, and the certificate in use stays.
    write_config(&config, &tls_config("absent.pem", "third.key"));
    broker.reload().await;
    broker.assert_refused("v5.1.tls", "absent.pem");
    assert!(handshake(third.pem()).await);
    write_config(&config, &tls_config("third.pem", "server.key"));
    broker.reload().await;
    broker.assert_refused("v5.1.tls", "do not go together");
    assert!(handshake(third.pem()).await);

    // TLS turned off needs a restart: named in an ERROR line, the
    // summary says the configuration was applied only in part.
    let plain = tls_config("third.pem", "third.key");
    let plain = &plain[..plain.find("[v5.1.tls]").unwrap()];
    write_config(&config, plain);
    broker.reload().await;
    let lines = broker.last_reload();
    assert!(
        broker.reload_said(&[" ERROR ", "v5.1.tls (TLS turned on or off)", "restart"]),
        "{lines:#?}"
    );
    assert!(
        broker.reload_said(&[" ERROR ", "SIGHUP: configuration applied in part"]),
        "{lines:#?}"
    );
    assert!(!lines.iter().any(|l| l.contains("reloaded")), "{lines:#?}");
    assert!(handshake(third.pem()).await);
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
    broker.assert_reloaded("log.level");
    broker.connect("chatty", None).await;
    common::eventually("DEBUG lines once the level is debug", || debug_lines() > 0).await;

    // The broker's own lines at warn, the binary's (the reload's summary
    // among them) at info: a connection logs nothing any more.
    write_config(&config, "[log]\nlevel = \"warn,statebroker=info\"\n");
    broker.reload().await;
    broker.assert_reloaded("log.level");
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

    // Settings that need a restart, beside one that does not: an ERROR line
    // names each of the former, the latter applies, and the summary says
    // the configuration was applied only in part.
    password_file(dir.path(), "users", &[("alice", "right")]);
    write_config(
        &config,
        "[log]\nlevel = \"warn,statebroker=info\"\n[statestore]\nnode_id = \"other\"\n\
         [broker]\nsys_interval = 3\npassword_file = \"users\"\n",
    );
    broker.reload().await;
    let lines = broker.last_reload();
    for setting in ["statestore.node_id", "broker.sys_interval"] {
        assert!(
            broker.reload_said(&[" ERROR ", setting, "restart"]),
            "{setting}: {lines:#?}"
        );
    }
    assert!(
        broker.reload_said(&[
            " ERROR ",
            "SIGHUP: configuration applied in part: applied password_file; not applied (named above): broker.sys_interval, statestore.node_id"
        ]),
        "{lines:#?}"
    );
    assert!(!lines.iter().any(|l| l.contains("reloaded")), "{lines:#?}");
    assert_eq!(
        broker.connect("wrong", Some(("alice", "wrong"))).await,
        Code::BadUserNamePassword,
        "the password file applied"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_rust_log_set_a_log_level_change_is_named_as_not_applied() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.toml");
    write_config(&config, "[log]\nlevel = \"info\"\n");
    let broker = Process::start_with_env(dir.path(), &config, true, &[("RUST_LOG", "info")]).await;
    write_config(&config, "[log]\nlevel = \"debug\"\n");
    broker.reload().await;
    let lines = broker.last_reload();
    assert!(
        broker.reload_said(&[" ERROR ", "[log] level", "RUST_LOG"]),
        "{lines:#?}"
    );
    assert!(
        broker.reload_said(&[" ERROR ", "SIGHUP: configuration applied in part"]),
        "{lines:#?}"
    );
    assert!(!lines.iter().any(|l| l.contains("reloaded")), "{lines:#?}");
}
