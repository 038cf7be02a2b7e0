//! The fleet under load, as the load generator's clients see it: one NATS connection per
//! concurrent client (as separate callers would have), the subjects and the pool.

use std::time::Duration;

use anyhow::Context;
use futures_util::StreamExt;

use crate::client::connect::{self, ConnectPurpose};
use crate::client::subjects::Subjects;
use crate::settings::Settings;

pub struct Target {
    pub settings: Settings,
    pub subjects: Subjects,
    pub pool: String,
    /// One per concurrent client.
    pub connections: Vec<async_nats::Client>,
    /// How long one request may take, from its submit to its `finished` event.
    pub timeout: Duration,
    /// Prefix of every request id of this run, so its requests are told apart from others'.
    pub run_id: String,
}

impl Target {
    pub async fn connect(
        settings: Settings,
        pool: String,
        clients: usize,
        timeout: Duration,
    ) -> anyhow::Result<Target> {
        let mut connections = Vec::with_capacity(clients);
        for _ in 0..clients.max(1) {
            connections.push(
                connect::connect(&settings.nats, ConnectPurpose::Client)
                    .await
                    .context("cannot connect to NATS")?,
            );
        }
        Ok(Target {
            subjects: Subjects::new(&settings.subjects),
            settings,
            pool,
            connections,
            timeout,
            run_id: format!("bench-{}", crate::protocol::ids::new_id()),
        })
    }

    /// The connection of client `n`.
    pub fn connection(&self, n: usize) -> &async_nats::Client {
        &self.connections[n % self.connections.len()]
    }

    /// A request id of this run: `<run id>-<phase>-<n>`.
    pub fn request_id(&self, phase: &str, n: u64) -> String {
        format!("{}-{phase}-{n}", self.run_id)
    }

    /// Closes the connections, letting what they still hold go out.
    pub async fn close(self) {
        for connection in self.connections {
            let _ = tokio::time::timeout(Duration::from_secs(2), connection.drain()).await;
        }
    }

    /// Releases stored results (a fleet that is not the bench's own keeps them until read),
    /// a few at a time; failures are ignored (a result may be gone already).
    pub async fn release(&self, request_ids: Vec<String>) {
        let client = self.connection(0).clone();
        futures_util::stream::iter(request_ids)
            .for_each_concurrent(32, |id| {
                let client = client.clone();
                let subject = self.subjects.result(&id);
                async move {
                    let request = async_nats::Request::new()
                        .payload(br#"{"release": true}"#.as_slice().into())
                        .timeout(Some(Duration::from_secs(5)));
                    let _ = client.send_request(subject, request).await;
                }
            })
            .await;
    }
}
