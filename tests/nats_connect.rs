//! `client::connect` against real nats-servers: every authentication method, TLS and mutual TLS,
//! settings errors, reconnection after a server restart, and a worker that starts before its
//! server.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::Client;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use common::nats::{NatsServer, free_port};
use common::wait;
use futures_util::StreamExt;
use genfleet::client::connect::{ConnectError, ConnectPurpose, connect};
use genfleet::protocol::ids::new_id;
use genfleet::settings::{NatsSettings, Settings};
use nkeys::KeyPair;
use serde_json::{Value, json};

/// The bound on every wait in this file.
const WAIT: Duration = Duration::from_secs(10);

fn settings(url: &str) -> NatsSettings {
    let mut s = Settings::defaults().nats;
    s.url = url.into();
    s.connect_timeout_ms = 2_000;
    s
}

/// `connect`, bounded.
async fn try_connect(s: &NatsSettings, purpose: ConnectPurpose) -> Result<Client, ConnectError> {
    wait::within(
        "connect returns within the bound",
        WAIT,
        connect(s, purpose),
    )
    .await
}

async fn connect_ok(s: &NatsSettings) -> Client {
    try_connect(s, ConnectPurpose::Client)
        .await
        .unwrap_or_else(|e| panic!("connects: {e}"))
}

/// The error, checked to be one line that does not show `secret`.
async fn connect_err(s: &NatsSettings, secret: &str) -> ConnectError {
    let err = try_connect(s, ConnectPurpose::Client)
        .await
        .expect_err("the connection is refused");
    let text = err.to_string();
    assert!(!text.contains('\n'), "one line: {text}");
    assert!(secret.is_empty() || !text.contains(secret), "leaks: {text}");
    err
}

/// Proves the connection carries messages: it receives what it publishes.
async fn assert_round_trip(client: &Client) {
    let subject = format!("test.{}", new_id());
    let mut sub = client.subscribe(subject.clone()).await.unwrap();
    client.publish(subject, "ping".into()).await.unwrap();
    let message = wait::within("the message arrives within the bound", WAIT, sub.next())
        .await
        .expect("the subscription is open");
    assert_eq!(message.payload, "ping");
}

fn write(dir: &Path, name: &str, contents: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path.to_str().unwrap().to_string()
}

