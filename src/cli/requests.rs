//! `genfleet submit`, `status`, `result`, `cancel`: the client side of the wire contract.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use futures_util::StreamExt;

use crate::client::Client;
use crate::protocol::{ErrorCode, EventBody, GenerationRequest};
use crate::settings::Settings;

mod show;

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
    /// With --follow: stop at a decision request instead of waiting for its answer and
    /// following the continuation.
    #[arg(long)]
    pub no_chain: bool,
    /// A tool the model may call, by name (repeat for more): the tool services register them
    /// (`genfleet tool-demo` serves calculate and clock).
    #[arg(long = "tool", value_name = "NAME")]
    pub tools: Vec<String>,
    /// The caller's system prompt (after the fleet's own).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Most tokens the model may write per turn.
    #[arg(long, value_name = "N")]
    pub max_tokens: Option<u32>,
    /// Sampling temperature.
    #[arg(long, value_name = "T")]
    pub temperature: Option<f64>,
    /// A name for the job, shown with its signals and decisions.
    #[arg(long, value_name = "NAME")]
    pub job_name: Option<String>,
    /// Metadata carried to the result and signals (repeat for more; VALUE is JSON if it parses
    /// as JSON, else text).
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_metadata)]
    pub metadata: Vec<(String, serde_json::Value)>,
    /// The request's id [default: a fresh ULID].
    #[arg(long, value_name = "ID")]
    pub request_id: Option<String>,
    /// An affinity key: requests that share it go first to the worker that served it last
    /// (a continuation's default is its chain's first request id).
    #[arg(long = "affinity", value_name = "KEY")]
    pub affinity_key: Option<String>,
    /// The priority band: a free slot takes the highest band's requests first.
    #[arg(long, value_enum)]
    pub priority: Option<PriorityArg>,
    /// Submit as this tenant (the subjects' tenant token; the NATS user must be granted it)
    /// [default: the default tenant, on the v1 subjects].
    #[arg(long, value_name = "NAME")]
    pub tenant: Option<String>,
}

/// `--priority`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum PriorityArg {
    High,
    Normal,
    Low,
}

impl From<PriorityArg> for crate::protocol::Priority {
    fn from(arg: PriorityArg) -> Self {
        match arg {
            PriorityArg::High => crate::protocol::Priority::High,
            PriorityArg::Normal => crate::protocol::Priority::Normal,
            PriorityArg::Low => crate::protocol::Priority::Low,
        }
    }
}

/// `KEY=VALUE` of `--metadata`: the value as JSON when it parses (numbers, true, objects ...),
/// else as text.
fn parse_metadata(given: &str) -> Result<(String, serde_json::Value), String> {
    let (key, value) = given
        .split_once('=')
        .ok_or_else(|| format!("{given:?} is not KEY=VALUE"))?;
    if key.is_empty() {
        return Err(format!("{given:?} has no key before '='"));
    }
    let value = serde_json::from_str(value).unwrap_or_else(|_| value.into());
    Ok((key.to_string(), value))
}

#[derive(Debug, Args)]
pub struct IdArgs {
    /// The request's id, as `submit` printed it.
    pub request_id: String,
    /// Print the reply as JSON (for scripts).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DecideArgs {
    /// The decision's id, from its signal (the console, `genfleet manager`, `submit --follow`).
    pub decision_id: String,
    /// The id of the chosen option.
    pub option_id: String,
    /// Why this option: recorded with the answer and shown to other managers.
    #[arg(long)]
    pub rationale: Option<String>,
    /// Who decides (recorded and announced); default: $USER.
    #[arg(long)]
    pub decided_by: Option<String>,
    /// Escalations and checkpoints, with option modify_prompt: the new last user message.
    #[arg(long)]
    pub modified_prompt: Option<String>,
    /// Escalations and checkpoints: a note for the model in the continuation.
    #[arg(long)]
    pub guidance: Option<String>,
    /// Escalations and checkpoints: lowers the next attempt's escalation threshold (0 to 1).
    #[arg(long)]
    pub confidence_boost: Option<f64>,
    /// Print the reply as JSON (for scripts).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ResultArgs {
    /// The request's id, as `submit` printed it.
    pub request_id: String,
    /// Read the result without releasing it.
    #[arg(long)]
    pub peek: bool,
    /// Print the whole result as JSON (for scripts).
    #[arg(long)]
    pub json: bool,
}

