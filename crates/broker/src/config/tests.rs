//! The configuration's layers, checks and reload comparison.
use super::*;
use std::io::Write;

fn no_env() -> Vec<(String, String)> {
    Vec::new()
}

fn file(text: &str) -> tempfile::TempPath {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f.into_temp_path()
}

#[test]
fn embedded_default() {
    let s = Settings::load_with_env(None, &[], no_env()).unwrap();
    // Loopback only, as mosquitto 2 does, anonymous clients welcome there.
    let addrs: Vec<SocketAddr> = s.listeners.iter().map(|l| l.addr).collect();
    assert_eq!(
        addrs,
        vec![
            "127.0.0.1:1883".parse().unwrap(),
            "[::1]:1883".parse().unwrap()
        ]
    );
    assert!(
        s.listeners
            .iter()
            .all(|l| l.allow_anonymous && l.tls.is_none())
    );
    assert_eq!(
        (s.password_file.clone(), s.authorization.clone()),
        (None, None)
    );
    assert_eq!(s.statestore.node_id, "statebroker");
    assert!(s.broker.legacy_2023_topic);
    assert_eq!(s.store_config().scan_page_size, 100);
    let p = s.persistence.unwrap();
    assert_eq!(p.data_dir, Path::new("./statebroker-data"));
    assert_eq!(p.mode, Mode::Fsync);
}

#[test]
fn persistence_settings() {
    let f = file("[persistence]\nmode = \"interval\"\ninterval_ms = 50\nkeys = [\"all\"]\n");
    let s = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
    let p = s.persistence.clone().unwrap();
    assert_eq!(p.mode, Mode::Interval(Duration::from_millis(50)));
    assert_eq!(
        p.data_dir,
        f.parent().unwrap().join("statebroker-data"),
        "next to the config"
    );
    assert!(s.persist_policy.persists(b"anything"));
    let env = vec![(
        "STATEBROKER__PERSISTENCE__KEYS".to_owned(),
        "exact:a,glob:b*".to_owned(),
    )];
    let s = Settings::load_with_env(None, &[], env).unwrap();
    assert!(s.persist_policy.persists(b"a") && s.persist_policy.persists(b"bee"));
    assert!(!s.persist_policy.persists(b"c"));
    let f = file("[persistence]\ndata_dir = \"\"\n");
    assert!(
        Settings::load_with_env(Some(&f), &[], no_env())
            .unwrap()
            .persistence
            .is_none()
    );
    assert!(
        Settings::listening_on("127.0.0.1:0".parse().unwrap())
            .persistence
            .is_none()
    );
    let e = error_of("[persistence]\nmode = \"sometimes\"\n");
    assert!(e.contains("persistence.mode"), "{e}");
    let e = error_of("[persistence]\nkeys = [\"regex:x\"]\n");
    assert!(e.contains("persistence.keys"), "{e}");
}

#[test]
fn listen_override() {
    let addr = "127.0.0.1:0".parse().unwrap();
    let s = Settings::load_with_env(None, &[addr], no_env()).unwrap();
    assert_eq!(s.listeners[0].addr, addr);
    let two: [SocketAddr; 2] = [
        "127.0.0.1:7001".parse().unwrap(),
        "[::1]:7002".parse().unwrap(),
    ];
    let s = Settings::load_with_env(None, &two, no_env()).unwrap();
    let addrs: Vec<SocketAddr> = s.listeners.iter().map(|l| l.addr).collect();
    assert_eq!(addrs, two, "one listener per --listen");
    assert!(s.listeners.iter().all(|l| l.max_packet_size == 1_179_648));
}

/// Issue #33 item 9: the default `max_value_size` (1 MiB) fits the
/// default packet limit with room for the request around it; a listener
/// whose limit makes it unreachable is named at start.
#[test]
fn a_value_size_no_packet_can_carry_is_named() {
    let addr: SocketAddr = "127.0.0.1:7001".parse().unwrap();
    let s = Settings::load_with_env(None, &[addr], no_env()).unwrap();
    assert!(s.advisories().is_empty(), "{:?}", s.advisories());
    let f = file(
        "[v4.1]\nname = \"small\"\nlisten = \"127.0.0.1:2883\"\nnext_connection_delay_ms = 0\n\
         [v4.1.connections]\nconnection_timeout_ms = 100\nmax_payload_size = 5000\nmax_inflight_count = 10\n",
    );
    let s = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
    let advice = s.advisories();
    assert_eq!(advice.len(), 1, "{advice:?}");
    for needle in [
        "max_value_size = 1048576",
        "listener v4.1 (127.0.0.1:2883)",
        "up to 5000 bytes",
        "v4.1.connections.max_payload_size",
    ] {
        assert!(advice[0].contains(needle), "{needle:?} in {}", advice[0]);
    }
}

