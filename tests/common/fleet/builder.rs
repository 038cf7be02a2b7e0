//! One fleet for a test: a nats-server of its own, the mock backend (or a backend of the test's),
//! workers (in this process, or as `genfleet worker` processes a test can SIGKILL) and a
//! connected client, started in that order and torn down in the reverse one.
//!
//! ```ignore
//! let f = Fleet::builder().script(SCRIPT).workers(2).slots(1).start().await;
//! f.client.run("default", request, WAIT).await?;
//! ```

use std::path::Path;
use std::time::Duration;

use genfleet::bus::worker::WorkerHandle;
use genfleet::cli::tool_demo::{calculate, calculate_definition};
use genfleet::client::Client;
use genfleet::client::tool_service::ToolService;
use genfleet::llm::mock::{MockServer, Script};
use genfleet::settings::Settings;

use super::{Proc, wait_workers, worker};
use crate::common::nats::NatsServer;

/// How long workers started as processes may take to answer.
const PROCESSES_ANSWER_WITHIN: Duration = Duration::from_secs(30);
/// The client's timeout in a brisk fleet (the default).
const BRISK_CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// A running fleet. Fields drop in order: in-process workers drain while NATS is still up,
/// worker processes are killed, and the server goes last.
pub struct Fleet {
    /// The workers running in this process, in the order they started.
    pub workers: Vec<WorkerHandle>,
    /// The workers running as `genfleet worker` processes, in the order they started.
    pub processes: Vec<Proc>,
    /// Tool services the fleet started (the demo calculator).
    pub tool_services: Vec<ToolService>,
    pub client: Client,
    /// What the in-process workers run with (and the client connects with, unless told
    /// otherwise).
    pub settings: Settings,
    /// The mock backend, unless the test brought its own (a test may stop it and start another).
    pub mock: Option<MockServer>,
    /// What every worker process gets besides its id and the NATS address.
    process_env: Vec<(&'static str, String)>,
    logs: tempfile::TempDir,
    pub nats: NatsServer,
}

/// A change to the settings, made before anything starts.
type Tune<'a> = Box<dyn FnOnce(&mut Settings) + 'a>;

/// What a fleet starts with; see [`Fleet::builder`].
pub struct FleetBuilder<'a> {
    nats_config: String,
    backend: Backend,
    workers: Workers,
    slots: Option<u32>,
    brisk: bool,
    tunes: Vec<Tune<'a>>,
    client_tunes: Vec<Tune<'a>>,
    client_timeout: Option<Duration>,
    process_env: Vec<(&'static str, String)>,
    calculator: bool,
}

enum Backend {
    Mock(Script),
    At(String),
}

enum Workers {
    InProcess(usize),
    Processes(Vec<String>),
}

impl Fleet {
    /// A fleet of one in-process worker on the echoing mock backend, brisk settings (a short
    /// drain, every delta its own event) and a client with a 10 s timeout, unless told
    /// otherwise.
    pub fn builder<'a>() -> FleetBuilder<'a> {
        FleetBuilder {
            nats_config: String::new(),
            backend: Backend::Mock(Script::echo()),
            workers: Workers::InProcess(1),
            slots: None,
            brisk: true,
            tunes: Vec::new(),
            client_tunes: Vec::new(),
            client_timeout: None,
            process_env: Vec::new(),
            calculator: false,
        }
    }

    /// The mock backend.
    pub fn mock(&self) -> &MockServer {
        self.mock.as_ref().expect("the fleet runs the mock backend")
    }

    /// Where worker processes write their logs (`<id>.log`).
    pub fn logs(&self) -> &Path {
        self.logs.path()
    }

    /// Starts another in-process worker with the fleet's settings; the test owns it.
    pub async fn start_worker(&self) -> WorkerHandle {
        spawn_worker(self.settings.clone()).await
    }