/// The request: the prompt or the file, with the flags laid over it (a flag wins over the
/// file's field; tools and metadata add to the file's).
fn read_request(args: &SubmitArgs) -> anyhow::Result<GenerationRequest> {
    let mut request = read_base(args)?;
    for tool in &args.tools {
        if !request.tools.contains(tool) {
            request.tools.push(tool.clone());
        }
    }
    if let Some(system) = &args.system {
        request.system = Some(system.clone());
    }
    if args.max_tokens.is_some() {
        request.max_tokens = args.max_tokens;
    }
    if args.temperature.is_some() {
        request.temperature = args.temperature;
    }
    if let Some(job_name) = &args.job_name {
        request.job_name = Some(job_name.clone());
    }
    for (key, value) in &args.metadata {
        request.metadata.insert(key.clone(), value.clone());
    }
    if let Some(id) = &args.request_id {
        request.request_id = Some(id.clone());
    }
    if let Some(key) = &args.affinity_key {
        request.affinity_key = Some(key.clone());
    }
    if let Some(priority) = args.priority {
        request.priority = Some(priority.into());
    }
    Ok(request)
}

fn read_base(args: &SubmitArgs) -> anyhow::Result<GenerationRequest> {
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
    let mut client = Client::connect(&settings).await?;
    if let Some(tenant) = &args.tenant {
        client = client.with_tenant(tenant.clone())?;
    }
    if args.durable && !args.follow {
        let queued = client.enqueue(&pool, &request).await?;
        warn_if_unserved(&client, &pool).await;
        return print_reply(args.json, &queued, |q| format!("{} QUEUED\n", q.request_id));
    }
    if !args.follow {
        let accepted = client.submit(&pool, &request).await?;
        return print_reply(args.json, &accepted, |a| {
            format!("{} RUNNING on {}\n", a.request_id, a.worker_id)
        });
    }
    let request_id = request
        .request_id
        .get_or_insert_with(crate::protocol::ids::new_id)
        .clone();
    let mut events: Events = Box::pin(client.follow(&request_id).await?);
    if args.durable {
        client.enqueue(&pool, &request).await?;
        warn_if_unserved(&client, &pool).await;
    } else {
        client.submit(&pool, &request).await?;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.wait_secs);
    let mut current = client.on_bus(&request_id);
    loop {
        let result = follow_one(&client, &current, &mut events, deadline, args.json).await?;
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
        let decision = result.signals.iter().rev().find_map(|s| s.decision.clone());
        let waiting = result.reason == crate::protocol::Reason::DecisionRequested;
        match decision {
            Some(decision) if waiting && !args.no_chain => {
                if !args.json {
                    print_decision(&decision);
                }
                // The next thing on this request's subject is `continued` or `chain_ended`.
                match wait_for_answer(&mut events, deadline).await {
                    Some(EventBody::Continued {
                        continuation_request_id,
                    }) => {
                        if !args.json {
                            eprintln!("continuing as {continuation_request_id}");
                        }
                        events = Box::pin(client.follow(&continuation_request_id).await?);
                        current = continuation_request_id;
                    }
                    Some(EventBody::ChainEnded { outcome, .. }) => {
                        anyhow::bail!("the decision ended the job: {}", outcome.as_str());
                    }
                    _ => anyhow::bail!(
                        "no answer to decision {} within the wait",
                        decision.decision_id
                    ),
                }
            }
            _ if result.state == crate::protocol::RequestState::Completed => return Ok(()),
            _ => anyhow::bail!(
                "request {} ended {} ({})",
                result.request_id,
                result.state.as_str(),
                result.reason.as_str()
            ),
        }
    }
}

/// A request queued for a pool no worker serves waits until one does: said plainly on stderr
/// (the queue took it, so this is no failure).
async fn warn_if_unserved(client: &Client, pool: &str) {
    let served = client.pools_served().await;
    if served.contains(pool) {
        return;
    }
    let others = if served.is_empty() {
        "no worker answered the service API just now".to_string()
    } else {
        format!(
            "pools with workers now: {}",
            served.into_iter().collect::<Vec<_>>().join(", ")
        )
    };
    eprintln!(
        "note: no worker of pool {pool} is connected ({others}); the request waits in the queue until one is"
    );
}

type Events = std::pin::Pin<Box<dyn futures_util::Stream<Item = crate::protocol::Event> + Send>>;