#[test]
fn a_reload_names_what_needs_a_restart() {
    // Files in one directory: the data directory is relative to it.
    let f = file("");
    let running = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
    let f = file("[log]\nlevel = \"debug\"\n");
    let new = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
    assert_eq!(new.log.level, "debug");
    assert!(running.needs_restart(&new).is_empty(), "the level reloads");
    let f = file("[statestore]\nnode_id = \"other\"\n[http]\nlisten = \"\"\n");
    let new = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
    assert_eq!(
        running.needs_restart(&new),
        vec!["statestore.node_id", "[http]"]
    );
    let e = error_of("[log]\nformat = \"xml\"\n");
    assert!(e.contains("log.format"), "{e}");
}

#[test]
fn a_reload_may_change_tls_files_but_not_the_listeners() {
    let listener = |tls: &str, extra: &str| {
        let text = format!(
            "[v5.1]\nname = \"tls\"\nlisten = \"127.0.0.1:8883\"\nnext_connection_delay_ms = 0\n{extra}\
             [v5.1.connections]\nconnection_timeout_ms = 10000\nmax_payload_size = 1048576\n\
             max_inflight_count = 1000\ndynamic_filters = true\n{tls}"
        );
        Settings::load_with_env(Some(&file(&text)), &[], no_env()).unwrap()
    };
    let running = listener(
        "[v5.1.tls]\ncertpath = \"a.pem\"\nkeypath = \"a.key\"\n",
        "",
    );
    let new = listener(
        "[v5.1.tls]\ncertpath = \"b.pem\"\nkeypath = \"b.key\"\ncapath = \"ca.pem\"\n",
        "",
    );
    assert!(running.needs_restart(&new).is_empty(), "other files reload");
    let new = listener("", "");
    assert_eq!(
        running.needs_restart(&new),
        vec!["v5.1.tls (TLS turned on or off)"]
    );
    let new = listener(
        "[v5.1.tls]\ncertpath = \"a.pem\"\nkeypath = \"a.key\"\n",
        "allow_anonymous = false\n",
    );
    assert_eq!(running.needs_restart(&new), vec!["v5.1.allow_anonymous"]);
    let moved = Settings::load_with_env(
        Some(&file("")),
        &["127.0.0.1:9999".parse().unwrap()],
        no_env(),
    )
    .unwrap();
    assert!(running.needs_restart(&moved)[0].starts_with("listeners "));
    // Every [broker] setting but the two files needs a restart, by name.
    let base = Settings::load_with_env(Some(&file("")), &[], no_env()).unwrap();
    let new = Settings::load_with_env(
        Some(&file(
            "[broker]\nsys_interval = 7\npassword_file = \"p\"\nauthorization = \"a\"\n",
        )),
        &[],
        no_env(),
    )
    .unwrap();
    assert_eq!(base.needs_restart(&new), vec!["broker.sys_interval"]);
}

#[test]
fn a_file_changes_only_what_it_names() {
    let f = file("[statestore]\nnode_id = \"edge-7\"\n");
    let s = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
    assert_eq!(s.statestore.node_id, "edge-7");
    assert_eq!(s.statestore.max_clock_skew_ms, 60_000);
    assert_eq!(s.listeners[0].addr, "127.0.0.1:1883".parse().unwrap());
}

/// The embedded defaults of the KEYNOTIFY limits are the store's own (a
/// user's: a tenth of all registrations, an eighth of their bytes);
/// `[statestore]` sets each.
#[test]
fn watch_limits_default_to_the_stores_and_a_file_sets_them() {
    let c = Settings::load_with_env(None, &[], no_env())
        .unwrap()
        .store_config();
    let d = statestore::Config::default();
    let limits = |c: &statestore::Config| {
        [
            c.max_watches_per_client,
            c.max_watch_bytes_per_client,
            c.max_watches_per_user,
            c.max_watch_bytes_per_user,
            c.max_watches,
            c.max_watch_bytes,
        ]
    };
    assert_eq!(limits(&c), limits(&d));
    assert_eq!(
        (c.max_watches_per_user, c.max_watch_bytes_per_user),
        (c.max_watches / 10, c.max_watch_bytes / 8)
    );
    let f = file("[statestore]\nmax_watches_per_user = 10\nmax_watch_bytes_per_user = 1000\n");
    let c = Settings::load_with_env(Some(&f), &[], no_env())
        .unwrap()
        .store_config();
    assert_eq!(
        (c.max_watches_per_user, c.max_watch_bytes_per_user),
        (10, 1000)
    );
    assert_eq!(c.max_watches_per_client, 10_000, "the others stay");
}

