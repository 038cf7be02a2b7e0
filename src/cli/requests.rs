//! `genfleet submit`, `status`, `result`, `cancel`: the client side of the wire contract.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use futures_util::StreamExt;

use crate::bus::client::Client;
use crate::protocol::{EventBody, GenerationRequest};
use crate::settings::Settings;

#[derive(Debug, Args)]
pub struct SubmitArgs {
    /// The prompt (one user message). Or give a whole request with --file.
    pub prompt: Option<String>,
    /// A generation request as JSON (see docs/protocol.md); "-" reads standard input.
    #[arg(long, value_name = "FILE", conflicts_with = "prompt")]
    pub file: Option<PathBuf>,
    /// Pool to submit to (default: worker.pool).
    #[arg(long)]
    pub pool: Option<String>,
    /// Put the request on the durable queue instead (it runs when a slot frees, survives worker
    /// failures).
    #[arg(long)]
    pub durable: bool,
    /// Print the output as it streams, then wait for the result.
    #[arg(long)]
    pub follow: bool,
    /// Print replies and results as JSON.
    #[arg(long)]
    pub json: bool,
    /// With --follow: give up waiting after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub wait_secs: u64,
}

#[derive(Debug, Args)]
pub struct IdArgs {
    pub request_id: String,
}

#[derive(Debug, Args)]
pub struct DecideArgs {
    pub decision_id: String,
    /// The id of the chosen option.
    pub option_id: String,
    #[arg(long)]
    pub rationale: Option<String>,
    /// Who decides (recorded and announced); default: $USER.
    #[arg(long)]
    pub decided_by: Option<String>,
}

#[derive(Debug, Args)]
pub struct ResultArgs {
    pub request_id: String,
    /// Read the result without releasing it.
    #[arg(long)]
    pub peek: bool,
}

fn read_request(args: &SubmitArgs) -> anyhow::Result<GenerationRequest> {
    match (&args.prompt, &args.file) {
        (Some(prompt), None) => Ok(GenerationRequest::user(prompt.clone())),
        (None, Some(path)) => {
            let text = if path.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).context("cannot read standard input")?
            } else {
                std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read {}", path.display()))?
            };
            serde_json::from_str(&text).context("the request is not a valid generation request")
        }
        _ => anyhow::bail!("give a prompt or --file REQUEST.json"),
    }
}

pub async fn submit(settings: Settings, args: SubmitArgs) -> anyhow::Result<()> {
    let mut request = read_request(&args)?;
    let pool = args
        .pool
        .clone()
        .unwrap_or_else(|| settings.worker.pool.clone());
    let client = Client::connect(&settings).await?;
    if args.durable && !args.follow {
        let queued = client.enqueue(&pool, &request).await?;
        if args.json {
            println!("{}", serde_json::to_string(&queued)?);
        } else {
            println!("{} QUEUED", queued.request_id);
        }
        return Ok(());
    }
    if !args.follow {
        let accepted = client.submit(&pool, &request).await?;
        if args.json {
            println!("{}", serde_json::to_string(&accepted)?);
        } else {
            println!("{} RUNNING on {}", accepted.request_id, accepted.worker_id);
        }
        return Ok(());
    }
    let request_id = request
        .request_id
        .get_or_insert_with(crate::protocol::ids::new_id)
        .clone();
    let mut events = Box::pin(client.follow(&request_id).await?);
    if args.durable {
        client.enqueue(&pool, &request).await?;
    } else {
        client.submit(&pool, &request).await?;
    }
    let wait = Duration::from_secs(args.wait_secs);
    let finished = tokio::time::timeout(wait, async {
        let mut stdout = std::io::stdout();
        while let Some(event) = events.next().await {
            match event.body {
                EventBody::Delta { text } if !args.json => {
                    let _ = stdout.write_all(text.as_bytes());
                    let _ = stdout.flush();
                }
                EventBody::Finished { .. } => return true,
                _ => {}
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    if !finished {
        eprintln!("(no finished event seen; reading the stored result)");
    }
    let result = client.result(&request_id, true).await?;
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    } else {
        println!();
        let detail = result
            .detail
            .as_deref()
            .map(|d| format!(": {d}"))
            .unwrap_or_default();
        eprintln!(
            "{} {} {}{detail}",
            result.request_id,
            result.state.as_str(),
            result.reason.as_str()
        );
    }
    if result.state == crate::protocol::RequestState::Completed {
        Ok(())
    } else {
        anyhow::bail!(
            "request {} ended {} ({})",
            result.request_id,
            result.state.as_str(),
            result.reason.as_str()
        )
    }
}

pub async fn status(settings: Settings, args: IdArgs) -> anyhow::Result<()> {
    let client = Client::connect(&settings).await?;
    let status = client.status(&args.request_id).await?;
    println!("{}", serde_json::to_string(&status)?);
    Ok(())
}

pub async fn result(settings: Settings, args: ResultArgs) -> anyhow::Result<()> {
    let client = Client::connect(&settings).await?;
    let result = client.result(&args.request_id, !args.peek).await?;
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}

pub async fn decide(settings: Settings, args: DecideArgs) -> anyhow::Result<()> {
    let client = Client::connect(&settings).await?;
    let answer = crate::bus::decisions::DecisionAnswer {
        option_id: args.option_id,
        rationale: args.rationale,
        decided_by: args.decided_by.or_else(|| std::env::var("USER").ok()),
        modified_prompt: None,
        guidance: None,
        confidence_boost: None,
    };
    let reply = client.decide(&args.decision_id, &answer).await?;
    println!("{}", serde_json::to_string(&reply)?);
    Ok(())
}

pub async fn cancel(settings: Settings, args: IdArgs) -> anyhow::Result<()> {
    let client = Client::connect(&settings).await?;
    let reply = client.cancel(&args.request_id).await?;
    println!("{}", serde_json::to_string(&reply)?);
    Ok(())
}
