//! `genfleet submit`, `status`, `result`, `cancel`: the client side of the wire contract.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use crate::client::{Client, Step};
use crate::protocol::{ErrorCode, GenerationRequest};
use crate::settings::Settings;
use anyhow::Context;
use clap::Args;

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
    /// An affinity key: requests that share it go to the key's worker, placed by the pool's
    /// worker that receives them (a continuation's default is its chain's first request id).
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
    // One command sends one request: a keyed one goes to the pool, whose worker places it,
    // since reading the heartbeats first would cost more than that worker's hop.
    let mut client =
        Client::connect(&settings)
            .await?
            .with_placement(&crate::settings::PlacementSettings {
                follow_heartbeats: false,
                ..settings.placement
            });
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
    let mut follow = client.follow_chain(&request_id, !args.no_chain).await?;
    if args.durable {
        client.enqueue(&pool, &request).await?;
        warn_if_unserved(&client, &pool).await;
    } else {
        client.submit(&pool, &request).await?;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.wait_secs);
    let mut stdout = std::io::stdout();
    loop {
        let Ok(step) = tokio::time::timeout_at(deadline, follow.next()).await else {
            anyhow::bail!(
                "request {} did not end within the wait (--wait-secs {})",
                follow.current(),
                args.wait_secs
            );
        };
        match step {
            Some(Step::Text(text)) if !args.json => {
                let _ = stdout.write_all(text.as_bytes());
                let _ = stdout.flush();
            }
            // The tool loop, on stderr beside the output (as the demo narrates it and the
            // console's timeline shows it).
            Some(Step::ToolCall { name, arguments }) if !args.json => {
                let _ = stdout.flush();
                eprintln!("\n▸ tool call: {name} {}", opening(&arguments.to_string()));
            }
            Some(Step::ToolResult { name, ok, result }) if !args.json => {
                let failed = if ok { "" } else { " (failed)" };
                eprintln!(
                    "▸ tool result: {name}{failed} → {}",
                    opening(&result.to_string())
                );
            }
            Some(Step::Ended(result)) => {
                ended(&result, args.json)?;
                // Read: the stored copy is released.
                let _ = client.result(&result.request_id, true).await;
                let decision = result
                    .signals
                    .iter()
                    .rev()
                    .find_map(|s| s.decision.as_ref());
                match decision {
                    Some(decision)
                        if result.reason == crate::protocol::Reason::DecisionRequested
                            && !args.no_chain =>
                    {
                        if !args.json {
                            print_decision(decision);
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
            Some(Step::Continued { request_id }) if !args.json => {
                eprintln!("continuing as {request_id}");
            }
            Some(Step::ChainEnded { outcome }) => {
                anyhow::bail!("the decision ended the job: {}", outcome.as_str());
            }
            Some(Step::Lost(lost)) => {
                anyhow::bail!("following {} stopped: {lost:?}", follow.current())
            }
            Some(_) => {}
            None => return Ok(()),
        }
    }
}

/// What `submit --follow` says of a part of the chain that ended.
fn ended(result: &crate::protocol::GenerationResult, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(result)?);
        return Ok(());
    }
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
    Ok(())
}

/// A request queued for a pool no worker serves waits until one does: said plainly on stderr
/// (the queue took it, so this is no failure).
async fn warn_if_unserved(client: &Client, pool: &str) {
    let served = client.pools_served().await;
    if served.contains(pool) {
        return;
    }
    let others = crate::client::caller::served_now(&served);
    eprintln!(
        "note: no worker of pool {pool} is connected ({others}); the request waits in the queue until one is"
    );
}

/// The first characters of a tool's arguments or result, as a line for people.
fn opening(text: &str) -> String {
    crate::protocol::finished::opening(text, TOOL_LINE_CHARS)
}

/// Characters of a tool call's arguments or result `submit --follow` prints.
const TOOL_LINE_CHARS: usize = 300;

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
