//! Counts failed backend calls by kind, around any [`LlmBackend`].

use std::sync::Arc;

use futures_util::StreamExt;

use super::Metrics;
use crate::llm::{ChatRequest, ChatStream, Continuation, LlmBackend, LlmError};

pub struct MeteredBackend {
    inner: Arc<dyn LlmBackend>,
    metrics: Arc<Metrics>,
}

impl MeteredBackend {
    pub fn new(inner: Arc<dyn LlmBackend>, metrics: Arc<Metrics>) -> Self {
        MeteredBackend { inner, metrics }
    }
}

pub fn error_kind(error: &LlmError) -> &'static str {
    match error {
        LlmError::ToolsRejected(_) => "tools_rejected",
        LlmError::SystemRejected(_) => "system_rejected",
        LlmError::Backend(_) => "backend_reported",
        LlmError::Http { .. } => "http",
        LlmError::Transport(_) => "transport",
        LlmError::Idle(_) => "idle",
        LlmError::StreamBroken(_) => "stream_broken",
        LlmError::Protocol(_) => "protocol",
    }
}

impl LlmBackend for MeteredBackend {
    fn chat_stream(&self, request: ChatRequest) -> ChatStream {
        let metrics = self.metrics.clone();
        self.inner
            .chat_stream(request)
            .inspect(move |item| {
                if let Err(error) = item {
                    metrics.observe_backend_error(error_kind(error));
                }
            })
            .boxed()
    }

    fn continuation(&self) -> Continuation {
        self.inner.continuation()
    }
}
