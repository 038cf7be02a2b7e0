//! One NATS connection built from `[nats]` settings: server list, authentication, TLS, timeouts
//! and connection-event logging.
//!
//! What happens when no server answers depends on who connects ([`ConnectPurpose`]): a worker
//! waits for the broker forever, so a fleet can start before it; a CLI command tries once and
//! fails with one line that says which server it could not reach. Once connected, both reconnect
//! forever with async-nats' backoff (immediately, then doubling from 2 ms up to 4 s).
//!
//! Everything a person can get wrong in the settings (two authentication methods, a missing seed
//! file, a CA file with no certificate) is checked before the first attempt and reported naming
//! the setting, never its secret value.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::rustls::pki_types::pem::PemObject;
use async_nats::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use async_nats::{ConnectErrorKind, ConnectOptions, Event, ServerAddr};

use crate::protocol::text::one_line;
use crate::settings::NatsSettings;

/// Used when `nats.connect_timeout_ms` is 0.
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Used when `nats.request_timeout_ms` is 0: a request without any timeout could hang forever.
const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The first pause of a worker waiting for its broker; it doubles up to [`MAX_STARTUP_DELAY`].
const FIRST_STARTUP_DELAY: Duration = Duration::from_millis(100);
const MAX_STARTUP_DELAY: Duration = Duration::from_secs(5);

/// Who is connecting, which decides what happens when no server answers at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectPurpose {
    /// A long-running worker: retries until a server answers (servers that cannot be reached,
    /// time out or do not resolve yet), so a fleet may start before its broker. A server that
    /// answers but rejects the credentials or the TLS handshake is a configuration error and
    /// ends the wait at once.
    Worker,
    /// A command that a person waits for: one attempt at each server, then a one-line error.
    Client,
}

/// Why no connection was made. Every variant renders as one line and never holds a secret.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// A setting is malformed or incomplete.
    #[error("invalid NATS settings: {0}")]
    Invalid(String),
    /// More than one authentication method is configured; the names of the settings.
    #[error(
        "invalid NATS settings: set at most one authentication method, found {}",
        .0.join(" and ")
    )]
    ConflictingAuth(Vec<&'static str>),
    /// A file a setting names cannot be read or does not hold what it should.
    #[error("nats.{key} {path}: {reason}")]
    File {
        key: &'static str,
        path: String,
        reason: String,
    },
    /// No server answered (refused, timed out, unknown host).
    #[error("cannot reach NATS at {url}: {reason}")]
    Unreachable { url: String, reason: String },
    /// A server answered and refused the credentials.
    #[error("NATS at {url} rejected the credentials: {reason}")]
    Rejected { url: String, reason: String },
    /// The TLS handshake failed (untrusted certificate, server without TLS, client certificate
    /// refused).
    #[error("TLS with NATS at {url} failed: {reason}")]
    Tls { url: String, reason: String },
}

/// Connects to the servers in `settings.url` as `settings` says.
///
/// With [`ConnectPurpose::Worker`] this returns only once connected (or on a configuration
/// error); dropping the future stops the waiting, so callers can race it against shutdown.
pub async fn connect(
    settings: &NatsSettings,
    purpose: ConnectPurpose,
) -> Result<async_nats::Client, ConnectError> {
    // The process shares one rustls crypto provider (ring) between NATS and the model client.
    let _ = async_nats::rustls::crypto::ring::default_provider().install_default();
    let servers = parse_servers(&settings.url)?;
    let shown = display_servers(&servers);
    let options = connect_options(settings, &servers, &shown).await?;
    match purpose {
        ConnectPurpose::Client => options
            .connect(servers.as_slice())
            .await
            .map_err(|error| classify(&shown, &error)),
        ConnectPurpose::Worker => wait_for_server(options, &servers, &shown).await,
    }
}

/// The worker's start: retries while no server answers. async-nats'
/// `retry_on_initial_connect` is not used because it hands back a client before any server is
/// reached (the JetStream set-up that follows would time out instead of waiting), keeps retrying
/// in a background task after the caller gave up, and retries rejected credentials forever.
async fn wait_for_server(
    options: ConnectOptions,
    servers: &[ServerAddr],
    shown: &str,
) -> Result<async_nats::Client, ConnectError> {
    let mut attempt: u32 = 0;
    loop {
        match options.clone().connect(servers).await {
            Ok(client) => return Ok(client),
            Err(error) if failure(&error) == Failure::Unreachable => {
                attempt = attempt.saturating_add(1);
                let delay = startup_delay(attempt);
                let retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
                let error = reason(&error);
                // Attempts 1, 10, 100 ... at warn: a long wait stays readable in the log.
                if is_power_of_ten(u64::from(attempt)) {
                    tracing::warn!(
                        message = "NATS is not reachable yet; still trying",
                        servers = %shown,
                        attempt,
                        retry_in_ms,
                        %error,
                    );
                } else {
                    tracing::debug!(
                        message = "NATS is not reachable yet; still trying",
                        servers = %shown,
                        attempt,
                        retry_in_ms,
                        %error,
                    );
                }
                tokio::time::sleep(delay).await;
            }
            Err(error) => return Err(classify(shown, &error)),
        }
    }
}

