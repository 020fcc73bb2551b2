//! The policy: its file shapes, principals, topics, keys and placeholders.

use super::*;

const POLICY: &str = r##"
apiVersion: mqttbroker.iotoperations.azure.com/v1
kind: BrokerAuthorization
metadata: { name: my-authz-policies }
spec:
  authorizationPolicies:
    cache: Enabled
    rules:
      - principals:
          clientIds: ["sensor-*"]
          attributes: [{ site: "site1", floor: "2" }]
        brokerResources:
          - method: Connect
          - method: Publish
            topics: ["telemetry/{principal.clientId}/#"]
          - method: Subscribe
            topics: ["commands/{principal.clientId}/+", "replies/#"]
        stateStoreResources:
          - keyType: Pattern
            keys: ["{principal.clientId}-*"]
            method: ReadWrite
          - keyType: String
            keys: ["shared-config"]
            method: Read
          - keyType: Binary
            keys: ["0001ff"]
            method: Write
      - principals:
          usernames: ["admin"]
        brokerResources:
          - method: Connect
            clientIds: ["admin-console"]
          - method: Subscribe
            topics: ["#"]
"##;

fn sensor(id: &str) -> Principal {
    Principal {
        client_id: id.to_owned(),
        ..Principal::default()
    }
}

fn admin(client_id: &str) -> Principal {
    Principal {
        client_id: client_id.to_owned(),
        username: Some("admin".to_owned()),
        ..Principal::default()
    }
}

#[test]
fn the_deployed_resource_is_read_as_is() {
    let p = Policy::parse(POLICY).unwrap();
    assert!(p.may_connect(&sensor("sensor-7")));
    assert!(!p.may_connect(&sensor("other")), "allow-only");
    assert!(p.may_connect(&admin("admin-console")));
    assert!(!p.may_connect(&admin("elsewhere")), "Connect clientIds");
    let attrs = Principal {
        client_id: "x".into(),
        attributes: [
            ("site".into(), "site1".into()),
            ("floor".into(), "2".into()),
        ]
        .into(),
        ..Principal::default()
    };
    assert!(p.may_connect(&attrs), "every attribute of one map");
    let half = Principal {
        attributes: [("site".into(), "site1".into())].into(),
        ..attrs.clone()
    };
    assert!(!p.may_connect(&half));
}

#[test]
fn json_and_shallower_documents() {
    let json = r#"{"authorizationPolicies": {"rules": [{"principals": {"usernames": ["u"]},
        "brokerResources": [{"method": "Connect"}]}]}}"#;
    let u = Principal {
        username: Some("u".into()),
        ..sensor("c")
    };
    assert!(Policy::parse(json).unwrap().may_connect(&u));
    let bare =
        "rules:\n  - principals: { clientIds: [c] }\n    brokerResources: [{ method: Connect }]\n";
    assert!(Policy::parse(bare).unwrap().may_connect(&sensor("c")));
}

#[test]
fn errors_name_the_place() {
    let e = Policy::parse("rules: [{ principals: {}, brokerResources: [] }]").unwrap_err();
    assert!(e.contains("rules[0].principals"), "{e}");
    let e = Policy::parse(
        "rules: [{ principals: { clientIds: [a] }, brokerResources: [{ method: Delete }] }]",
    )
    .unwrap_err();
    assert!(e.contains("Delete") || e.contains("method"), "{e}");
    let e = Policy::parse(
        "rules: [{ principals: { clientIds: [a] }, brokerResources: [{ method: Publish, topics: ['a/b#'] }] }]",
    )
    .unwrap_err();
    assert!(e.contains("brokerResources[0].topics"), "{e}");
    let e = Policy::parse(
        "rules: [{ principals: { clientIds: [a] }, stateStoreResources: [{ keyType: Binary, keys: [zz], method: Read }] }]",
    )
    .unwrap_err();
    assert!(e.contains("not hex"), "{e}");
    let e = Policy::parse("rules: [{ principals: { clientIds: [a] }, extra: 1 }]").unwrap_err();
    assert!(e.contains("extra"), "{e}");
    assert!(Policy::parse(": not yaml :").is_err());
}

