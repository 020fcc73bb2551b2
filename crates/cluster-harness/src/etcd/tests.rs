use super::*;

#[test]
fn a_taken_port_is_a_clash_to_retry() {
    let etcd = process::find_on_path("etcd", ETCD_HINT).unwrap();
    let etcdctl = process::find_on_path("etcdctl", ETCD_HINT).unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let options = EtcdOptions::default();
    let ports = [
        (free_port(), free_port()),
        (port, free_port()),
        (free_port(), free_port()),
    ];
    let t = Instant::now();
    match EtcdCluster::try_start(&ports, &options, &etcd, &etcdctl) {
        Err(StartError::PortClash(e)) => {
            assert!(e.to_string().contains("etcd member m2 exited"), "{e}");
            println!("clash seen after {:?}: {e}", t.elapsed());
        }
        Err(StartError::Other(e)) => panic!("not seen as a clash: {e}"),
        Ok(_) => panic!("started on a taken port"),
    }
    assert!(t.elapsed() < Duration::from_secs(20));
}

#[test]
fn base64() {
    assert_eq!(base64_decode("").unwrap(), b"");
    assert_eq!(base64_decode("dg==").unwrap(), b"v");
    assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
    assert_eq!(base64_decode("aGVsbG8h").unwrap(), b"hello!");
    // What etcdctl printed for the value `-value`.
    assert_eq!(base64_decode("LXZhbHVl").unwrap(), b"-value");
    assert!(base64_decode("a-b").is_err());
    // The URL-safe alphabet and missing padding are not what etcdctl prints.
    assert!(base64_decode("aGVsbG8_").is_err());
    let e = base64_decode("aGVsbG8").unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    assert!(e.to_string().contains("not base64"), "{e}");
}

#[test]
fn a_zap_timestamp_is_read_to_the_millisecond() {
    let at = parse_ts("2026-11-27T23:29:07.987Z").unwrap();
    let since = at.duration_since(SystemTime::UNIX_EPOCH).unwrap();
    // date -u -d 2026-11-27T23:29:07Z +%s
    assert_eq!(since.as_secs(), 1_795_822_147);
    assert_eq!(since.subsec_millis(), 987);
    assert_eq!(
        parse_ts("1970-01-01T00:00:00.000Z"),
        Some(SystemTime::UNIX_EPOCH)
    );
    assert_eq!(parse_ts("not a time"), None);
}
