//! The bus [`ToolRunner`]: a tool call is a request on `tools.<name>` answered by a tool
//! service, with headers that let the service correlate it.

use std::sync::Arc;
use std::time::Instant;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;

use crate::client::subjects::Subjects;
use crate::observe::Metrics;
use crate::tools::{ToolInvocation, ToolReply, ToolRunError, ToolRunner};

pub use crate::client::reply::{
    CALL_ID_HEADER, JOB_NAME_HEADER, REQUEST_ID_HEADER, TRACEPARENT_HEADER, traceparent_of,
};

#[derive(Clone)]
pub struct BusToolRunner {
    client: async_nats::Client,
    subjects: Subjects,
    metrics: Option<Arc<Metrics>>,
}

impl BusToolRunner {
    pub fn new(client: async_nats::Client, subjects: Subjects) -> Self {
        BusToolRunner {
            client,
            subjects,
            metrics: None,
        }
    }

    /// Times every call into `genfleet_tool_call_seconds`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }
}

/// Records a call's duration when it ends, however it ends: the engine drops the future on a
/// timeout or a cancellation, which counts as `abandoned`.
struct CallTimer {
    metrics: Option<Arc<Metrics>>,
    tool: String,
    started: Instant,
    outcome: &'static str,
}

impl CallTimer {
    fn finish(mut self, outcome: &'static str) {
        self.outcome = outcome;
    }
}

impl Drop for CallTimer {
    fn drop(&mut self) {
        if let Some(metrics) = &self.metrics {
            metrics.observe_tool_call(&self.tool, self.outcome, self.started.elapsed());
        }
    }
}

impl ToolRunner for BusToolRunner {
    fn run(&self, call: ToolInvocation) -> BoxFuture<'static, Result<ToolReply, ToolRunError>> {
        let client = self.client.clone();
        let subject = self.subjects.tool(&call.name);
        let timer = CallTimer {
            metrics: self.metrics.clone(),
            tool: call.name.clone(),
            started: Instant::now(),
            outcome: "abandoned",
        };
        async move {
            let reply = Self::call(client, subject, call).await;
            timer.finish(match &reply {
                Ok(ToolReply::Ok(_)) => "ok",
                Ok(ToolReply::Error(_)) => "error_reply",
                Err(_) => "failed",
            });
            reply
        }
        .boxed()
    }
}

impl BusToolRunner {
    async fn call(
        client: async_nats::Client,
        subject: String,
        call: ToolInvocation,
    ) -> Result<ToolReply, ToolRunError> {
        {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(REQUEST_ID_HEADER, call.request_id.as_str());
            headers.insert(CALL_ID_HEADER, call.call_id.as_str());
            if let Some(job) = &call.job_name {
                headers.insert(JOB_NAME_HEADER, job.as_str());
            }
            if let Some(traceparent) = &call.traceparent {
                headers.insert(TRACEPARENT_HEADER, traceparent.as_str());
            }
            let body = serde_json::to_vec(&call.arguments).expect("arguments serialize");
            let request = async_nats::Request::new()
                .headers(headers)
                .payload(body.into());
            let reply = client
                .send_request(subject, request)
                .await
                .map_err(|error| match error.kind() {
                    async_nats::RequestErrorKind::NoResponders => {
                        ToolRunError::NoResponders(call.name.clone())
                    }
                    _ => ToolRunError::Transport(error.to_string()),
                })?;
            let value: serde_json::Value = serde_json::from_slice(&reply.payload).map_err(|e| {
                ToolRunError::Transport(format!(
                    "tool {} answered with invalid JSON: {e}",
                    call.name
                ))
            })?;
            if let Some(error) = value.get("error") {
                return Ok(ToolReply::Error(error.clone()));
            }
            match value.get("result") {
                Some(result) => Ok(ToolReply::Ok(result.clone())),
                None => Err(ToolRunError::Transport(format!(
                    "tool {} answered without \"result\" or \"error\"",
                    call.name
                ))),
            }
        }
    }
}