    /// Starts another worker process with the fleet's environment and `extra` settings
    /// (`GENFLEET__...`); the test owns it.
    pub fn start_worker_process(&self, id: &str, extra: &[(&'static str, String)]) -> Proc {
        let mut env = self.process_env.clone();
        env.extend(extra.iter().cloned());
        worker(id, &self.nats.url(), &env, self.logs())
    }

    /// [`Self::start_worker_process`] of another `genfleet` executable (another release's),
    /// given only what every worker process gets (the backend, the slots): settings this
    /// release added would be unknown keys to it.
    pub fn start_worker_process_of(&self, exe: &Path, id: &str) -> Proc {
        super::worker_of(
            std::process::Command::new(exe),
            id,
            &self.nats.url(),
            &self.process_env,
            self.logs(),
        )
    }
}

impl<'a> FleetBuilder<'a> {
    /// The mock backend's script, in TOML.
    pub fn script(self, toml: &str) -> Self {
        self.mock_script(Script::from_toml_str(toml).expect("the test script parses"))
    }

    pub fn mock_script(mut self, script: Script) -> Self {
        self.backend = Backend::Mock(script);
        self
    }

    /// A backend the test runs itself (a real model server, a mock process it kills ...)
    /// instead of the mock.
    pub fn backend_url(mut self, base_url: impl Into<String>) -> Self {
        self.backend = Backend::At(base_url.into());
        self
    }

    /// What follows the generated nats-server configuration: authorization, limits ...
    pub fn nats_config(mut self, conf: impl Into<String>) -> Self {
        self.nats_config = conf.into();
        self
    }

    /// How many workers run in this process (0: the test starts them).
    pub fn workers(mut self, count: usize) -> Self {
        self.workers = Workers::InProcess(count);
        self
    }

    /// Workers as `genfleet worker` processes with these ids, instead of in this process. They
    /// get the NATS and backend addresses, the slots and [`Self::worker_env`]; the settings
    /// closures reach only the client.
    pub fn worker_processes<S: Into<String>>(mut self, ids: impl IntoIterator<Item = S>) -> Self {
        self.workers = Workers::Processes(ids.into_iter().map(Into::into).collect());
        self
    }

    /// Settings (`GENFLEET__...`) for the worker processes.
    pub fn worker_env(mut self, key: &'static str, value: impl ToString) -> Self {
        self.process_env.push((key, value.to_string()));
        self
    }

    pub fn slots(mut self, slots: u32) -> Self {
        self.slots = Some(slots);
        self
    }

    /// Adjusts the settings of the workers and the client (applied in order, after the
    /// addresses, the slots and the brisk settings).
    pub fn settings(mut self, tune: impl FnOnce(&mut Settings) + 'a) -> Self {
        self.tunes.push(Box::new(tune));
        self
    }

    /// Adjusts the client's settings only (another user, another timeout on the connection).
    pub fn client_settings(mut self, tune: impl FnOnce(&mut Settings) + 'a) -> Self {
        self.client_tunes.push(Box::new(tune));
        self
    }

    /// The built-in settings, with only the addresses (and the slots, when given) set: the
    /// default drain and delta coalescing, and the client's own timeout.
    pub fn default_settings(mut self) -> Self {
        self.brisk = false;
        self
    }

    pub fn client_timeout(mut self, timeout: Duration) -> Self {
        self.client_timeout = Some(timeout);
        self
    }

    /// The demo calculator (`genfleet tool-demo`'s `calculate`) served as a tool service.
    pub fn calculator(mut self) -> Self {
        self.calculator = true;
        self
    }

    pub async fn start(self) -> Fleet {
        let nats = NatsServer::start_with_config(&self.nats_config).await;
        let (mock, base_url) = match self.backend {
            Backend::Mock(script) => {
                let mock = MockServer::start(script).await.expect("the mock starts");
                let base_url = mock.base_url();
                (Some(mock), base_url)
            }
            Backend::At(base_url) => (None, base_url),
        };
        let mut settings = Settings::defaults();
        settings.nats.url = nats.url();
        settings.llm.base_url = base_url.clone();
        let mut process_env = vec![("GENFLEET__LLM__BASE_URL", base_url)];
        if let Some(slots) = self.slots {
            settings.worker.slots = slots;
            process_env.push(("GENFLEET__WORKER__SLOTS", slots.to_string()));
        }
        process_env.extend(self.process_env);
        if self.brisk {
            settings.worker.drain_timeout_ms = 2000;
            settings.generation.delta_coalesce_ms = 0;
        }
        for tune in self.tunes {
            tune(&mut settings);
        }
        let logs = tempfile::tempdir().expect("a directory for the workers' logs");
        let mut workers = Vec::new();
        let mut processes = Vec::new();
        match &self.workers {
            Workers::InProcess(count) => {
                for _ in 0..*count {
                    workers.push(spawn_worker(settings.clone()).await);
                }
            }
            Workers::Processes(ids) => {
                for id in ids {
                    processes.push(worker(id, &nats.url(), &process_env, logs.path()));
                }
            }
        }
        let mut client_settings = settings.clone();
        for tune in self.client_tunes {
            tune(&mut client_settings);
        }
        let mut client = Client::connect(&client_settings)
            .await
            .expect("the client connects");
        let timeout = match (self.client_timeout, self.brisk) {
            (Some(timeout), _) => Some(timeout),
            (None, true) => Some(BRISK_CLIENT_TIMEOUT),
            (None, false) => None,
        };
        if let Some(timeout) = timeout {
            client = client.with_timeout(timeout);
        }
        if !processes.is_empty() {
            wait_workers(
                client.nats(),
                processes.len(),
                PROCESSES_ANSWER_WITHIN,
                logs.path(),
            )
            .await;
        }
        let mut tool_services = Vec::new();
        if self.calculator {
            tool_services.push(calculator(client.nats().clone(), &settings).await);
        }
        Fleet {
            workers,
            processes,
            tool_services,
            client,
            settings,
            mock,
            process_env,
            logs,
            nats,
        }
    }
}

/// A worker in this process, once it serves.
async fn spawn_worker(settings: Settings) -> WorkerHandle {
    tokio::task::spawn_blocking(move || WorkerHandle::spawn(settings))
        .await
        .expect("the worker's start does not panic")
        .unwrap_or_else(|e| panic!("the worker starts: {e}"))
}

/// The demo calculator (`genfleet tool-demo`'s `calculate`) as a tool service on `nats`.
pub async fn calculator(nats: async_nats::Client, settings: &Settings) -> ToolService {
    ToolService::start(
        nats,
        settings,
        calculate_definition(),
        |arguments, _| async move { calculate(&arguments) },
    )
    .await
    .unwrap_or_else(|e| panic!("the calculator registers: {e}"))
}