/// What went wrong, as far as the caller can act on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// No server answered: a server coming up later cures it.
    Unreachable,
    Rejected,
    Tls,
    BadUrl,
}

fn failure(error: &async_nats::ConnectError) -> Failure {
    match error.kind() {
        ConnectErrorKind::Authentication | ConnectErrorKind::AuthorizationViolation => {
            Failure::Rejected
        }
        ConnectErrorKind::Tls => Failure::Tls,
        ConnectErrorKind::ServerParse => Failure::BadUrl,
        // async-nats reports a failed handshake (untrusted certificate, client certificate
        // refused) as an I/O error; the rustls error inside tells them apart.
        _ if is_tls_failure(error) => Failure::Tls,
        _ => Failure::Unreachable,
    }
}

fn is_tls_failure(error: &async_nats::ConnectError) -> bool {
    let mut source = std::error::Error::source(error);
    while let Some(error) = source {
        if error.is::<async_nats::rustls::Error>() {
            return true;
        }
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && io
                .get_ref()
                .is_some_and(|inner| inner.is::<async_nats::rustls::Error>())
        {
            return true;
        }
        source = error.source();
    }
    false
}

/// The pause before start-up attempt `attempt + 1`: 100 ms doubling to 5 s.
fn startup_delay(attempt: u32) -> Duration {
    let factor = 1u32 << attempt.saturating_sub(1).min(16);
    FIRST_STARTUP_DELAY
        .saturating_mul(factor)
        .min(MAX_STARTUP_DELAY)
}

fn classify(shown: &str, error: &async_nats::ConnectError) -> ConnectError {
    let url = shown.to_string();
    let reason = reason(error);
    match failure(error) {
        Failure::Rejected => ConnectError::Rejected { url, reason },
        Failure::Tls => ConnectError::Tls { url, reason },
        Failure::BadUrl => ConnectError::Invalid(format!("nats.url {url}: {reason}")),
        Failure::Unreachable => ConnectError::Unreachable { url, reason },
    }
}

/// async-nats' message on one line, without the kind when a cause says more ("IO error: ",
/// "authorization violation: nats: authorization violation").
fn reason(error: &async_nats::ConnectError) -> String {
    let text = match std::error::Error::source(error) {
        Some(cause) => cause.to_string(),
        None => error.to_string(),
    };
    one_line(text.strip_prefix("nats: ").unwrap_or(&text))
}

