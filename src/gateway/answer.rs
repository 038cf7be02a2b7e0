//! A completion's answer: what it needs besides its run, and the whole (non-streamed) answer
//! assembled once the chain ended. The streamed one is in [`super::stream`].

use std::sync::Arc;

use axum::response::{IntoResponse, Response};

use super::Shared;
use super::error::ApiError;
use super::mapping::Ending;
use super::openai::Completion;
use super::run::{Piece, Run};

/// The request id an answer puts in its response's extensions, for
/// [`REQUEST_ID_HEADER`](super::error::REQUEST_ID_HEADER).
#[derive(Clone)]
pub(super) struct RequestId(pub(super) String);

/// The request id put in the response's extensions by [`Answer`].
pub(super) fn response_id(response: &Response) -> String {
    response
        .extensions()
        .get::<RequestId>()
        .map(|r| r.0.clone())
        .unwrap_or_default()
}

/// What a completion's answer needs besides its run.
pub(super) struct Answer {
    pub(super) shared: Arc<Shared>,
    pub(super) id: String,
    pub(super) request_id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) tenant: String,
    pub(super) pool: String,
    pub(super) include_usage: bool,
    pub(super) _open: super::metrics::OpenGuard,
    /// The completion's span, open until the answer (a stream's last event included) is sent.
    pub(super) _span: tracing::Span,
}

impl Answer {
    /// The whole completion, once the chain ended. The run (and its cancel guard) lives in
    /// this future: a caller that hangs up drops it.
    pub(super) async fn whole(self, mut run: Run) -> Response {
        let (mut content, mut reasoning) = (String::new(), String::new());
        let end = loop {
            match run.next().await {
                Some(Piece::Text(text)) => content.push_str(&text),
                Some(Piece::Reasoning(text)) => reasoning.push_str(&text),
                Some(Piece::End(end)) => break end,
                None => unreachable!("a run ends with its End piece"),
            }
        };
        let mut response = match end.ending {
            Ending::Finish(finish) => {
                self.shared
                    .metrics
                    .answered(&self.tenant, &self.pool, finish, false);
                let completion = Completion::new(
                    self.id.clone(),
                    self.created,
                    self.model.clone(),
                    content,
                    reasoning,
                    end.tool_calls,
                    finish,
                    end.usage,
                );
                axum::Json(completion).into_response()
            }
            Ending::Error { status, kind, code } => {
                self.shared
                    .metrics
                    .answered(&self.tenant, &self.pool, code, false);
                ApiError::new(status, kind, code, end.message).into_response()
            }
        };
        response
            .extensions_mut()
            .insert(RequestId(self.request_id.clone()));
        response
    }
}