#[test]
fn file_listeners_replace_the_default() {
    let f = file(
        "[v4.1]\nname = \"a\"\nlisten = \"127.0.0.1:2883\"\nnext_connection_delay_ms = 0\n\
         [v4.1.connections]\nconnection_timeout_ms = 100\nmax_payload_size = 5000\nmax_inflight_count = 10\n",
    );
    let s = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
    assert_eq!(s.listeners.len(), 1);
    assert_eq!(s.listeners[0].addr, "127.0.0.1:2883".parse().unwrap());
    assert_eq!(s.listeners[0].max_packet_size, 5000);
}

/// A listener in a file needs only `listen`: the rest is the embedded
/// default's (rumqttd's parser once asked for every field:
/// `missing configuration field "v5.1.next_connection_delay_ms"`, then
/// `.connections`); what the section gives, even one field of
/// `connections`, wins.
#[test]
fn a_file_listener_needs_only_listen() {
    let f = file(
        "[v5.1]\nlisten = \"127.0.0.1:2883\"\n\
         [ws.7]\nlisten = \"127.0.0.1:8080\"\n  [ws.7.connections]\n  max_payload_size = 5000\n",
    );
    let s = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
    assert_eq!(s.listeners.len(), 2);
    let (mqtt, ws) = (&s.listeners[0], &s.listeners[1]);
    assert_eq!(mqtt.name, "v5.1");
    assert_eq!(mqtt.addr, "127.0.0.1:2883".parse().unwrap());
    assert_eq!(mqtt.connect_timeout_ms, 10_000);
    assert_eq!(mqtt.max_packet_size, 1_179_648);
    assert_eq!(mqtt.receive_maximum, 1000);
    assert_eq!(ws.name, "ws.7");
    assert_eq!(ws.transport, Transport::WebSocket);
    assert_eq!(ws.max_packet_size, 5000);
    assert_eq!(ws.connect_timeout_ms, 10_000);
}

#[test]
fn the_web_views_reads_open_by_environment() {
    let s = Settings::load_with_env(None, &[], no_env()).unwrap();
    assert!(!s.http_options.allow_anonymous, "off by default");
    let env = vec![(
        "STATEBROKER__HTTP__ALLOW_ANONYMOUS".to_owned(),
        "true".to_owned(),
    )];
    let s = Settings::load_with_env(None, &[], env).unwrap();
    assert!(s.http_options.allow_anonymous);
}

#[test]
fn environment_overrides() {
    let env = vec![
        (
            "STATEBROKER__STATESTORE__NODE_ID".to_owned(),
            "from-env".to_owned(),
        ),
        (
            "STATEBROKER__ROUTER__MAX_CONNECTIONS".to_owned(),
            "7".to_owned(),
        ),
        ("UNRELATED".to_owned(), "x".to_owned()),
    ];
    let s = Settings::load_with_env(None, &[], env).unwrap();
    assert_eq!(s.statestore.node_id, "from-env");
    assert_eq!(s.router.max_connections, 7);
}

fn error_of(text: &str) -> String {
    let f = file(text);
    Settings::load_with_env(Some(&f), &[], no_env())
        .unwrap_err()
        .to_string()
}

#[test]
fn errors_name_the_field() {
    let e = error_of("[statestore]\nnode_id = 5\nmax_clock_skew_ms = \"soon\"\n");
    assert!(e.contains("max_clock_skew_ms"), "{e}");
    let e = error_of("[statestore]\nnode_idd = \"x\"\n");
    assert!(e.contains("node_idd"), "{e}");
    let e = error_of("[statstore]\nnode_id = \"x\"\n");
    assert!(e.contains("unknown section or key `statstore`"), "{e}");
    let e = error_of("[statestore.quota]\nmax_keys = \"many\"\n");
    assert!(e.contains("statestore.quota.max_keys"), "{e}");
    let e = error_of("[router]\nmax_segment_size = 10\n");
    assert!(e.contains("router.max_segment_size"), "{e}");
    let e = error_of("[v5.1]\nlisten = \"not an address\"\n");
    assert!(e.contains("listen") || e.contains("v5"), "{e}");
    let e = error_of("[broker]\ntopic_alias_max = -1\n");
    assert!(e.contains("topic_alias_max"), "{e}");
    let e = error_of("this is = not toml [");
    assert!(e.contains("cannot read config file"), "{e}");
    let missing = Settings::load_with_env(Some(Path::new("/nonexistent/x.toml")), &[], no_env());
    assert!(
        missing
            .unwrap_err()
            .to_string()
            .contains("/nonexistent/x.toml")
    );
}

