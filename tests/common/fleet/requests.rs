//! Requests as a test sends them: with an id of its own, sent again while the fleet cannot take
//! them yet (no free slot, a tool not registered yet), and polled until they end.

use std::future::Future;
use std::time::Duration;

use genfleet::actors::Accepted;
use genfleet::client::{Client, ClientError};
use genfleet::protocol::{ErrorCode, GenerationRequest, GenerationResult};

use crate::common::wait;

/// How long a request is sent again while a worker does not know its tools: a registration
/// reaches a worker's catalog (it follows the tools bucket) a moment after it is written.
const TOOLS_KNOWN_WITHIN: Duration = Duration::from_secs(20);

/// What a request answers while it runs (or waits for a slot): NOT_READY.
pub const RUNNING: &[Option<ErrorCode>] = &[Some(ErrorCode::NotReady)];
/// ... or NOT_FOUND before its record exists (a continuation a moment after its answer).
pub const RUNNING_OR_UNCLAIMED: &[Option<ErrorCode>] =
    &[Some(ErrorCode::NotReady), Some(ErrorCode::NotFound)];
/// ... or an error without a code (no worker answers yet).
pub const RUNNING_UNCLAIMED_OR_UNANSWERED: &[Option<ErrorCode>] =
    &[Some(ErrorCode::NotReady), Some(ErrorCode::NotFound), None];

/// A user request with the given id.
pub fn request(id: &str, text: &str) -> GenerationRequest {
    let mut request = GenerationRequest::user(text);
    request.request_id = Some(id.into());
    request
}

/// The terminal result of `id`, peeked (left stored), waiting (bounded) while it is not ready
/// or no worker answers.
pub async fn terminal(client: &Client, id: &str, within: Duration) -> GenerationResult {
    poll_result(client, id, within, |code| {
        !matches!(
            code,
            Some(ErrorCode::InvalidRequest) | Some(ErrorCode::Internal)
        )
    })
    .await
}

/// The terminal result of `id`, peeked (left stored), polled for up to `within` while the
/// answer is one of `pending` ([`RUNNING`] ...); any other answer fails the test.
pub async fn wait_result(
    client: &Client,
    id: &str,
    within: Duration,
    pending: &[Option<ErrorCode>],
) -> GenerationResult {
    poll_result(client, id, within, |code| pending.contains(&code)).await
}

async fn poll_result(
    client: &Client,
    id: &str,
    within: Duration,
    pending: impl Fn(Option<ErrorCode>) -> bool,
) -> GenerationResult {
    wait::until(&format!("the result of {id}"), within, || async {
        match client.result(id, false).await {
            Err(error) if !pending(error.code()) => panic!("{id}: no result: {error}"),
            answer => answer.map_err(|e| e.to_string()),
        }
    })
    .await
}

/// Reads and releases the result of `id`; a second read must find only the tombstone.
pub async fn take_exactly_once(client: &Client, id: &str) -> GenerationResult {
    let result = client
        .result(id, true)
        .await
        .unwrap_or_else(|e| panic!("{id}: {e}"));
    let again = client.result(id, true).await;
    assert!(
        matches!(&again, Err(e) if e.code() == Some(ErrorCode::NotFound)),
        "{id}: the result was there twice: {again:?}"
    );
    result
}

/// Submits `request` to `pool`, again every 50 ms for up to `within` while it is refused with
/// NO_SLOT_AVAILABLE (every slot busy, or no worker serving yet); fails the test otherwise.
pub async fn submit_until_accepted(
    client: &Client,
    pool: &str,
    request: &GenerationRequest,
    within: Duration,
) -> Accepted {
    let what = format!("a free slot for {:?}", request.request_id);
    wait::until(&what, within, || async {
        match client.submit(pool, request).await {
            Err(error) if error.code() != Some(ErrorCode::NoSlotAvailable) => {
                panic!("{:?} not accepted: {error}", request.request_id)
            }
            answer => answer.map_err(|e| e.to_string()),
        }
    })
    .await
}

/// Runs `request` on the default pool (waiting `wait` for its end), sent again while a worker
/// does not know its tools yet.
pub async fn run_when_tools_known(
    client: &Client,
    request: &GenerationRequest,
    wait: Duration,
) -> GenerationResult {
    when_tools_known(request, || client.run("default", request.clone(), wait)).await
}

/// Submits `request` to the default pool, sent again while a worker does not know its tools
/// yet.
pub async fn submit_when_tools_known(client: &Client, request: &GenerationRequest) -> Accepted {
    when_tools_known(request, || client.submit("default", request)).await
}

async fn when_tools_known<T, Sent>(request: &GenerationRequest, send: impl FnMut() -> Sent) -> T
where
    Sent: Future<Output = Result<T, ClientError>>,
{
    let what = format!(
        "a worker that knows the tools {:?} of {:?}",
        request.tools, request.request_id
    );
    let send = std::sync::Mutex::new(send);
    wait::until(&what, TOOLS_KNOWN_WITHIN, || {
        let sent = (send.lock().unwrap())();
        async move {
            match sent.await {
                Err(error)
                    if error.code() == Some(ErrorCode::InvalidRequest)
                        && error.to_string().contains("unknown tools") =>
                {
                    Err(error.to_string())
                }
                Err(error) => panic!(
                    "{:?} (tools {:?}) not taken: {error}",
                    request.request_id, request.tools
                ),
                Ok(done) => Ok(done),
            }
        }
    })
    .await
}