/// `nats.url`: a comma-separated list; each entry is a URL or `host[:port]`.
fn parse_servers(urls: &str) -> Result<Vec<ServerAddr>, ConnectError> {
    let servers = urls
        .split(',')
        .map(str::trim)
        .filter(|url| !url.is_empty())
        .map(|url| {
            url.parse::<ServerAddr>().map_err(|error| {
                ConnectError::Invalid(format!(
                    "nats.url entry {:?}: {error}",
                    redact_user_info(url)
                ))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if servers.is_empty() {
        return Err(ConnectError::Invalid(
            "nats.url names no server (expected e.g. nats://127.0.0.1:4222)".into(),
        ));
    }
    Ok(servers)
}

/// The server list as it may be shown: any user info in a URL (a token or a password) is masked.
fn display_servers(servers: &[ServerAddr]) -> String {
    servers
        .iter()
        .map(|server| {
            let mut url = server.clone().into_inner();
            if !url.username().is_empty() || url.password().is_some() {
                // Both only fail for URLs that cannot carry credentials, which these did.
                let _ = url.set_username("***");
                let _ = url.set_password(None);
            }
            url.to_string()
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// For an entry that did not parse: drop everything between `://` and the last `@`.
fn redact_user_info(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    match rest.rsplit_once('@') {
        Some((_, host)) if scheme.is_empty() => format!("***@{host}"),
        Some((_, host)) => format!("{scheme}://***@{host}"),
        None => url.to_string(),
    }
}

/// The one way this connection proves who it is. No `Debug`: it holds secrets.
enum AuthMethod<'a> {
    None,
    /// Credentials inside a `nats.url` entry; async-nats sends them itself.
    InUrl,
    Token(&'a str),
    UserPassword(&'a str, &'a str),
    NkeySeedFile(&'a str),
    CredentialsFile(&'a str),
}

impl AuthMethod<'_> {
    #[cfg(test)]
    fn label(&self) -> &'static str {
        match self {
            AuthMethod::None => "none",
            AuthMethod::InUrl => "url",
            AuthMethod::Token(_) => "token",
            AuthMethod::UserPassword(..) => "user",
            AuthMethod::NkeySeedFile(_) => "nkey",
            AuthMethod::CredentialsFile(_) => "creds",
        }
    }
}

fn auth_method<'a>(
    settings: &'a NatsSettings,
    servers: &[ServerAddr],
) -> Result<AuthMethod<'a>, ConnectError> {
    if settings.user.is_empty() != settings.password.is_empty() {
        return Err(ConnectError::Invalid(
            "nats.user and nats.password must be set together".into(),
        ));
    }
    let mut found = Vec::new();
    if servers.iter().any(ServerAddr::has_user_pass) {
        found.push(("credentials in nats.url", AuthMethod::InUrl));
    }
    if !settings.token.is_empty() {
        found.push(("nats.token", AuthMethod::Token(&settings.token)));
    }
    if !settings.user.is_empty() {
        found.push((
            "nats.user/nats.password",
            AuthMethod::UserPassword(&settings.user, &settings.password),
        ));
    }
    if !settings.nkey_seed_file.is_empty() {
        found.push((
            "nats.nkey_seed_file",
            AuthMethod::NkeySeedFile(&settings.nkey_seed_file),
        ));
    }
    if !settings.credentials_file.is_empty() {
        found.push((
            "nats.credentials_file",
            AuthMethod::CredentialsFile(&settings.credentials_file),
        ));
    }
    if found.len() > 1 {
        return Err(ConnectError::ConflictingAuth(
            found.into_iter().map(|(name, _)| name).collect(),
        ));
    }
    Ok(found.pop().map_or(AuthMethod::None, |(_, method)| method))
}

async fn connect_options(
    settings: &NatsSettings,
    servers: &[ServerAddr],
    shown: &str,
) -> Result<ConnectOptions, ConnectError> {
    let mut options = ConnectOptions::new()
        .connection_timeout(millis_or(
            settings.connect_timeout_ms,
            DEFAULT_CONNECT_TIMEOUT,
        ))
        .request_timeout(Some(millis_or(
            settings.request_timeout_ms,
            DEFAULT_REQUEST_TIMEOUT,
        )))
        .max_reconnects(None)
        .custom_inbox_prefix(&settings.inbox_prefix)
        .event_callback(event_logger(shown, &settings.name));
    if !settings.name.is_empty() {
        options = options.name(&settings.name);
    }
    options = match auth_method(settings, servers)? {
        AuthMethod::None | AuthMethod::InUrl => options,
        AuthMethod::Token(token) => options.token(token.to_string()),
        AuthMethod::UserPassword(user, password) => {
            options.user_and_password(user.to_string(), password.to_string())
        }
        AuthMethod::NkeySeedFile(path) => options.nkey(read_nkey_seed(path).await?),
        AuthMethod::CredentialsFile(path) => {
            let contents = read_file("credentials_file", path).await?;
            let text = String::from_utf8(contents).map_err(|_| ConnectError::File {
                key: "credentials_file",
                path: path.to_string(),
                reason: "not a text file".into(),
            })?;
            options
                .credentials(&text)
                .map_err(|error| ConnectError::File {
                    key: "credentials_file",
                    path: path.to_string(),
                    reason: one_line(&error.to_string()),
                })?
        }
    };
    tls_options(settings, options).await
}

/// A configured CA or client certificate implies TLS, so a server that does not offer TLS is
/// refused instead of being used in the clear.
async fn tls_options(
    settings: &NatsSettings,
    mut options: ConnectOptions,
) -> Result<ConnectOptions, ConnectError> {
    let mut tls = settings.tls_required;
    if !settings.tls_ca_file.is_empty() {
        check_certificates("tls_ca_file", &settings.tls_ca_file).await?;
        options = options.add_root_certificates(PathBuf::from(&settings.tls_ca_file));
        tls = true;
    }
    match (
        settings.tls_cert_file.is_empty(),
        settings.tls_key_file.is_empty(),
    ) {
        (true, true) => {}
        (false, false) => {
            check_certificates("tls_cert_file", &settings.tls_cert_file).await?;
            check_private_key("tls_key_file", &settings.tls_key_file).await?;
            options = options.add_client_certificate(
                PathBuf::from(&settings.tls_cert_file),
                PathBuf::from(&settings.tls_key_file),
            );
            tls = true;
        }
        _ => {
            return Err(ConnectError::Invalid(
                "nats.tls_cert_file and nats.tls_key_file must be set together".into(),
            ));
        }
    }
    Ok(options.require_tls(tls))
}

fn millis_or(millis: u64, default: Duration) -> Duration {
    if millis == 0 {
        default
    } else {
        Duration::from_millis(millis)
    }
}

async fn read_file(key: &'static str, path: &str) -> Result<Vec<u8>, ConnectError> {
    tokio::fs::read(Path::new(path))
        .await
        .map_err(|error| ConnectError::File {
            key,
            path: path.to_string(),
            reason: error.to_string(),
        })
}

/// Reads a user NKey seed and checks its shape, so a public key, a JWT or an empty file is
/// reported here rather than as a failed signature at the server. The checksum is verified by
/// async-nats when it signs the server's nonce.
async fn read_nkey_seed(path: &str) -> Result<String, ConnectError> {
    let contents = read_file("nkey_seed_file", path).await?;
    let seed = std::str::from_utf8(&contents).unwrap_or_default().trim();
    if !is_user_seed_shaped(seed) {
        return Err(ConnectError::File {
            key: "nkey_seed_file",
            path: path.to_string(),
            reason: "not a user NKey seed (expected one line of 58 characters starting with SU)"
                .into(),
        });
    }
    Ok(seed.to_string())
}

fn is_user_seed_shaped(seed: &str) -> bool {
    seed.len() == 58
        && seed.starts_with("SU")
        && seed
            .bytes()
            .all(|b| b.is_ascii_uppercase() || (b'2'..=b'7').contains(&b))
}

async fn check_certificates(key: &'static str, path: &str) -> Result<(), ConnectError> {
    let contents = read_file(key, path).await?;
    let fail = |reason: String| ConnectError::File {
        key,
        path: path.to_string(),
        reason,
    };
    let certificates = CertificateDer::pem_slice_iter(&contents)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| fail(format!("not a PEM certificate file: {error}")))?;
    if certificates.is_empty() {
        return Err(fail("holds no PEM certificate".into()));
    }
    Ok(())
}

async fn check_private_key(key: &'static str, path: &str) -> Result<(), ConnectError> {
    let contents = read_file(key, path).await?;
    PrivateKeyDer::from_pem_slice(&contents)
        .map(drop)
        .map_err(|error| ConnectError::File {
            key,
            path: path.to_string(),
            reason: format!("holds no PEM private key: {error}"),
        })
}

/// Logs the connection's life. async-nats reports every (re)connection as `Connected`; the
/// first one is the connection, later ones are reconnections. A failed reconnect attempt comes
/// as `ClientError::Other`; during a long outage those are logged at warn only on attempts 1,
/// 10, 100 ... so the log stays readable, and at debug otherwise.
fn event_logger(
    shown: &str,
    name: &str,
) -> impl Fn(Event) -> std::future::Ready<()> + Send + Sync + 'static {
    let servers: Arc<str> = Arc::from(shown);
    let name: Arc<str> = Arc::from(name);
    let connects = AtomicU64::new(0);
    let failed_attempts = AtomicU64::new(0);
    move |event| {
        let servers = &*servers;
        let name = &*name;
        match event {
            Event::Connected => {
                failed_attempts.store(0, Ordering::Relaxed);
                if connects.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::info!(message = "connected to NATS", servers, name);
                } else {
                    tracing::info!(message = "reconnected to NATS", servers, name);
                }
            }
            Event::Disconnected => {
                tracing::warn!(
                    message = "disconnected from NATS; reconnecting",
                    servers,
                    name
                );
            }
            Event::ClientError(async_nats::ClientError::Other(error)) => {
                let attempt = failed_attempts.fetch_add(1, Ordering::Relaxed) + 1;
                if is_power_of_ten(attempt) {
                    tracing::warn!(
                        message = "NATS reconnect attempt failed; still trying",
                        servers,
                        name,
                        attempt,
                        error = %error.strip_prefix("nats: ").unwrap_or(&error),
                    );
                } else {
                    tracing::debug!(
                        message = "NATS reconnect attempt failed; still trying",
                        servers,
                        name,
                        attempt,
                        %error,
                    );
                }
            }
            Event::ClientError(error) => {
                tracing::warn!(message = "NATS client error", servers, name, %error);
            }
            Event::LameDuckMode => {
                tracing::warn!(
                    message =
                        "NATS server entered lame duck mode; it will close this connection soon",
                    servers,
                    name
                );
            }
            Event::SlowConsumer(sid) => {
                tracing::warn!(
                    message = "NATS slow consumer: messages for a subscription were dropped",
                    servers,
                    name,
                    sid
                );
            }
            Event::ServerError(error) => {
                tracing::error!(message = "NATS server error", servers, name, %error);
            }
            Event::Draining => {
                tracing::info!(message = "draining the NATS connection", servers, name);
            }
            Event::Closed => tracing::info!(message = "NATS connection closed", servers, name),
        }
        std::future::ready(())
    }
}

fn is_power_of_ten(mut n: u64) -> bool {
    while n >= 10 && n.is_multiple_of(10) {
        n /= 10;
    }
    n == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    type Tune = fn(&mut NatsSettings);

    fn settings() -> NatsSettings {
        crate::settings::Settings::defaults().nats
    }

    fn auth_of(tune: impl FnOnce(&mut NatsSettings)) -> Result<String, String> {
        let mut s = settings();
        tune(&mut s);
        let servers = parse_servers(&s.url).map_err(|e| e.to_string())?;
        auth_method(&s, &servers)
            .map(|m| m.label().to_string())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn one_auth_method_is_chosen() {
        let cases: [(&str, Tune); 6] = [
            ("none", |_| {}),
            ("token", |s| s.token = "t".into()),
            ("user", |s| {
                s.user = "u".into();
                s.password = "p".into();
            }),
            ("nkey", |s| s.nkey_seed_file = "/k".into()),
            ("creds", |s| s.credentials_file = "/c".into()),
            ("url", |s| s.url = "nats://u:p@127.0.0.1:4222".into()),
        ];
        for (want, tune) in cases {
            assert_eq!(auth_of(tune).unwrap(), want);
        }
    }

    #[test]
    fn conflicting_or_incomplete_auth_is_an_error_naming_the_settings() {
        let cases: [(Tune, &[&str]); 4] = [
            (
                |s| {
                    s.token = "secret-token".into();
                    s.nkey_seed_file = "/k".into();
                },
                &["nats.token", "nats.nkey_seed_file"],
            ),
            (
                |s| {
                    s.user = "u".into();
                    s.password = "secret-pw".into();
                    s.credentials_file = "/c".into();
                },
                &["nats.user/nats.password", "nats.credentials_file"],
            ),
            (
                |s| {
                    s.url = "nats://secret-token@127.0.0.1:4222".into();
                    s.token = "secret-token".into();
                },
                &["nats.url", "nats.token"],
            ),
            (|s| s.user = "u".into(), &["nats.user", "nats.password"]),
        ];
        for (tune, needles) in cases {
            let err = auth_of(tune).unwrap_err();
            for needle in needles {
                assert!(err.contains(needle), "{err} lacks {needle}");
            }
            assert!(!err.contains("secret"), "a secret leaked: {err}");
        }
    }

    #[test]
    fn server_lists() {
        let ok = |urls: &str| display_servers(&parse_servers(urls).unwrap());
        assert_eq!(ok("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(
            ok(" nats://a:1 , tls://b:2,"),
            "nats://a:1,tls://b:2",
            "entries are trimmed and empty ones skipped"
        );
        assert_eq!(ok("127.0.0.1:4333"), "nats://127.0.0.1:4333");
        assert_eq!(
            ok("nats://user:secret@127.0.0.1:4222"),
            "nats://***@127.0.0.1:4222"
        );
        for bad in ["", " , ", "http://127.0.0.1:4222", "nats://pw:secret@[::1"] {
            let err = parse_servers(bad).unwrap_err().to_string();
            assert!(err.contains("nats.url"), "{bad:?}: {err}");
            assert!(!err.contains("secret"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn startup_delays_double_to_a_cap() {
        let delays: Vec<u128> = (1..=9).map(|n| startup_delay(n).as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
        assert_eq!(startup_delay(u32::MAX), MAX_STARTUP_DELAY);
    }

    #[test]
    fn powers_of_ten() {
        let hits: Vec<u64> = (0..=1000).filter(|&n| is_power_of_ten(n)).collect();
        assert_eq!(hits, [1, 10, 100, 1000]);
    }

    #[test]
    fn seed_shape() {
        let seed = format!("SU{}", "A".repeat(56));
        assert!(is_user_seed_shaped(&seed));
        for bad in [
            "",
            "UABC",
            &format!("SA{}", "A".repeat(56)),
            &format!("su{}", "a".repeat(56)),
            &format!("SU{}", "1".repeat(56)),
        ] {
            assert!(!is_user_seed_shaped(bad), "{bad}");
        }
    }
}