#[test]
fn unimplemented_sections_are_refused_not_ignored() {
    for (text, section) in [
        ("[prometheus]\nport = 9042\n", "[prometheus]"),
        ("[metrics.alerts]\npush_interval = 1\n", "[metrics]"),
        ("[console]\nlisten = \"127.0.0.1:3030\"\n", "[console]"),
        ("[bridge]\nname = \"b\"\n", "[bridge]"),
    ] {
        let e = error_of(text);
        assert!(e.contains(section), "{text}: {e}");
        assert!(e.contains("not"), "{text}: {e}");
    }
}

const CONNECTIONS: &str = "next_connection_delay_ms = 0\n[{s}.connections]\nconnection_timeout_ms = 100\nmax_payload_size = 5000\nmax_inflight_count = 10\n";

/// A listener section: `keys` in it, then its connections, then `tables`.
fn listener_section(section: &str, keys: &str, tables: &str) -> String {
    format!(
        "[{section}]\nname = \"x\"\n{keys}{}{tables}",
        CONNECTIONS.replace("{s}", section)
    )
}

#[test]
fn tls_websocket_and_anonymous_listeners() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    let text = [
        listener_section("v5.1", "listen = \"0.0.0.0:1883\"\n", ""),
        listener_section(
            "v5.2",
            "listen = \"0.0.0.0:8883\"\nallow_anonymous = true\n",
            "[v5.2.tls]\ncertpath = \"s.pem\"\nkeypath = \"s.key\"\ncapath = \"ca.pem\"\n",
        ),
        listener_section("ws.1", "listen = \"127.0.0.1:8080\"\n", ""),
        "[broker]\npassword_file = \"users\"\nauthorization = \"policy.yaml\"\n".to_owned(),
    ]
    .concat();
    std::fs::write(&path, text).unwrap();
    let s = Settings::load_with_env(Some(&path), &[], no_env()).unwrap();
    let l: Vec<_> = s
        .listeners
        .iter()
        .map(|l| (l.scheme(), l.allow_anonymous))
        .collect();
    assert_eq!(l, vec![("mqtt", false), ("mqtts", true), ("ws", true)]);
    let tls = s.listeners[1].tls.clone().unwrap();
    assert_eq!(tls.cert, dir.path().join("s.pem"), "relative to the file");
    assert_eq!(tls.ca, Some(dir.path().join("ca.pem")));
    assert_eq!(s.password_file, Some(dir.path().join("users")));
    assert_eq!(s.authorization, Some(dir.path().join("policy.yaml")));
    // --listen keeps the first listener's settings, the default per address.
    let s = Settings::load_with_env(None, &["0.0.0.0:1883".parse().unwrap()], no_env()).unwrap();
    assert!(!s.listeners[0].allow_anonymous, "not on a public address");
}

#[test]
fn plaintext_passwords_and_pkcs12_are_refused() {
    let e = error_of(&listener_section(
        "v5.1",
        "listen = \"127.0.0.1:1\"\n",
        "[v5.1.connections.auth]\nalice = \"pw\"\n",
    ));
    assert!(
        e.contains("plain text") && e.contains("statebroker passwd"),
        "{e}"
    );
    let e = error_of(&listener_section(
        "v5.1",
        "listen = \"127.0.0.1:1\"\n",
        "[v5.1.tls]\npkcs12path = \"a.p12\"\npkcs12pass = \"x\"\n",
    ));
    assert!(e.contains("PKCS#12"), "{e}");
}