#[test]
fn topics_with_placeholders_as_whole_levels() {
    let p = Policy::parse(POLICY).unwrap();
    let s = sensor("sensor-7");
    assert!(p.may_publish(&s, "telemetry/sensor-7/temp"));
    assert!(
        p.may_publish(&s, "telemetry/sensor-7"),
        "# covers the parent"
    );
    assert!(!p.may_publish(&s, "telemetry/sensor-8/temp"), "another's");
    assert!(!p.may_publish(&s, "commands/sensor-7/x"), "subscribe only");
    assert!(p.may_subscribe(&s, "commands/sensor-7/reboot"));
    assert!(p.may_subscribe(&s, "commands/sensor-7/+"));
    assert!(
        !p.may_subscribe(&s, "commands/sensor-7/#"),
        "wider than the rule"
    );
    assert!(
        !p.may_subscribe(&s, "commands/+/reboot"),
        "others' commands"
    );
    assert!(p.may_subscribe(&s, "replies/a/b"));
    assert!(
        p.may_subscribe(&s, "$share/g/replies/#"),
        "shared looked through"
    );
    // The admin's `#` does not reach $ topics.
    let a = admin("admin-console");
    assert!(p.may_subscribe(&a, "anything/at/all"));
    assert!(!p.may_subscribe(&a, "$SYS/broker/uptime"));
    // A placeholder without a value matches nothing.
    let nameless = Policy::parse(
        "rules: [{ principals: { clientIds: ['*'] }, brokerResources: [{ method: Publish, topics: ['u/{principal.username}'] }] }]",
    )
    .unwrap();
    assert!(!nameless.may_publish(&sensor("c"), "u/"));
    assert!(nameless.may_publish(&admin("c"), "u/admin"));
}

#[test]
fn keys_by_type_and_method() {
    let p = Policy::parse(POLICY).unwrap();
    let s = sensor("sensor-7");
    assert!(p.may_read(&s, b"sensor-7-state") && p.may_write(&s, b"sensor-7-state"));
    assert!(!p.may_read(&s, b"sensor-8-state"));
    assert!(p.may_read(&s, b"shared-config") && !p.may_write(&s, b"shared-config"));
    assert!(!p.may_read(&s, b"shared-config2"), "String is exact");
    assert!(p.may_write(&s, &[0x00, 0x01, 0xff]) && !p.may_read(&s, &[0x00, 0x01, 0xff]));
    // Glob characters in a client's own value are literal.
    let star = sensor("sensor-*");
    assert!(p.may_read(&star, b"sensor-*-x"));
    assert!(!p.may_read(&star, b"sensor-7-x"));
    let rules = KeyRules {
        policy: std::sync::Arc::new(p),
        principal: std::sync::Arc::new(s),
    };
    assert!(KeyAccess::may_read(&rules, b"sensor-7-a"));
}

#[test]
fn a_reload_with_an_error_keeps_the_policy_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.yaml");
    let rule = |id: &str| {
        format!(
            "rules: [{{ principals: {{ clientIds: [{id}] }}, brokerResources: [{{ method: Connect }}] }}]"
        )
    };
    std::fs::write(&path, rule("first")).unwrap();
    let authorizer = Authorizer::load(Some(&path)).unwrap();
    let allows = |id: &str| authorizer.current().unwrap().may_connect(&sensor(id));
    assert!(allows("first"));
    std::fs::write(&path, rule("second")).unwrap();
    assert_eq!(authorizer.switch(Some(&path)), Ok(Some(1)));
    assert!(allows("second") && !allows("first"));
    std::fs::write(&path, "rules: [{ principals: {} }]").unwrap();
    let e = authorizer.switch(Some(&path)).unwrap_err();
    assert!(e.contains("policy.yaml") && e.contains("principals"), "{e}");
    assert!(allows("second"), "the old policy stays");
    assert_eq!(authorizer.switch(None), Ok(None));
    assert!(
        authorizer.current().is_none(),
        "disabled: everything allowed"
    );
    assert!(Authorizer::load(None).unwrap().current().is_none());
}

#[test]
fn a_file_that_is_not_a_policy_is_not_echoed() {
    // A password file named as the policy by mistake: its hashes stay out
    // of the message (and so of the log).
    let hash = "$7$101$c2FsdHNhbHRzYWx0c2FsdA==$aGFzaGhhc2hoYXNoaGFzaGhhc2hoYXNoaGFzaGhhc2g=";
    let e = Policy::parse(&format!("alice:{hash}\nbob:{hash}\n")).unwrap_err();
    assert!(!e.contains("c2FsdHNhbHRz") && !e.contains("bob"), "{e}");
    assert!(e.contains("not a policy"), "{e}");
    // A wrong type deeper down: named, its text cut to its start.
    let long = "x".repeat(200);
    let e = Policy::parse(&format!(
        "rules: [{{ principals: {{ clientIds: ['a'] }}, brokerResources: \"{long}\" }}]"
    ))
    .unwrap_err();
    assert!(e.contains("invalid type") && e.contains("xxxx…"), "{e}");
    assert!(e.len() < 300, "{e}");
}
