//! A helper for writing tool services: register a definition in KV bucket `GENFLEET_TOOLS` and
//! answer `tools.<name>` with a handler. Workers watch the bucket, so the tool becomes callable
//! as soon as it is registered and unknown again once it is withdrawn.

use std::future::Future;
use std::sync::Arc;

use futures_util::StreamExt;
use serde_json::Value;
use tracing::Instrument;

use super::BusError;
use super::reply::{CALL_ID_HEADER, JOB_NAME_HEADER, REQUEST_ID_HEADER, traceparent_of};
use super::streams::ensure_bucket;
use super::subjects::Subjects;
use crate::settings::Settings;
use crate::telemetry::{self, KeyValue};
use crate::tools::{Tool, ToolDefinition};

/// Who asked for a call, from the request headers.
#[derive(Debug, Clone, Default)]
pub struct CallContext {
    pub request_id: Option<String>,
    pub call_id: Option<String>,
    pub job_name: Option<String>,
}

/// The span of one call served, a child of the caller's tool-call span when traces are
/// exported (the worker sends its context as `traceparent`).
fn call_span(tool: &str, context: &CallContext, message: &async_nats::Message) -> tracing::Span {
    if !telemetry::exporting() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!("tool_call", otel.name = %format!("tool {tool}"));
    telemetry::set_parent(&span, traceparent_of(message).as_deref());
    let mut attributes = vec![KeyValue::new("gen_ai.tool.name", tool.to_string())];
    if let Some(id) = &context.request_id {
        attributes.push(KeyValue::new("genfleet.request_id", id.clone()));
    }
    if let Some(id) = &context.call_id {
        attributes.push(KeyValue::new("gen_ai.tool.call.id", id.clone()));
    }
    telemetry::annotate(&span, attributes);
    span
}

/// A registered, serving tool. Dropping it stops serving; [`ToolService::withdraw`] also
/// removes the registration.
pub struct ToolService {
    name: String,
    bucket: async_nats::jetstream::kv::Store,
    task: tokio::task::JoinHandle<()>,
}

impl ToolService {
    /// Checks `definition`, serves `tools.<name>` (queue group, so several instances share the
    /// load) and registers the definition. The handler gets the arguments object and answers
    /// `Ok(result)` or `Err(error)`; an error goes back to the model as the tool's result.
    pub async fn start<F, Fut>(
        client: async_nats::Client,
        settings: &Settings,
        definition: ToolDefinition,
        handler: F,
    ) -> Result<ToolService, BusError>
    where
        F: Fn(Value, CallContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, Value>> + Send + 'static,
    {
        Tool::new(definition.clone()).map_err(|e| BusError::Setup(e.to_string()))?;
        let js = async_nats::jetstream::new(client.clone());
        let bucket = ensure_bucket(
            &js,
            &settings.tools.bucket,
            1,
            std::time::Duration::ZERO,
            settings.jetstream.replicas,
        )
        .await?;
        let subject = Subjects::new(&settings.subjects).tool(&definition.name);
        let mut requests = client
            .queue_subscribe(
                subject.clone(),
                format!("genfleet-tool-{}", definition.name),
            )
            .await
            .map_err(|e| BusError::Setup(format!("cannot serve {subject}: {e}")))?;
        let handler = Arc::new(handler);
        let responder = client.clone();
        let tool = definition.name.clone();
        let task = tokio::spawn(async move {
            while let Some(message) = requests.next().await {
                let handler = handler.clone();
                let responder = responder.clone();
                let context = CallContext {
                    request_id: super::reply::header(&message, REQUEST_ID_HEADER),
                    call_id: super::reply::header(&message, CALL_ID_HEADER),
                    job_name: super::reply::header(&message, JOB_NAME_HEADER),
                };
                let span = call_span(&tool, &context, &message);
                tokio::spawn(async move {
                    let reply = match serde_json::from_slice::<Value>(&message.payload) {
                        Ok(arguments) => match handler(arguments, context).await {
                            Ok(result) => serde_json::json!({ "result": result }),
                            Err(error) => serde_json::json!({ "error": error }),
                        },
                        Err(e) => {
                            serde_json::json!({"error": {"code": "INVALID_ARGUMENTS", "message": e.to_string()}})
                        }
                    };
                    if let Some(reply_to) = message.reply {
                        let _ = responder
                            .publish(reply_to, serde_json::to_vec(&reply).expect("json").into())
                            .await;
                    }
                }.instrument(span));
            }
        });
        let body = serde_json::to_vec(&definition).expect("definitions serialize");
        bucket
            .put(&definition.name, body.into())
            .await
            .map_err(|e| BusError::Setup(format!("cannot register {}: {e}", definition.name)))?;
        tracing::info!(message = "tool registered and serving", tool = %definition.name);
        Ok(ToolService {
            name: definition.name,
            bucket,
            task,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Removes the registration and stops serving.
    pub async fn withdraw(self) -> Result<(), WithdrawError> {
        self.task.abort();
        self.bucket
            .delete(&self.name)
            .await
            .map_err(|source| WithdrawError {
                name: self.name.clone(),
                source,
            })
    }
}

impl Drop for ToolService {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A tool's registration could not be taken back.
#[derive(Debug, thiserror::Error)]
#[error("cannot withdraw {name}: {source}")]
pub struct WithdrawError {
    pub name: String,
    #[source]
    pub source: async_nats::jetstream::kv::DeleteError,
}