#[test]
fn faults_section() {
    use crate::faults::{DelaySpec, RuleSpec};
    let s = Settings::load_with_env(None, &[], no_env()).unwrap();
    assert!(!s.faults.enabled, "off by default");
    let f = file(
        r#"
[faults]
enabled = true
clock_offset_ms = -90000
[[faults.rules]]
commands = ["GET"]
keys = "slow*"
clients = "*"
delay_ms = 200
[[faults.rules]]
keys = "lazy*"
delay_ms = "50..500"
[[faults.rules]]
commands = ["SET"]
keys = "lost*"
drop_response = "after"
"#,
    );
    let s = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
    assert!(s.faults.enabled);
    assert_eq!(s.faults.clock_offset_ms, -90000);
    assert_eq!(
        s.faults.rules[0],
        RuleSpec {
            commands: vec!["GET".into()],
            keys: "slow*".into(),
            clients: "*".into(),
            delay_ms: Some(DelaySpec::Fixed(200)),
            ..RuleSpec::default()
        }
    );
    assert_eq!(
        s.faults.rules[1].delay_ms,
        Some(DelaySpec::Range("50..500".into()))
    );
    assert_eq!(s.faults.rules[2].drop_response.as_deref(), Some("after"));
    // Rules without `enabled`, and wrong rules, stop the start.
    let e = error_of("[[faults.rules]]\nerror = \"x\"\n");
    assert!(e.contains("enabled"), "{e}");
    let e = error_of("[faults]\nenabled = true\n[[faults.rules]]\nkeys = \"k\"\n");
    assert!(e.contains("faults.rules[0]: does nothing"), "{e}");
    let e = error_of("[faults]\nenabled = true\n[[faults.rules]]\ndelay = 5\n");
    assert!(e.contains("delay"), "{e}");
}

#[test]
fn allowed_hosts_are_names_in_lower_case() {
    let s = Settings::load_with_env(None, &[], no_env()).unwrap();
    assert!(s.http_options.allowed_hosts.is_empty(), "none by default");
    let f = file("[http]\nallowed_hosts = [\"Broker.Example.\", \"\", \"view-1.lan\"]\n");
    let s = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
    assert_eq!(
        s.http_options.allowed_hosts,
        ["broker.example", "view-1.lan"]
    );
    let env = vec![(
        "STATEBROKER__HTTP__ALLOWED_HOSTS".to_owned(),
        "a.example,B.example".to_owned(),
    )];
    let s = Settings::load_with_env(None, &[], env).unwrap();
    assert_eq!(s.http_options.allowed_hosts, ["a.example", "b.example"]);
    for bad in [
        "broker.example:9883",
        "http://broker.example",
        "*.example",
        "a..example",
        "a b",
    ] {
        let e = error_of(&format!("[http]\nallowed_hosts = [\"{bad}\"]\n"));
        assert!(e.contains("http.allowed_hosts") && e.contains(bad), "{e}");
    }
    // Only a restart applies it: SIGHUP refuses it by name.
    let running = Settings::load_with_env(Some(&file("")), &[], no_env()).unwrap();
    let f = file("[http]\nallowed_hosts = [\"broker.example\"]\n");
    let new = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
    assert_eq!(running.needs_restart(&new), vec!["[http]"]);
}

#[test]
fn http_bounds() {
    let s = Settings::load_with_env(None, &[], no_env()).unwrap();
    let o = &s.http_options;
    assert_eq!(
        (o.max_connections, o.header_timeout, o.idle_timeout),
        (256, Duration::from_secs(10), Duration::from_secs(60))
    );
    let env = vec![
        (
            "STATEBROKER__HTTP__MAX_CONNECTIONS".to_owned(),
            "8".to_owned(),
        ),
        (
            "STATEBROKER__HTTP__IDLE_TIMEOUT_MS".to_owned(),
            "500".to_owned(),
        ),
    ];
    let new = Settings::load_with_env(None, &[], env).unwrap();
    assert_eq!(new.http_options.max_connections, 8);
    assert_eq!(new.http_options.idle_timeout, Duration::from_millis(500));
    assert_eq!(s.needs_restart(&new), vec!["[http]"]);
    for key in ["max_connections", "header_timeout_ms", "idle_timeout_ms"] {
        let e = error_of(&format!("[http]\n{key} = 0\n"));
        assert!(e.contains(&format!("http.{key}")), "{e}");
    }
}