#[tokio::test]
async fn plain_connection_carries_messages_under_its_name() {
    let monitor = free_port();
    let server = NatsServer::start_with_config(&format!("http: \"127.0.0.1:{monitor}\"")).await;
    let mut s = settings(&server.url());
    s.name = "genfleet-connect-test".into();
    let client = connect_ok(&s).await;
    assert_round_trip(&client).await;

    let connz: Value = reqwest::get(format!("http://127.0.0.1:{monitor}/connz"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let names: Vec<&str> = connz["connections"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert!(names.contains(&"genfleet-connect-test"), "{connz}");
}

#[tokio::test]
async fn token_auth() {
    let server = NatsServer::start_with_config("authorization { token: \"right-token\" }").await;
    let mut s = settings(&server.url());
    s.token = "right-token".into();
    assert_round_trip(&connect_ok(&s).await).await;

    s.token = "wrong-token".into();
    let err = connect_err(&s, "wrong-token").await;
    assert!(matches!(err, ConnectError::Rejected { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains(&server.url()), "{text}");
    assert!(text.to_lowercase().contains("authorization"), "{text}");

    s.token.clear();
    let err = connect_err(&s, "").await;
    assert!(matches!(err, ConnectError::Rejected { .. }), "{err}");
}

#[tokio::test]
async fn user_and_password_auth() {
    let server = NatsServer::start_with_config(
        "authorization { user: \"alice\", password: \"right-password\" }",
    )
    .await;
    let mut s = settings(&server.url());
    s.user = "alice".into();
    s.password = "right-password".into();
    assert_round_trip(&connect_ok(&s).await).await;

    s.password = "wrong-password".into();
    let err = connect_err(&s, "wrong-password").await;
    assert!(matches!(err, ConnectError::Rejected { .. }), "{err}");
}

#[tokio::test]
async fn nkey_auth() {
    let user = KeyPair::new_user();
    let server = NatsServer::start_with_config(&format!(
        "authorization {{ users: [ {{ nkey: \"{}\" }} ] }}",
        user.public_key()
    ))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let seed = user.seed().unwrap();
    let mut s = settings(&server.url());
    s.nkey_seed_file = write(dir.path(), "user.nk", &format!("{seed}\n"));
    assert_round_trip(&connect_ok(&s).await).await;

    let stranger = KeyPair::new_user().seed().unwrap();
    s.nkey_seed_file = write(dir.path(), "stranger.nk", &stranger);
    let err = connect_err(&s, &stranger).await;
    assert!(matches!(err, ConnectError::Rejected { .. }), "{err}");

    // A public key where the seed belongs is caught before connecting.
    s.nkey_seed_file = write(dir.path(), "public.nk", &user.public_key());
    let err = connect_err(&s, "").await;
    assert!(err.to_string().starts_with("nats.nkey_seed_file "), "{err}");
}

/// A signed NATS JWT (header, claims, ed25519 signature of the two), as `nsc` would write.
fn nats_jwt(issuer: &KeyPair, subject: &str, name: &str, nats: Value) -> String {
    let header = URL_SAFE_NO_PAD.encode(json!({"typ": "JWT", "alg": "ed25519-nkey"}).to_string());
    let claims = json!({
        "jti": new_id(),
        "iat": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs(),
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let signed = format!("{header}.{}", URL_SAFE_NO_PAD.encode(claims.to_string()));
    let signature = issuer.sign(signed.as_bytes()).unwrap();
    format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature))
}

/// An operator-mode server: operator, one account preloaded in a memory resolver, and a `.creds`
/// file for one of its users.
#[tokio::test]
async fn credentials_file_auth() {
    let dir = tempfile::tempdir().unwrap();
    let operator = KeyPair::new_operator();
    let account = KeyPair::new_account();
    let user = KeyPair::new_user();
    let no_limit = json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": true, "conn": -1, "leaf": -1
    });
    let operator_jwt = nats_jwt(
        &operator,
        &operator.public_key(),
        "genfleet-test",
        json!({"type": "operator", "version": 2}),
    );
    let account_jwt = nats_jwt(
        &operator,
        &account.public_key(),
        "APP",
        json!({"type": "account", "version": 2, "limits": no_limit}),
    );
    let user_jwt = nats_jwt(
        &account,
        &user.public_key(),
        "worker",
        json!({"type": "user", "version": 2, "pub": {}, "sub": {},
               "subs": -1, "data": -1, "payload": -1}),
    );
    // JetStream in operator mode needs a system account.
    let system = KeyPair::new_account();
    let system_jwt = nats_jwt(
        &operator,
        &system.public_key(),
        "SYS",
        json!({"type": "account", "version": 2, "limits": no_limit}),
    );
    let operator_file = write(dir.path(), "operator.jwt", &operator_jwt);
    let server = NatsServer::start_with_config(&format!(
        "operator: \"{operator_file}\"\n\
         system_account: {system}\n\
         resolver: MEMORY\n\
         resolver_preload: {{\n  {system}: \"{system_jwt}\"\n  {account}: \"{account_jwt}\"\n}}",
        system = system.public_key(),
        account = account.public_key(),
    ))
    .await;
    let seed = user.seed().unwrap();
    let creds = format!(
        "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    );
    let mut s = settings(&server.url());
    s.credentials_file = write(dir.path(), "user.creds", &creds);
    assert_round_trip(&connect_ok(&s).await).await;

    // Without credentials the operator-mode server refuses.
    s.credentials_file.clear();
    let err = connect_err(&s, "").await;
    assert!(matches!(err, ConnectError::Rejected { .. }), "{err}");

    // A file that is not a creds file is named, and its contents are not shown.
    s.credentials_file = write(dir.path(), "broken.creds", &format!("{seed}\n"));
    let err = connect_err(&s, &seed).await;
    assert!(
        err.to_string().starts_with("nats.credentials_file "),
        "{err}"
    );
}

/// A test CA, a server certificate for 127.0.0.1 and localhost, and a client certificate.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyUsagePurpose,
        };
        let dir = tempfile::tempdir().unwrap();
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "genfleet test CA");
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        write(
            dir.path(),
            "ca.pem",
            &ca.self_signed(&ca_key).unwrap().pem(),
        );
        let issuer = Issuer::new(ca, ca_key);
        for (name, sans, usage) in [
            (
                "server",
                vec!["127.0.0.1".to_string(), "localhost".to_string()],
                ExtendedKeyUsagePurpose::ServerAuth,
            ),
            (
                "client",
                vec!["genfleet-worker".to_string()],
                ExtendedKeyUsagePurpose::ClientAuth,
            ),
        ] {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(sans).unwrap();
            params.distinguished_name.push(DnType::CommonName, name);
            params.extended_key_usages = vec![usage];
            params.use_authority_key_identifier_extension = true;
            let cert = params.signed_by(&key, &issuer).unwrap();
            write(dir.path(), &format!("{name}.pem"), &cert.pem());
            write(dir.path(), &format!("{name}-key.pem"), &key.serialize_pem());
        }
        Pki { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_str().unwrap().to_string()
    }

    fn server_tls(&self, verify_clients: bool) -> String {
        format!(
            "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: {verify_clients}\n  timeout: 2\n}}",
            self.path("server.pem"),
            self.path("server-key.pem"),
            self.path("ca.pem"),
        )
    }
}

#[tokio::test]
async fn tls_with_a_private_ca() {
    let pki = Pki::new();
    let server = NatsServer::start_with_config(&pki.server_tls(false)).await;
    let mut s = settings(&server.url());
    s.tls_ca_file = pki.path("ca.pem");
    s.tls_required = true;
    assert_round_trip(&connect_ok(&s).await).await;

    // The same through the name in the certificate, and with the CA alone implying TLS.
    s.url = format!("tls://localhost:{}", server.port());
    s.tls_required = false;
    assert_round_trip(&connect_ok(&s).await).await;

    // Without the CA the server's certificate is not trusted, and a worker does not wait for
    // that to change.
    s.tls_ca_file.clear();
    s.tls_required = true;
    let err = connect_err(&s, "").await;
    assert!(matches!(err, ConnectError::Tls { .. }), "{err}");
    let err = try_connect(&s, ConnectPurpose::Worker)
        .await
        .expect_err("untrusted");
    assert!(matches!(err, ConnectError::Tls { .. }), "{err}");
}

#[tokio::test]
async fn mutual_tls() {
    let pki = Pki::new();
    let server = NatsServer::start_with_config(&pki.server_tls(true)).await;
    let mut s = settings(&server.url());
    s.tls_ca_file = pki.path("ca.pem");
    s.tls_cert_file = pki.path("client.pem");
    s.tls_key_file = pki.path("client-key.pem");
    assert_round_trip(&connect_ok(&s).await).await;

    // Without a client certificate the server ends the handshake.
    s.tls_cert_file.clear();
    s.tls_key_file.clear();
    let err = connect_err(&s, "").await;
    assert!(matches!(err, ConnectError::Tls { .. }), "{err}");

    // Half a client identity is a settings error.
    s.tls_cert_file = pki.path("client.pem");
    let err = connect_err(&s, "").await;
    let text = err.to_string();
    assert!(
        text.contains("nats.tls_cert_file") && text.contains("nats.tls_key_file"),
        "{text}"
    );
}

#[tokio::test]
async fn settings_errors_name_the_settings() {
    // Nothing listens here; these fail before any connection attempt.
    let url = format!("nats://127.0.0.1:{}", free_port());
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing").to_str().unwrap().to_string();

    let mut s = settings(&url);
    s.token = "secret-token".into();
    s.nkey_seed_file = missing.clone();
    let err = connect_err(&s, "secret-token").await;
    assert!(matches!(err, ConnectError::ConflictingAuth(_)), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("nats.token") && text.contains("nats.nkey_seed_file"),
        "{text}"
    );

    let check = |tune: &dyn Fn(&mut NatsSettings), prefix: String| {
        let mut s = settings(&url);
        tune(&mut s);
        (s, prefix)
    };
    let cases = [
        check(
            &|s| s.nkey_seed_file = missing.clone(),
            format!("nats.nkey_seed_file {missing}: No such file"),
        ),
        check(
            &|s| s.credentials_file = missing.clone(),
            format!("nats.credentials_file {missing}: No such file"),
        ),
        check(
            &|s| s.tls_ca_file = missing.clone(),
            format!("nats.tls_ca_file {missing}: No such file"),
        ),
        check(
            &|s| {
                s.tls_ca_file = write(dir.path(), "empty.pem", "");
            },
            "nats.tls_ca_file".to_string(),
        ),
        check(
            &|s| {
                s.tls_cert_file = write(dir.path(), "cert.pem", "");
                s.tls_key_file = missing.clone();
            },
            "nats.tls_cert_file".to_string(),
        ),
    ];
    for (s, prefix) in cases {
        let err = connect_err(&s, "").await;
        assert!(
            matches!(err, ConnectError::File { .. }),
            "{prefix}: {err:?}"
        );
        assert!(err.to_string().starts_with(&prefix), "{prefix}: {err}");
    }
}

#[tokio::test]
async fn a_client_fails_fast_when_no_server_answers() {
    let mut server = NatsServer::start().await;
    server.kill().await;
    let err = connect_err(&settings(&server.url()), "").await;
    assert!(matches!(err, ConnectError::Unreachable { .. }), "{err}");
    assert!(
        err.to_string()
            .starts_with(&format!("cannot reach NATS at {}: ", server.url())),
        "{err}"
    );
}

#[tokio::test]
async fn a_worker_waits_for_a_server_that_starts_late() {
    let mut server = NatsServer::start().await;
    server.kill().await;
    let s = settings(&server.url());
    let mut pending = tokio::spawn(async move { connect(&s, ConnectPurpose::Worker).await });
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut pending)
            .await
            .is_err(),
        "a worker keeps waiting while no server answers"
    );
    server.restart().await;
    let client = wait::within(
        "the worker connects within the bound once the server is up",
        WAIT,
        pending,
    )
    .await
    .unwrap()
    .unwrap();
    assert_round_trip(&client).await;
}