/// Prints one request's output as it streams and returns its stored result.
async fn follow_one(
    client: &Client,
    request_id: &str,
    events: &mut Events,
    deadline: tokio::time::Instant,
    json: bool,
) -> anyhow::Result<crate::protocol::GenerationResult> {
    // Deltas are printed as they come only when the stream is followed from its start (`seq`
    // 0): a continuation may have started (or ended) before it was followed, and then its
    // stored output is printed instead, whole.
    let mut from_start = None;
    let finished = tokio::time::timeout_at(deadline, async {
        let mut stdout = std::io::stdout();
        // Events are at most once, and a continuation may have ended before it was followed:
        // the stored state is checked now and then too.
        let mut check = tokio::time::interval(Duration::from_secs(1));
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                event = events.next() => match event {
                    Some(event) => {
                        let whole = *from_start.get_or_insert(event.seq == 0);
                        match event.body {
                            EventBody::Delta { text } if !json && whole => {
                                let _ = stdout.write_all(text.as_bytes());
                                let _ = stdout.flush();
                            }
                            // The tool loop, on stderr beside the output (as the demo
                            // narrates it and the console's timeline shows it).
                            EventBody::ToolCall { name, arguments, .. } if !json => {
                                let _ = stdout.flush();
                                eprintln!("\n▸ tool call: {name} {}", opening(&arguments.to_string()));
                            }
                            EventBody::ToolResult { name, ok, result, .. } if !json => {
                                let failed = if ok { "" } else { " (failed)" };
                                eprintln!("▸ tool result: {name}{failed} → {}", opening(&result.to_string()));
                            }
                            EventBody::Finished { .. } => return true,
                            _ => {}
                        }
                    }
                    None => return false,
                },
                _ = check.tick() => {
                    if client
                        .status(request_id)
                        .await
                        .is_ok_and(|s| s.state.is_terminal())
                    {
                        return false;
                    }
                }
            }
        }
    })
    .await
    .unwrap_or(false);
    if !finished && !json {
        eprintln!("(reading the stored result of {request_id})");
    }
    // A continuation may have started before it was followed: wait for its result.
    let result = loop {
        match client.result(request_id, true).await {
            Err(error)
                if error.code() == Some(crate::protocol::ErrorCode::NotReady)
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => break other?,
        }
    };
    if !json && from_start != Some(true) {
        let mut stdout = std::io::stdout();
        let _ = stdout.write_all(result.output.as_bytes());
        let _ = stdout.flush();
    }
    Ok(result)
}

/// The first characters of a tool's arguments or result, as a line for people.
fn opening(text: &str) -> String {
    crate::protocol::finished::opening(text, TOOL_LINE_CHARS)
}

/// Characters of a tool call's arguments or result `submit --follow` prints.
const TOOL_LINE_CHARS: usize = 300;

async fn wait_for_answer(events: &mut Events, deadline: tokio::time::Instant) -> Option<EventBody> {
    tokio::time::timeout_at(deadline, async {
        while let Some(event) = events.next().await {
            if matches!(
                event.body,
                EventBody::Continued { .. } | EventBody::ChainEnded { .. }
            ) {
                return Some(event.body);
            }
        }
        None
    })
    .await
    .ok()
    .flatten()
}

fn print_decision(decision: &crate::protocol::DecisionBlock) {
    eprintln!(
        "decision {} ({:?}): {}",
        decision.decision_id, decision.kind, decision.question
    );
    for option in &decision.options {
        let default = if decision.default_option.as_deref() == Some(option.id.as_str()) {
            " (default)"
        } else {
            ""
        };
        eprintln!("  {}: {}{default}", option.id, option.label);
    }
    eprintln!(
        "waiting for an answer (genfleet decide {} <option>) ...",
        decision.decision_id
    );
}

pub async fn status(settings: Settings, args: IdArgs) -> anyhow::Result<()> {
    let client = Client::connect(&settings).await?;
    let status = client.status(&args.request_id).await.map_err(|error| {
        if error.code() == Some(ErrorCode::NotFound) {
            anyhow::anyhow!(
                "request {} is not known: not queued, not running, and no record of it \
                 finishing (kept for jetstream.finished_ttl_ms)",
                args.request_id
            )
        } else {
            error.into()
        }
    })?;
    print_reply(args.json, &status, show::status)
}

pub async fn result(settings: Settings, args: ResultArgs) -> anyhow::Result<()> {
    let client = Client::connect(&settings).await?;
    let result = client.result(&args.request_id, !args.peek).await?;
    print_reply(args.json, &result, show::result)
}

pub async fn decide(settings: Settings, args: DecideArgs) -> anyhow::Result<()> {
    let client = Client::connect(&settings).await?;
    let answer = crate::protocol::DecisionAnswer {
        option_id: args.option_id,
        rationale: args.rationale,
        decided_by: args.decided_by.or_else(|| std::env::var("USER").ok()),
        modified_prompt: args.modified_prompt,
        guidance: args.guidance,
        confidence_boost: args.confidence_boost,
    };
    let reply = client.decide(&args.decision_id, &answer).await?;
    print_reply(args.json, &reply, |r| format!("{}\n", show::decided(r)))
}

/// A reply as one line of JSON (`--json`), or as text for people.
fn print_reply<T: serde::Serialize>(
    json: bool,
    reply: &T,
    text: impl FnOnce(&T) -> String,
) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(reply)?);
    } else {
        print!("{}", text(reply));
    }
    Ok(())
}

pub async fn cancel(settings: Settings, args: IdArgs) -> anyhow::Result<()> {
    let client = Client::connect(&settings).await?;
    let reply = client.cancel(&args.request_id).await?;
    print_reply(args.json, &reply, |r| {
        format!("{} {}\n", r.request_id, r.state.as_str())
    })
}