#[test]
fn clustering_is_off_by_default_and_on_with_endpoints() {
    let s = Settings::load_with_env(None, &[], no_env()).unwrap();
    assert_eq!(s.clustering, None);
    let env = vec![
        (
            "STATEBROKER__CLUSTERING__NODE_ID".to_owned(),
            "sb2".to_owned(),
        ),
        (
            "STATEBROKER__CLUSTERING__ETCD_ENDPOINTS".to_owned(),
            "http://127.0.0.1:2379, http://127.0.0.1:2479".to_owned(),
        ),
        (
            "STATEBROKER__CLUSTERING__ETCD_PREFIX".to_owned(),
            "/sb/a".to_owned(),
        ),
    ];
    let s = Settings::load_with_env(None, &[], env).unwrap();
    let c = s.clustering.clone().expect("clustering on");
    assert_eq!(c.node_id, "sb2");
    assert_eq!(
        c.etcd_endpoints,
        ["http://127.0.0.1:2379", "http://127.0.0.1:2479"]
    );
    assert_eq!(c.etcd_prefix, "/sb/a/", "the prefix ends in /");
    assert_eq!(c.request_timeout, Duration::from_millis(2000));
    assert_eq!(c.tombstone_ttl, Duration::from_secs(70));
    assert!(c.keep_queued_in_etcd, "on by default");
    // The cluster's node id is the versions' node id, and no clock marks
    // go to a data directory that holds no keys.
    let store = s.store_config();
    assert_eq!(store.node_id, "sb2");
    assert_eq!(store.clock_lease_ms, None);
}

#[test]
fn queued_messages_can_stay_out_of_etcd() {
    let env = [
        ("NODE_ID", "sb1"),
        ("ETCD_ENDPOINTS", "http://127.0.0.1:2379"),
        ("KEEP_QUEUED_IN_ETCD", "false"),
    ]
    .map(|(k, v)| (format!("STATEBROKER__CLUSTERING__{k}"), v.to_owned()));
    let s = Settings::load_with_env(None, &[], env.to_vec()).unwrap();
    assert!(!s.clustering.expect("clustering on").keep_queued_in_etcd);
}

#[test]
fn bad_clustering_settings_are_refused_by_name() {
    let refused = |toml: &str| {
        let f = file(toml);
        Settings::load_with_env(Some(&f), &[], no_env())
            .unwrap_err()
            .to_string()
    };
    let e = refused("[clustering]\nnode_id = \"sb1\"\n");
    assert!(e.contains("clustering.etcd_endpoints is empty"), "{e}");
    let e = refused("[clustering]\netcd_endpoints = [\"http://127.0.0.1:2379\"]\n");
    assert!(e.contains("clustering.node_id must be set"), "{e}");
    let e =
        refused("[clustering]\nnode_id = \"a:b\"\netcd_endpoints = [\"http://127.0.0.1:2379\"]\n");
    assert!(e.contains("without ':', '/'"), "{e}");
    // A line break separates the entries of a session's owner record.
    for id in ["sb4\\nqueue", "sb\\t1", "a\\u0000b"] {
        let e = refused(&format!(
            "[clustering]\nnode_id = \"{id}\"\netcd_endpoints = [\"http://127.0.0.1:2379\"]\n"
        ));
        assert!(e.contains("control characters"), "{id}: {e}");
    }
    let e = refused("[clustering]\nnode_id = \"a\"\netcd_endpoints = [\"127.0.0.1:2379\"]\n");
    assert!(e.contains("not an etcd client URL"), "{e}");
    let e = refused(
        "[clustering]\nnode_id = \"a\"\netcd_endpoints = [\"http://h:2379\"]\ntombstone_ttl_s = 5\n",
    );
    assert!(e.contains("tombstone_ttl_s must be at least"), "{e}");
    for ttl in [0, 500, 2500] {
        let e = refused(&format!(
            "[clustering]\nnode_id = \"a\"\netcd_endpoints = [\"http://h:2379\"]\nlease_ttl_ms = {ttl}\n"
        ));
        assert!(e.contains("lease_ttl_ms must be whole seconds"), "{e}");
    }
    for address in ["sb1", ":1883", "sb1:port", "sb1:70000"] {
        let e = refused(&format!(
            "[clustering]\nnode_id = \"a\"\netcd_endpoints = [\"http://h:2379\"]\npeer_address = \"{address}\"\n"
        ));
        assert!(e.contains("is not host:port"), "{address}: {e}");
    }
    let e = refused(
        "[clustering]\nnode_id = \"a\"\netcd_endpoints = [\"http://h:2379\"]\nforward_queue = 0\n",
    );
    assert!(e.contains("forward_queue must be at least 1"), "{e}");
    let e = refused(
        "[clustering]\nnode_id = \"a\"\netcd_endpoints = [\"http://h:2379\"]\nsession_reap_interval_s = 0\n",
    );
    assert!(
        e.contains("session_reap_interval_s must be at least 1"),
        "{e}"
    );
    let e = refused("[cluster]\nid = 1\n");
    assert!(e.contains("configured in [clustering]"), "{e}");
}
