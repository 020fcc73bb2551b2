//! Nodes: any binary as a child process (here etcd and sh stand in for the
//! broker, which this crate does not build).

use std::time::{Duration, Instant};

use statebroker_cluster_harness::{Node, NodeSpec, ProcState, free_port, wait_tcp};

/// A single etcd as an arbitrary server binary listening on `port`.
fn server(port: u16) -> NodeSpec {
    NodeSpec::new(etcd_path())
        .name("server")
        .arg("--data-dir={dir}/data")
        .arg(format!("--listen-client-urls=http://127.0.0.1:{port}"))
        .arg(format!("--advertise-client-urls=http://127.0.0.1:{port}"))
        .arg(format!(
            "--listen-peer-urls=http://127.0.0.1:{}",
            free_port()
        ))
        .env_remove("ETCD_NAME")
}

fn etcd_path() -> String {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
        .expect(
            "etcd is not on PATH: the cluster tests need etcd 3.4 (apt-get install etcd-server)",
        )
        .to_string_lossy()
        .into_owned()
}

fn stat_state(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    stat[stat.rfind(')').unwrap() + 1..]
        .trim_start()
        .chars()
        .next()
        .unwrap()
}

/// Whether a live process `pid` has `dir` on its command line.
fn mentions(pid: u32, dir: &std::path::Path) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&*dir.to_string_lossy()))
}

#[test]
fn a_node_is_killed_paused_resumed_and_restarted() {
    let port = free_port();
    let mut node = server(port).start().unwrap();
    let t = Instant::now();
    node.wait_tcp(port, Duration::from_secs(20)).unwrap();
    println!("listening after {:.2} s", t.elapsed().as_secs_f64());
    assert!(node.dir().join("data").is_dir(), "{{dir}} was not replaced");
    let dir = node.dir().to_owned();
    let first = node.pid().unwrap();

    node.pause().unwrap();
    assert_eq!(node.state(), ProcState::Paused);
    assert_eq!(stat_state(first), 'T');
    node.resume().unwrap();
    assert_eq!(node.state(), ProcState::Running);
    assert_ne!(stat_state(first), 'T');

    node.kill().unwrap();
    assert_eq!(node.state(), ProcState::Down);
    assert!(node.pause().is_err());
    assert!(!mentions(first, &dir), "pid {first} survived the kill");

    node.restart().unwrap();
    let second = node.pid().unwrap();
    assert_ne!(first, second);
    assert_eq!(node.starts(), 2);
    node.wait_tcp(port, Duration::from_secs(20)).unwrap();
    let log = std::fs::read_to_string(node.log_path()).unwrap();
    assert_eq!(
        log.matches("statebroker-cluster-harness: start #").count(),
        2
    );
    assert!(!node.log_tail(5).is_empty());

    // SIGTERM: etcd exits by itself.
    let status = node.stop(Duration::from_secs(10)).unwrap();
    assert!(status.is_some());
    assert_eq!(node.state(), ProcState::Down);

    node.restart().unwrap();
    let third = node.pid().unwrap();
    drop(node);
    assert!(!mentions(third, &dir), "pid {third} survived the drop");
    if !statebroker_cluster_harness::keep_files() {
        assert!(!dir.exists());
    }
}

#[test]
fn wait_tcp_gives_up_when_the_node_exits() {
    let mut node = NodeSpec::new("/bin/sh")
        .name("crasher")
        .args(["-c", "echo \"boom in $PWD with $GREETING\" >&2; exit 3"])
        .env("GREETING", "hi from {dir}")
        .start()
        .unwrap();
    let t = Instant::now();
    let err = node
        .wait_tcp(free_port(), Duration::from_secs(20))
        .unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    let message = err.to_string();
    assert!(message.contains("exit status: 3"), "{message}");
    let dir = node.dir().to_string_lossy().into_owned();
    assert!(
        message.contains(&format!("boom in {dir} with hi from {dir}")),
        "{message}"
    );
    assert!(node.exit_status().is_some());
    assert_eq!(node.state(), ProcState::Down);
}

#[test]
fn wait_tcp_times_out_on_a_closed_port() {
    let t = Instant::now();
    let err = wait_tcp(free_port(), Duration::from_millis(300)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn free_ports_are_not_repeated() {
    let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
    let unique: std::collections::HashSet<_> = ports.iter().collect();
    assert_eq!(unique.len(), ports.len());
}

#[test]
fn a_given_dir_is_kept() {
    let keep = tempfile::tempdir().unwrap();
    let dir = keep.path().join("n1");
    let mut node: Node = NodeSpec::new("/bin/sh")
        .args(["-c", "touch {dir}/marker; exec sleep 60"])
        .dir(&dir)
        .start()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !dir.join("marker").exists() {
        assert!(Instant::now() < deadline, "{}", node.log_tail(10));
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(node.dir(), dir);
    node.kill().unwrap();
    drop(node);
    assert!(dir.join("node.log").exists());
}
