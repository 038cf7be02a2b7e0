//! `genfleet worker`: the main job, one worker on the bus until SIGTERM or Ctrl-C, then a
//! drain.

use clap::Args;

use crate::actors::Capacity;
use crate::bus::worker;
use crate::observe::Draining;
use crate::settings::Settings;

#[derive(Debug, Args)]
pub struct WorkerArgs {}

pub fn run(settings: Settings, _args: WorkerArgs) -> anyhow::Result<()> {
    let worker_id = settings.worker_id();
    let threads = settings.worker.threads;
    actix::System::with_tokio_rt(move || worker::runtime(threads).expect("a tokio runtime"))
        .block_on(async move {
            worker::run(settings, worker_id, super::shutdown_signal(), None).await?;
            Ok(())
        })
}

/// `/readyz` reads the slots through this: observe sits below the actors and does not name
/// their types, so the impl lives where the worker is put together from both.
impl Draining for Capacity {
    fn draining(&self) -> bool {
        self.draining
    }
}
