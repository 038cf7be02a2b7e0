//! How genfleet's HTTP servers (a worker's `/metrics` and health, the console, the gateway)
//! bind and serve an axum router: one way, so that all three stop alike.
//!
//! It knows nothing of genfleet: each server builds its router and decides when to stop, and
//! reports a failure in its own words (the console and the gateway to their caller, a
//! worker's server in its log, since nobody waits on it).

use std::future::Future;
use std::net::SocketAddr;

use axum::Router;
use tokio::net::TcpListener;

/// Binds `addr` and says where it listens (the port chosen when `addr` asked for port 0).
pub async fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

/// Serves `router` on `listener` until `shutdown` resolves, then takes no new connection and
/// returns once the open ones are done (a server that stops only when its task is aborted
/// passes [`std::future::pending`]).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}
