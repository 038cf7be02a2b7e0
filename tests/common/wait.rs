//! Waiting for something to happen: bounded, and loud at its limit.
//!
//! A test that waits says what it waits for, and when the limit passes first it fails naming
//! that (and what the last look saw) instead of going on as if it had happened: a wait that
//! gives up silently lets a test pass without the thing its name promises. Limits are generous
//! (a busy machine is slow, never wrong); how long anything took is never asserted here, only
//! that it happened.
//!
//! - [`until`]: a condition, looked at again and again (a status, a counter, a log line);
//!   [`until_showing`] adds what to show when it fails, [`poll`] hands the failure back to a
//!   test that must set something right before it panics, and [`until_blocking`] /
//!   [`poll_blocking`] look from a plain thread.
//! - [`within`]: one future (a reply, a child's exit, the next line of output).
//! - [`next_matching`] and [`collect_until`]: a stream (events, signals) up to what it waits
//!   for.
//!
//! ```ignore
//! wait::until("q1 runs", WITHIN, || async { running(client, "q1").await }).await;
//! let result = wait::until("the result of q1", WITHIN, || client.result("q1", false)).await;
//! let first = wait::within("the first event", WITHIN, events.next()).await;
//! ```
//!
//! A check is a closure that returns a future (`|| async { .. }`), not an async closure: the
//! future of an async closure is not `Send` for every lifetime, so a wait on one could not run
//! inside a spawned task. A check that keeps state between looks holds it in a `Cell`.

use std::fmt::{Debug, Display};
use std::future::Future;
use std::time::{Duration, Instant};

/// How long to pause between two looks: short, since every look is a cheap local round trip.
const PAUSE: Duration = Duration::from_millis(20);

/// What a look answers: there (with what it found), or not yet (with what it saw instead, for
/// the failure message).
pub trait Check {
    type Found;
    fn found(self) -> Result<Self::Found, String>;
}

impl Check for bool {
    type Found = ();
    fn found(self) -> Result<(), String> {
        if self { Ok(()) } else { Err("false".into()) }
    }
}

impl<T> Check for Option<T> {
    type Found = T;
    fn found(self) -> Result<T, String> {
        self.ok_or_else(|| "nothing yet".into())
    }
}

impl<T, E: Display> Check for Result<T, E> {
    type Found = T;
    fn found(self) -> Result<T, String> {
        self.map_err(|e| e.to_string())
    }
}

/// Looks (`check`) again and again until it finds what `what` names, and returns what it found;
/// panics naming `what` and the last thing it saw if `within` passes first. The check runs at
/// least once.
pub async fn until<C: Check, F: Future<Output = C>>(
    what: &str,
    within: Duration,
    check: impl FnMut() -> F,
) -> C::Found {
    until_showing(what, within, check, String::new).await
}

/// [`until`], whose failure also shows what `show` gives then (a process's log, say).
pub async fn until_showing<C: Check, F: Future<Output = C>>(
    what: &str,
    within: Duration,
    check: impl FnMut() -> F,
    show: impl FnOnce() -> String,
) -> C::Found {
    match poll(what, within, check).await {
        Ok(found) => found,
        Err(failure) => match show() {
            shown if shown.is_empty() => panic!("{failure}"),
            shown => panic!("{failure}\n{shown}"),
        },
    }
}

/// [`until`] for a test that must set something right before it fails (bring back a server
/// that a blocked start waits on, say): what the check found, or the failure to panic with.
pub async fn poll<C: Check, F: Future<Output = C>>(
    what: &str,
    within: Duration,
    mut check: impl FnMut() -> F,
) -> Result<C::Found, String> {
    let deadline = Instant::now() + within;
    loop {
        let last = match check().await.found() {
            Ok(found) => return Ok(found),
            Err(last) => last,
        };
        if Instant::now() >= deadline {
            return Err(format!(
                "{what}: not within {within:?}; the last look saw: {last}"
            ));
        }
        tokio::time::sleep(PAUSE).await;
    }
}

/// [`until`] for a check that blocks (a child process, a std channel), on this thread.
pub fn until_blocking<C: Check>(
    what: &str,
    within: Duration,
    check: impl FnMut() -> C,
) -> C::Found {
    poll_blocking(what, within, check).unwrap_or_else(|failure| panic!("{failure}"))
}

/// [`poll`] for a check that blocks, on this thread.
pub fn poll_blocking<C: Check>(
    what: &str,
    within: Duration,
    mut check: impl FnMut() -> C,
) -> Result<C::Found, String> {
    let deadline = Instant::now() + within;
    loop {
        let last = match check().found() {
            Ok(found) => return Ok(found),
            Err(last) => last,
        };
        if Instant::now() >= deadline {
            return Err(format!(
                "{what}: not within {within:?}; the last look saw: {last}"
            ));
        }
        std::thread::sleep(PAUSE);
    }
}

/// What `future` gives, or a panic naming `what` if it takes longer than `within`.
pub async fn within<T>(what: &str, within: Duration, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(within, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {within:?}"))
}

/// The items of `stream` up to and including the first that `last` picks, or a panic naming
/// `what` (and what came) if the stream ends or `within` passes first.
pub async fn collect_until<S>(
    what: &str,
    within: Duration,
    stream: &mut S,
    mut last: impl FnMut(&S::Item) -> bool,
) -> Vec<S::Item>
where
    S: futures_util::Stream + Unpin,
    S::Item: Debug,
{
    use futures_util::StreamExt;
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(item)) => {
                let done = last(&item);
                seen.push(item);
                if done {
                    return seen;
                }
            }
            Ok(None) => panic!("the stream ended before {what}; it gave: {seen:?}"),
            Err(_) => panic!("{what}: not within {within:?}; the stream gave: {seen:?}"),
        }
    }
}

/// What `pick` makes of the first item of `stream` it takes (those before are passed over),
/// or a panic naming `what` if the stream ends or `within` passes first.
pub async fn next_matching<S, T>(
    what: &str,
    within: Duration,
    stream: &mut S,
    mut pick: impl FnMut(S::Item) -> Option<T>,
) -> T
where
    S: futures_util::Stream + Unpin,
{
    use futures_util::StreamExt;
    let deadline = tokio::time::Instant::now() + within;
    let mut passed = 0;
    loop {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(item)) => match pick(item) {
                Some(found) => return found,
                None => passed += 1,
            },
            Ok(None) => panic!("the stream ended before {what} ({passed} other items came)"),
            Err(_) => {
                panic!("{what}: not within {within:?} ({passed} other items came)")
            }
        }
    }
}
