//! The bus [`ToolRunner`]: a tool call is a request on `tools.<name>` answered by a tool
//! service, with headers that let the service correlate it.

use futures_util::FutureExt;
use futures_util::future::BoxFuture;

use super::subjects::Subjects;
use crate::tools::{ToolInvocation, ToolReply, ToolRunError, ToolRunner};

pub const REQUEST_ID_HEADER: &str = "Genfleet-Request-Id";
pub const CALL_ID_HEADER: &str = "Genfleet-Call-Id";
pub const JOB_NAME_HEADER: &str = "Genfleet-Job-Name";

#[derive(Clone)]
pub struct BusToolRunner {
    client: async_nats::Client,
    subjects: Subjects,
}

impl BusToolRunner {
    pub fn new(client: async_nats::Client, subjects: Subjects) -> Self {
        BusToolRunner { client, subjects }
    }
}

impl ToolRunner for BusToolRunner {
    fn run(&self, call: ToolInvocation) -> BoxFuture<'static, Result<ToolReply, ToolRunError>> {
        let client = self.client.clone();
        let subject = self.subjects.tool(&call.name);
        async move {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(REQUEST_ID_HEADER, call.request_id.as_str());
            headers.insert(CALL_ID_HEADER, call.call_id.as_str());
            if let Some(job) = &call.job_name {
                headers.insert(JOB_NAME_HEADER, job.as_str());
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
        .boxed()
    }
}