#[tokio::test]
async fn a_worker_rejected_by_the_server_does_not_wait() {
    let server = NatsServer::start_with_config("authorization { token: \"right-token\" }").await;
    let mut s = settings(&server.url());
    s.token = "wrong-token".into();
    let err = try_connect(&s, ConnectPurpose::Worker)
        .await
        .expect_err("rejected");
    assert!(matches!(err, ConnectError::Rejected { .. }), "{err}");
}

/// Everything logged on this thread, for checking the connection-event log lines.
#[derive(Clone, Default)]
struct CapturedLog(Arc<Mutex<Vec<u8>>>);

impl CapturedLog {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for CapturedLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs on one thread (the default test runtime), so the thread's subscriber sees the events
/// async-nats hands to the connection's callback.
#[tokio::test]
async fn a_worker_resubscribes_after_the_server_restarts() {
    let log = CapturedLog::default();
    let writer = log.clone();
    let _guard = tracing::subscriber::set_default(
        tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish(),
    );
    let mut server = NatsServer::start().await;
    let worker = try_connect(&settings(&server.url()), ConnectPurpose::Worker)
        .await
        .unwrap();
    let subject = format!("test.{}", new_id());
    let mut sub = worker.subscribe(subject.clone()).await.unwrap();
    worker.flush().await.unwrap();

    server.kill().await;
    server.restart().await;

    // The worker reconnects and subscribes again on its own; publish until it hears.
    let publisher = server.client().await;
    let heard = wait::within(
        "the worker hears the restarted server within the bound",
        WAIT,
        async {
            loop {
                publisher
                    .publish(subject.clone(), "again".into())
                    .await
                    .unwrap();
                publisher.flush().await.unwrap();
                // Publishes again every 100 ms until the worker hears one: paces the
                // publisher, while the wait around it bounds the whole.
                if let Ok(message) =
                    tokio::time::timeout(Duration::from_millis(100), sub.next()).await
                {
                    return message;
                }
            }
        },
    )
    .await;
    assert_eq!(heard.expect("subscription open").payload, "again");
    assert_round_trip(&worker).await;

    let expected = [
        "connected to NATS",
        "disconnected from NATS",
        "reconnected to NATS",
    ];
    let logged = wait::until("the connection events to be logged", WAIT, || async {
        let text = log.text();
        if expected.iter().all(|line| text.contains(line)) {
            Ok(text)
        } else {
            Err(format!("the log:\n{text}"))
        }
    })
    .await;
    assert!(logged.contains(&server.url()), "{logged}");
}

#[tokio::test]
async fn jetstream_data_survives_a_restart() {
    let mut server = NatsServer::start().await;
    let js = async_nats::jetstream::new(server.client().await);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "SURVIVOR".into(),
        subjects: vec!["survivor.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    server.restart().await;
    let js = async_nats::jetstream::new(server.client().await);
    let stream = wait::within(
        "JetStream answers within the bound",
        WAIT,
        js.get_stream("SURVIVOR"),
    )
    .await;
    assert!(stream.is_ok(), "the stream is still there: {stream:?}");
}
